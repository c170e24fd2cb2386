"""Load every kernel the way model code does, offline, run it on the device at hand against its reference.

Each kernel comes from `get_kernel("tessera/<name>", version=1)` with `HF_HUB_OFFLINE=1` and the local Hub
cache (`make hub`). Inputs are realistic and small; the error column compares the kernel's result, on whichever
path the device takes (the fused one on CUDA, the package's eager reference on the CPU), with a float64
computation written here from each op's definition, independent of the package's code.
"""

import argparse
import math
import os
import statistics
import sys
import time

from .common import HUB_CACHE, HUB_ORG


def _timed(fn, device: str, repeats: int = 5):
    """The result of fn() and its median wall time in ms, device work included."""
    import torch

    out = fn()
    times = []
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return out, statistics.median(times)


def _rel_err(xs, refs) -> float:
    """The largest relative Frobenius error over the tensors of a result."""
    return max(((x.double().cpu() - r.double()).norm() / r.double().norm()).item() for x, r in zip(xs, refs))


def ldsa_float64(a_logits, v, left, right):
    """out[b,h,d,t] = sum_k softmax_k(a_logits[b,h,:,t]) v[b,h,d,t-left+k], v zero outside [0, T)."""
    import torch

    a = torch.softmax(a_logits.double().cpu(), dim=2)
    windows = torch.nn.functional.pad(v.double().cpu(), (left, right)).unfold(-1, left + right + 1, 1)
    return torch.einsum("bhkt,bhdtk->bhdt", a, windows)


def log_mel_float64(stft, filters):
    """Per clip: log10(max(|stft|^2 @ filters^T, 1e-10)), floored at the clip's maximum - 8, then (x + 4) / 4."""
    import torch

    mel = (stft.cpu().cdouble().abs() ** 2) @ filters.cpu().double().T
    log = torch.log10(mel.clamp_min(1e-10))
    return (torch.maximum(log, log.amax(dim=(1, 2), keepdim=True) - 8) + 4) / 4


def based_float64_grads(q, k, v, do):
    """Autograd of o_i = sum_{j<=i} A_ij v_j / (sum_{j<=i} A_ij + 1e-6), A = 1 + s + s^2 / 2, s = q_i.k_j / sqrt(K)."""
    import torch

    q, k, v = (x.detach().cpu().double().requires_grad_() for x in (q, k, v))
    s = torch.einsum("bihd,bjhd->bhij", q * q.shape[-1] ** -0.5, k)
    a = (1 + s + s * s / 2).tril()
    o = torch.einsum("bhij,bjhd->bihd", a, v) / (a.sum(-1).transpose(1, 2)[..., None] + 1e-6)
    return torch.autograd.grad(o, (q, k, v), do.cpu().double())


def comba_float64_grads(q, k, v, p, beta, g, do):
    """Autograd of Comba's recurrence one token at a time, state S (K, V) from zero: S = exp(g_t) S,
    u_t = beta_t (v_t - S^T p_t), S = S + k_t u_t^T, o_t = S^T q_t / sqrt(K); grads of (q, k, v, p, beta, g)."""
    import torch

    inputs = [x.detach().cpu().double().requires_grad_() for x in (q, k, v, p, beta, g)]
    q, k, v, p, beta, g = inputs
    B, T, H, K = q.shape
    S = q.new_zeros(B, H, K, v.shape[-1])
    outs = []
    for t in range(T):
        S = g[:, t].exp()[..., None, None] * S
        u = beta[:, t, :, None] * (v[:, t] - torch.einsum("bhkv,bhk->bhv", S, p[:, t]))
        S = S + k[:, t, :, :, None] * u[:, :, None, :]
        outs.append(torch.einsum("bhkv,bhk->bhv", S, q[:, t] * K**-0.5))
    return torch.autograd.grad(torch.stack(outs, 1), inputs, do.cpu().double())


def ldsa_case(k, device, gen):
    import torch

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    B, H, Dh, T, left, right = 4, 8, 64, 1500, 14, 0  # 15 s of 10 ms frames, a streaming (causal) window
    a = torch.randn(B, H, left + right + 1, T, generator=gen).mul(2).to(device, dtype)
    v = torch.randn(B, H, Dh, T, generator=gen).to(device, dtype)
    out, ms = _timed(lambda: k.ldsa_local_attention(a, v, left, right), device)
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    err = _rel_err([out], [ldsa_float64(a, v, left, right)])
    return f"[B,H,Dh,T]={[B, H, Dh, T]} W=15 causal {str(dtype)[6:]}", k.kernel_path(a), err, ms, tol


