"""comba-bwd benchmarks: the `kernels benchmark` class for one shape, and the side-by-side table for the GPU run.

Credited TFLOP/s use the spec's canonical_work (2x the chunked forward's FLOPs, from the shape alone). Errors
are the relative Frobenius error of each of the six gradients against the spec's reference run in fp32 on
fp32 copies of the bf16 inputs (computed once per shape).

Anchors in the same run (anchors/ANCHORS.md): the spec's seed reference (autograd through the chunked fp32
forward), and fla 0.6.0 `chunk_comba` forward + backward called with the exact adapter p' = exp(g) p (fla reads
the state before the decay, the spec after), with fla's Hopper/Triton guard (fla #640) lifted: a speed figure,
its errors are reported beside it. fla's kernels take p' in the inputs' dtype (bf16): an fp32 p' (exp(g) is
fp32) does not compile in its recompute_w_u kernel.

At one measure shape per K (SWEEP_SHAPES) the sweep times every stage (kernel) of the backward alone, in `ms_<stage>`
columns beside the whole, so the run shows where the time goes.
"""

import importlib
import traceback

import torch
from kernels.benchmark import Benchmark

SPEC = "comba_backward"
NAMES = ("dq", "dk", "dv", "dp", "dbeta", "dg")
BENCH_SHAPE = (8, 2048, 32, 128, 128)
SWEEP_SHAPES = [(8, 2048, 32, 128, 128), (16, 2048, 32, 64, 128)]


def _make(B, T, H, K, V, device, seed=0):
    """The spec's input distribution (its make() is only reachable through the GPU harness's bench.spec)."""
    import torch.nn.functional as F

    gen = torch.Generator(device=device).manual_seed(seed)
    bf = dict(device=device, dtype=torch.bfloat16, generator=gen)
    q = torch.randn(B, T, H, K, **bf)
    k = F.normalize(torch.randn(B, T, H, K, device=device, generator=gen), dim=-1).to(torch.bfloat16)
    v = torch.randn(B, T, H, V, **bf)
    p = F.normalize(torch.randn(B, T, H, K, device=device, generator=gen), dim=-1).to(torch.bfloat16)
    beta = torch.rand(B, T, H, device=device, generator=gen).sigmoid().to(torch.bfloat16)
    g = (F.logsigmoid(torch.randn(B, T, H, device=device, generator=gen)) / 4.0).float()
    do = torch.randn(B, T, H, V, **bf)
    return q, k, v, p, beta, g, do


class CombaBackward(Benchmark):
    """bf16, (B, T, H, K, V) = (8, 2048, 32, 128, 128): the first measure shape of the spec. `out` is dq."""

    seed = 0

    def setup(self):
        self.inputs = _make(*BENCH_SHAPE, self.device)
        self.out = torch.empty_like(self.inputs[0])

    def benchmark_backward(self):
        self.out = self.kernel.comba_backward(*self.inputs)[0]

    def verify_backward(self) -> torch.Tensor:
        return self.kernel.comba_backward_reference(*(x.float() for x in self.inputs))[0].to(self.out.dtype)


def _fla_fwd_bwd(bench):
    """fla chunk_comba forward + backward through the exact adapter, or None when fla is not installed."""
    fla = bench.optional("fla")
    if fla is None:
        return None
    import fla.ops.common.chunk_o as chunk_o
    from fla.ops.comba import chunk_comba

    chunk_o.TRITON_ABOVE_3_7_1 = True  # lift the Hopper guard of fla #640: a timing anchor only

    def run(q, k, v, p, beta, g, do):
        ins = [x.detach().requires_grad_(True) for x in (q, k, v, p, beta, g)]
        qq, kk, vv, pp, bb, gg = ins
        p_read = (gg.exp()[..., None] * pp).to(pp.dtype)    # fla reads before the decay; the spec after
        o, _ = chunk_comba(qq, kk, vv, p_read, gg, bb)      # fla's order: (..., p, g, beta)
        return torch.autograd.grad(o, ins, do)

    return run


def _errors(bench, got, ref):
    return {f"err_{n}": bench.rel_err(a, b) for n, a, b in zip(NAMES, got, ref)}


def _row(case, impl, ms, tflop, errs=None, **extra):
    row = {"case": case, "impl": impl, "ms": ms, "metric": "TFLOP/s", "value": tflop / ms * 1e3,
           "err": max(errs.values()) if errs else None}
    row.update(errs or {})
    row.update(extra)
    return row