def log_mel_case(k, device, gen):
    import torch

    sr, seconds = 16000, 30
    t = torch.arange(sr * seconds) / sr
    chirp = torch.sin(2 * math.pi * (200 + 1500 * t / seconds) * t)
    audio = torch.stack([0.3 * chirp + 0.05 * torch.randn(t.shape, generator=gen), torch.zeros_like(t)])  # + silence
    window = torch.hann_window(400)
    stft = torch.stft(audio, 400, 160, window=window, return_complex=True)[..., :-1].transpose(1, 2).contiguous()
    stft, filters = stft.to(device), k.mel_filters(80).to(device)
    out, ms = _timed(lambda: k.log_mel_spectrogram(stft, filters), device)
    err = _rel_err([out], [log_mel_float64(stft, filters)])
    return "2 clips x 30 s (one silent), NF=201, 80 Whisper mels", k.kernel_path(stft), err, ms, 1e-4


def based_case(k, device, gen):
    import torch

    B, T, H, K, V = 1, 1024, 4, 16, 64
    q, kk, do = (torch.randn(B, T, H, n, generator=gen).to(device, torch.bfloat16) for n in (K, K, V))
    v = torch.randn(B, T, H, V, generator=gen).to(device, torch.bfloat16)
    grads, ms = _timed(lambda: k.based_backward(q, kk, v, do), device)
    err = _rel_err(grads, based_float64_grads(q, kk, v, do))
    return f"(B,T,H,K,V)={(B, T, H, K, V)} bf16", k.kernel_path(q), err, ms, 2e-2


def comba_case(k, device, gen):
    import torch

    B, T, H, K, V = 1, 512, 4, 64, 64
    unit = lambda: torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)  # noqa: E731
    q = torch.randn(B, T, H, K, generator=gen)
    kk, p = unit(), unit()
    v, do = torch.randn(B, T, H, V, generator=gen), torch.randn(B, T, H, V, generator=gen)
    beta = torch.rand(B, T, H, generator=gen).sigmoid()
    g = torch.nn.functional.logsigmoid(torch.randn(B, T, H, generator=gen)) / 4
    q, kk, v, p, beta, do = (x.to(device, torch.bfloat16) for x in (q, kk, v, p, beta, do))
    g = g.to(device)
    grads, ms = _timed(lambda: k.comba_backward(q, kk, v, p, beta, g, do), device)
    err = _rel_err(grads, comba_float64_grads(q, kk, v, p, beta, g, do))
    return f"(B,T,H,K,V)={(B, T, H, K, V)} bf16", k.kernel_path(q), err, ms, 2e-2


CASES = {"ldsa": ldsa_case, "log-mel": log_mel_case, "based-bwd": based_case, "comba-bwd": comba_case}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("kernels", nargs="*", help=f"kernel names (default: all of {', '.join(CASES)})")
    parser.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda when present, else cpu")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_CACHE", str(HUB_CACHE))
    os.environ["HF_HUB_OFFLINE"] = "1"

    import torch
    from kernels import get_kernel

    unknown = set(args.kernels) - set(CASES)
    if unknown:
        parser.error(f"unknown kernels {sorted(unknown)}")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    gen = torch.Generator().manual_seed(0)
    rows = []
    for name in args.kernels or CASES:
        kernel = get_kernel(f"{HUB_ORG}/{name}", version=1, trust_remote_code=True)
        case, path, err, ms, tol = CASES[name](kernel, device, gen)
        ok = "yes" if err <= tol else "NO"
        rows.append((f"{HUB_ORG}/{name} v1", device, path, f"{err:.1e}", f"<= {tol:.0e}", ok, f"{ms:.2f} ms", case))
    header = ("kernel", "device", "path", "rel. error vs float64", "tolerance", "ok", "time", "input")
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    for row in [header, tuple("-" * w for w in widths), *rows]:
        print("  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip())
    return 0 if all(r[5] == "yes" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