def _error_row(case, impl, e):
    """An anchor that failed: the end of its message (where Triton puts the reason) and of the traceback."""
    text = "".join(traceback.format_exception_only(type(e), e)).strip()
    return {"case": case, "impl": impl, "error": text[-600:], "where": traceback.format_exc()[-400:]}


def _stage_sweep(bench, pipeline, case, tflop, inputs, ref, scale):
    """The whole backward and each of its stages alone (`ms_<stage>`), at one shape."""
    stages, grads = pipeline.backward_stages(*inputs, scale)
    run = lambda: [launch() for launch in stages.values()]  # noqa: E731
    run()
    errs = _errors(bench, [x[:, : inputs[0].shape[1]] for x in grads], ref)   # grads are padded in time
    t_all = bench.time(run)
    return _row(case, "sweep stages", t_all, tflop, errs, **{f"ms_{n}": bench.time(f) for n, f in stages.items()})


def side_by_side(kernel, bench, shapes=None, sweep_shapes=None, time_seed_reference=True) -> list[dict]:
    """Every measure shape of the spec: ours, fla chunk_comba fwd+bwd (if installed), the spec's seed reference;
    then the stage sweep at SWEEP_SHAPES. `shapes`/`sweep_shapes` exist for a dry run at tiny shapes on the CPU."""
    s = bench.spec(SPEC)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    fla = _fla_fwd_bwd(bench)
    pipeline = importlib.import_module(f"{kernel.__name__}.backward")
    shapes = [tuple(x) for x in (shapes or s.measure_shapes)]
    sweep_shapes = [tuple(x) for x in (sweep_shapes or SWEEP_SHAPES)] if bench.sweep else []
    rows = []
    for shape in dict.fromkeys(shapes + sweep_shapes):
        case = "(B,T,H,K,V)=" + ",".join(map(str, shape)) + " bf16"
        tflop = s.work(*shape) / 1e12
        inputs = s.make(*shape, 0)
        ref = s.ref(*(x.float() for x in inputs))
        if shape in shapes:
            errs = _errors(bench, kernel.comba_backward(*inputs), ref)
            t_ours = bench.time(lambda: kernel.comba_backward(*inputs))
            ours = _row(case, "comba-bwd triton", t_ours, tflop, errs, path=kernel.kernel_path(inputs[0]))
            rows.append(ours)
            if fla is not None:
                impl = "fla 0.6.0 chunk_comba fwd+bwd (p'=exp(g)p bf16, guard lifted)"
                try:
                    fla_errs = _errors(bench, fla(*inputs), ref)
                    t_fla = bench.time(lambda: fla(*inputs))
                    rows.append(_row(case, impl, t_fla, tflop, fla_errs))
                    ours["x_vs_fla"] = t_fla / t_ours
                except Exception as e:  # noqa: BLE001 - an anchor failing must not hide our row
                    rows.append(_error_row(case, impl, e))
            if time_seed_reference:
                t_seed = bench.time(lambda: s.ref(*inputs))
                rows.append(_row(case, "spec seed reference (autograd, fp32)", t_seed, tflop))
                ours["x_vs_seed_reference"] = t_seed / t_ours
        if shape in sweep_shapes:
            rows.append(_stage_sweep(bench, pipeline, case, tflop, inputs, ref, shape[3] ** -0.5))
        del inputs, ref
        if device == "cuda":
            torch.cuda.empty_cache()
    return rows


def compile_cases(kernel, spec):
    """(label, call) pairs for `python -m tools.compile_sm90`: the backward at every measure shape, on meta
    tensors (bf16, g in float32)."""
    pipeline = importlib.import_module(f"{kernel.__name__}.backward")

    def case(shape):
        B, T, H, K, V = shape
        q, k, p = (torch.empty(B, T, H, K, dtype=torch.bfloat16, device="meta") for _ in range(3))
        v, do = (torch.empty(B, T, H, V, dtype=torch.bfloat16, device="meta") for _ in range(2))
        beta = torch.empty(B, T, H, dtype=torch.bfloat16, device="meta")
        g = torch.empty(B, T, H, dtype=torch.float32, device="meta")
        return f"(B,T,H,K,V)={shape}", lambda: pipeline.fused_backward(q, k, v, p, beta, g, do, K**-0.5)

    for shape in spec("comba_backward").measure_shapes:
        yield case(shape)
