"""ldsa benchmarks: the `kernels benchmark` class (small, medium and large workloads), the side-by-side table for the
GPU run, and the offline compile cases.

Bytes are the minimal traffic: forward reads a_logits and v once and writes out once; backward reads
a_logits, v and grad_out once and writes dlogits and dv once. GB/s = those bytes / time, and pct_copy
compares it with the device-to-device copy bandwidth measured in the same run.
"""

import contextlib
import importlib
import time

import torch
from kernels.benchmark import Benchmark

H, DH = 8, 64
WINDOWS = {"causal": (14, 0), "centered": (7, 7)}
# The card's table, plus the largest training batch of the issue.
CARD_SHAPES = [(16, 256), (16, 512), (32, 1024), (16, 2048), (32, 3000), (64, 3000)]
BACKWARD_SHAPES = [(64, 3000)]
COMPILE_SHAPES = [(64, 3000)]  # torch.compile(reference) anchor: compiled once per window, bf16 only
LATENCY_SHAPE, LATENCY_CALLS, LATENCY_PASSES = (16, 256), 2000, 5
# Seconds of back-to-back calls before a latency row's timed passes: on the shared GPU host the first few tenths
# of a second of launches after the heavy rows run slow for every call, torch's own included.
LATENCY_WARMUP_S = 0.5
# The candidate sweep (every forward and backward configuration of both designs, side by side): each
# (shape, window, dtype) here costs one compile per configuration, so the cases are few.
SWEEP_CASES = [
    ((64, 3000), "causal", torch.bfloat16),
    ((64, 3000), "centered", torch.bfloat16),
    ((32, 1024), "causal", torch.bfloat16),
    ((64, 3000), "causal", torch.float32),
    ((32, 1024), "centered", torch.float32),
]


def make_inputs(B, T, left, right, dtype, device, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    a_logits = (2 * torch.randn(B, H, left + right + 1, T, generator=g, device=device)).to(dtype)
    v = torch.randn(B, H, DH, T, generator=g, device=device).to(dtype)
    return a_logits, v


def unfold_einsum(a_logits, v, left, right):
    """The other eager formulation of the anchors: a materialized [B, H, Dh, T, W] unfold."""
    a = torch.softmax(a_logits.float(), dim=2)
    windows = torch.nn.functional.pad(v.float(), (left, right)).unfold(-1, left + right + 1, 1)
    return torch.einsum("bhkt,bhdtk->bhdt", a, windows).to(v.dtype)


# The `kernels benchmark` workloads, [B, T] by device: the card's launch-bound, middle and largest bf16 shapes on a
# GPU; on a CPU, where the op is the eager reference, shapes that cost seconds in all.
WORKLOADS = {
    "cuda": {"small": (16, 256), "medium": (32, 1024), "large": (64, 3000)},
    "cpu": {"small": (1, 256), "medium": (2, 1024), "large": (4, 3000)},
}
# The CLI compares outputs with torch.allclose(atol=1e-2): values of standard deviation 1/4 keep every output below 2,
# where one bf16 rounding step (a kernel and the reference may round a float32 sum differently) is below 1e-2.
WORKLOAD_VALUE_SCALE = 0.25


class LDSAForward(Benchmark):
    """The forward, bf16, H=8, Dh=64, causal W=15, at a small, a medium and a large [B, T] (WORKLOADS)."""

    seed = 0

    def _setup(self, size: str):
        B, T = WORKLOADS["cuda" if self.device == "cuda" else "cpu"][size]
        self.a_logits, v = make_inputs(B, T, 14, 0, torch.bfloat16, self.device)
        self.v = v * WORKLOAD_VALUE_SCALE
        self.out = torch.empty_like(self.v)

    def _run(self):
        self.out = self.kernel.ldsa_local_attention(self.a_logits, self.v, 14, 0)

    def _reference(self) -> torch.Tensor:
        return self.kernel.ldsa_forward_reference(self.a_logits, self.v, 14, 0)

    def setup_small(self):
        self._setup("small")

    def benchmark_small(self):
        self._run()

    def verify_small(self) -> torch.Tensor:
        return self._reference()

    def setup_medium(self):
        self._setup("medium")

    def benchmark_medium(self):
        self._run()

    def verify_medium(self) -> torch.Tensor:
        return self._reference()

    def setup_large(self):
        self._setup("large")

    def benchmark_large(self):
        self._run()

    def verify_large(self) -> torch.Tensor:
        return self._reference()


def _errors(bench, x, ref):
    return bench.rel_err(x, ref), (x.float() - ref.float()).abs().max().item()


def _row(case, impl, ms, nbytes, bench, err=None, max_abs=None, **extra):
    gbps = nbytes / (ms * 1e-3) / 1e9
    row = {"case": case, "impl": impl, "ms": ms, "metric": "GB/s", "value": gbps, "err": err}
    row.update(max_abs_err=max_abs, pct_copy=100 * gbps / bench.copy_gbps, **extra)
    return row


def _forward_rows(kernel, bench, B, T, window, dtype, device):
    left, right = WINDOWS[window]
    W, elt = left + right + 1, torch.finfo(dtype).bits // 8
    a, v = make_inputs(B, T, left, right, dtype, device)
    nbytes = B * H * T * (W + 2 * DH) * elt
    case = f"fwd [B,T]=[{B},{T}] H={H} Dh={DH} W={W} {window} {str(dtype)[6:]}"
    ref = kernel.ldsa_forward_reference(a, v, left, right)
    with torch.no_grad():
        ours = kernel.ldsa_local_attention(a, v, left, right)
        t_ours = bench.time(lambda: kernel.ldsa_local_attention(a, v, left, right))
        t_eager = bench.time(lambda: kernel.ldsa_forward_reference(a, v, left, right))
        t_unfold = bench.time(lambda: unfold_einsum(a, v, left, right))
        unfolded = unfold_einsum(a, v, left, right)
    rows = [
        _row(case, "ldsa triton", t_ours, nbytes, bench, *_errors(bench, ours, ref), x_vs_eager=t_eager / t_ours,
             x_vs_unfold_einsum=t_unfold / t_ours, path=kernel.kernel_path(v)),
        _row(case, "eager reference (shift-mul-add)", t_eager, nbytes, bench, 0.0, 0.0),
        _row(case, "unfold + einsum", t_unfold, nbytes, bench, *_errors(bench, unfolded, ref)),
    ]
    if (B, T) in COMPILE_SHAPES and dtype == torch.bfloat16 and device == "cuda":
        compiled = torch.compile(kernel.ldsa_forward_reference, dynamic=False)
        with torch.no_grad():
            t_compiled = bench.time(lambda: compiled(a, v, left, right))
            rows.append(_row(case, "torch.compile(reference)", t_compiled, nbytes, bench,
                             *_errors(bench, compiled(a, v, left, right), ref), x_ours_vs_this=t_compiled / t_ours))
    return rows


def _backward_rows(kernel, bench, B, T, window, dtype, device):
    left, right = WINDOWS[window]
    W, elt = left + right + 1, torch.finfo(dtype).bits // 8
    a, v = make_inputs(B, T, left, right, dtype, device)
    go = torch.randn_like(v)
    nbytes = B * H * T * (2 * W + 3 * DH) * elt
    case = f"bwd [B,T]=[{B},{T}] H={H} Dh={DH} W={W} {window} {str(dtype)[6:]}"
    ref_dl, ref_dv = kernel.ldsa_backward_reference(a, v, go, left, right)
    dl, dv = kernel.op.ldsa_backward_op(a, v, go, left, right)
    err = max(bench.rel_err(dl, ref_dl), bench.rel_err(dv, ref_dv))
    max_abs = max((dl.float() - ref_dl.float()).abs().max().item(), (dv.float() - ref_dv.float()).abs().max().item())
    t_ours = bench.time(lambda: kernel.op.ldsa_backward_op(a, v, go, left, right))
    # Eager autograd through the reference: the graph is built once, only the backward is timed.
    a_req, v_req = a.clone().requires_grad_(), v.clone().requires_grad_()
    out = kernel.ldsa_forward_reference(a_req, v_req, left, right)
    t_autograd = bench.time(lambda: torch.autograd.grad(out, (a_req, v_req), go, retain_graph=True))
    t_analytic = bench.time(lambda: kernel.ldsa_backward_reference(a, v, go, left, right))
    return [
        _row(case, "ldsa triton backward", t_ours, nbytes, bench, err, max_abs, x_vs_eager_autograd=t_autograd / t_ours,
             x_vs_eager_analytic=t_analytic / t_ours),
        _row(case, "eager autograd of the reference", t_autograd, nbytes, bench),
        _row(case, "eager analytic backward (reference.py)", t_analytic, nbytes, bench),
    ]


def _latency_rows(kernel, bench, B, T, device):
    """Per-call time from Python, host overhead included: N calls back to back, one sync at each end."""
    left, right = WINDOWS["causal"]
    a, v = make_inputs(B, T, left, right, torch.bfloat16, device)
    nbytes = B * H * T * (left + right + 1 + 2 * DH) * 2
    calls = {
        "public op, no grad (direct launch)": lambda: kernel.ldsa_local_attention(a, v, left, right),
        "registered custom op": lambda: kernel.op.ldsa_forward_op(a, v, left, right),
    }
    rows = []
    for impl, fn in calls.items():
        with torch.no_grad():
            us = _host_latency_us(fn, device)
        rows.append(_latency_row(B, T, impl, us, nbytes, bench))
    return rows


def _host_latency_us(fn, device) -> float:
    """Microseconds per call of `fn` from Python: LATENCY_WARMUP_S of calls, then LATENCY_CALLS back to back
    between syncs, the best of LATENCY_PASSES such passes (as timeit reports): on the shared GPU host passes of the
    same launches vary widely, and the best pass is the call's own cost."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    warm_until = time.perf_counter() + LATENCY_WARMUP_S
    while time.perf_counter() < warm_until:
        fn()
    sync()
    passes = []
    for _ in range(LATENCY_PASSES):
        for _ in range(20):
            fn()
        sync()
        start = time.perf_counter()
        for _ in range(LATENCY_CALLS):
            fn()
        sync()
        passes.append((time.perf_counter() - start) / LATENCY_CALLS * 1e6)
    return min(passes)


def _latency_row(B, T, impl, us, nbytes, bench):
    case = f"latency [B,T]=[{B},{T}] causal bf16, best of {LATENCY_PASSES} x {LATENCY_CALLS} calls from Python"
    return _row(case, impl, us * 1e-3, nbytes, bench, us_per_call=us, host_overhead_included=True)


def _dispatch(kernel):
    return importlib.import_module(f"{kernel.__name__}.dispatch")


def _sweep_rows(kernel, bench, B, T, window, dtype, device):
    """Every candidate configuration (dispatch.FORWARD_CONFIGS / BACKWARD_CONFIGS) that takes the case,
    forward and backward: rows "fwd <config>" / "bwd <config>". A configuration that would run as another
    (band-tma where TMA cannot take the call) has no row."""
    kernels = _dispatch(kernel)
    left, right = WINDOWS[window]
    W, elt = left + right + 1, torch.finfo(dtype).bits // 8
    a, v = make_inputs(B, T, left, right, dtype, device)
    go = torch.randn_like(v)
    shape = f"[B,T]=[{B},{T}] H={H} Dh={DH} W={W} {window} {str(dtype)[6:]}"
    ref = kernel.ldsa_forward_reference(a, v, left, right)
    rows = []
    default = kernels.plan("forward", (a, v), left, right).config
    for config in kernels.FORWARD_CONFIGS:
        if kernels.plan("forward", (a, v), left, right, config).config != config:
            continue
        out = kernels.ldsa_forward_cuda(a, v, left, right, config=config)
        ms = bench.time(lambda: kernels.ldsa_forward_cuda(a, v, left, right, config=config))
        rows.append(_row(f"sweep fwd {shape}", f"fwd {config}", ms, B * H * T * (W + 2 * DH) * elt, bench,
                         *_errors(bench, out, ref), default=config == default))
        del out
    del ref
    ref_dl, ref_dv = kernel.ldsa_backward_reference(a, v, go, left, right)
    default = kernels.plan("backward", (a, v, go), left, right).config
    for config in kernels.BACKWARD_CONFIGS:
        if kernels.plan("backward", (a, v, go), left, right, config).config != config:
            continue
        dl, dv = kernels.ldsa_backward_cuda(a, v, go, left, right, config=config)
        err = max(bench.rel_err(dl, ref_dl), bench.rel_err(dv, ref_dv))
        ms = bench.time(lambda: kernels.ldsa_backward_cuda(a, v, go, left, right, config=config))
        rows.append(_row(f"sweep bwd {shape}", f"bwd {config}", ms, B * H * T * (2 * W + 3 * DH) * elt, bench, err,
                         default=config == default))
    return rows


@contextlib.contextmanager
def _forward_default(kernels, config):
    """Route every forward call to `config` for a while (the latency rows of each design); the launches
    cached from the default table are forgotten on the way in and out."""
    saved = dict(kernels.DEFAULT_CONFIG)
    kernels.DEFAULT_CONFIG.update({key: config for key in saved if key[0] == "forward"})
    kernels.clear_plans()
    try:
        yield
    finally:
        kernels.DEFAULT_CONFIG.update(saved)
        kernels.clear_plans()


def _design_latency_rows(kernel, bench, B, T, device):
    """Per-call time of each forward configuration at a small shape: the launcher called directly (no
    validation), the public op without grad (direct launch) and the registered custom op."""
    kernels = _dispatch(kernel)
    left, right = WINDOWS["causal"]
    a, v = make_inputs(B, T, left, right, torch.bfloat16, device)
    nbytes = B * H * T * (left + right + 1 + 2 * DH) * 2
    rows = []
    for config in kernels.FORWARD_CONFIGS:
        calls = {
            "launcher": lambda: kernels.ldsa_forward_cuda(a, v, left, right, config=config),
            "public op, no grad": lambda: kernel.ldsa_local_attention(a, v, left, right),
            "custom op": lambda: kernel.op.ldsa_forward_op(a, v, left, right),
        }
        with _forward_default(kernels, config), torch.no_grad():
            for path, fn in calls.items():
                rows.append(_latency_row(B, T, f"{config} via {path}", _host_latency_us(fn, device), nbytes, bench))
    return rows


def side_by_side(kernel, bench, shapes=None, backward_shapes=None, latency_shape=None, sweep_cases=None) -> list[dict]:
    """Every card shape plus [64, 3000], causal and centered, bf16 and fp32, with the default configuration;
    the backward at [64, 3000]; the small-shape latency; then the candidate sweep and each configuration's
    latency. The keyword arguments exist for a dry run at tiny shapes on the CPU."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows = []
    for dtype in (torch.bfloat16, torch.float32):
        for window in WINDOWS:
            for B, T in shapes or CARD_SHAPES:
                rows += _forward_rows(kernel, bench, B, T, window, dtype, device)
                if device == "cuda":
                    torch.cuda.empty_cache()
            for B, T in backward_shapes or BACKWARD_SHAPES:
                rows += _backward_rows(kernel, bench, B, T, window, dtype, device)
                if device == "cuda":
                    torch.cuda.empty_cache()
    rows += _latency_rows(kernel, bench, *(latency_shape or LATENCY_SHAPE), device)
    if not bench.sweep:
        return rows
    for (B, T), window, dtype in sweep_cases or SWEEP_CASES:
        rows += _sweep_rows(kernel, bench, B, T, window, dtype, device)
        if device == "cuda":
            torch.cuda.empty_cache()
    rows += _design_latency_rows(kernel, bench, *(latency_shape or LATENCY_SHAPE), device)
    return rows


# Windows of 2 to 8 taps, which share the band kernels' smallest logits tile (BLOCK_W = 8), padded from 2 and 4 rows
# because such tiles fail to compile for sm_90: compiled offline in CI (tests/test_ldsa_local_attention.py), so that
# the whole window range stays compilable without a GPU.
SMALL_WINDOWS = [(1, 0), (1, 1), (3, 4)]


def compile_cases(kernel, spec):
    """(label, call) pairs for `python -m tools.compile_sm90`: every forward and backward configuration at
    three card shapes (one chunk a program, several, and the launch-bound one), both window kinds, bf16 and
    fp32, and at [2, 3008] for SMALL_WINDOWS (labelled "taps"), on meta tensors. band-gluon, which the
    dispatcher gives only CUDA devices of compute capability 9.0, is launched directly where its rules take the case
    (`dispatch.gluon_launch`) and it compiles under this Triton (`dispatch.FAST_PATHS`)."""
    kernels = _dispatch(kernel)

    def case(B, T, left, right, name, dtype, config, backward):
        a = torch.empty(B, H, left + right + 1, T, dtype=dtype, device="meta")
        v = torch.empty(B, H, DH, T, dtype=dtype, device="meta")
        label = f"[{B},{T}] {name} {str(dtype)[6:]} {'bwd' if backward else 'fwd'} {config}"
        direction = "backward" if backward else "forward"
        if config == kernels.BAND_GLUON:
            launch = kernels.gluon_launch(direction, left + right + 1, left, DH, T, B * H, dtype, -1)
            if launch is None or not kernels.FAST_PATHS.compiles(f"band-gluon {direction}"):
                return None
            tensors = (a, v, torch.empty_like(v), torch.empty_like(a), torch.empty_like(v)) if backward else (
                a, v, torch.empty_like(v))
            return label, lambda: kernels.launch(launch, tensors)
        if backward:
            return label, lambda: kernels.ldsa_backward_cuda(a, v, torch.empty_like(v), left, right, config=config)
        return label, lambda: kernels.ldsa_forward_cuda(a, v, left, right, config=config)

    windows = [(shape, side, name) for shape in [(64, 3000), (32, 1024), (16, 256)] for name, side in WINDOWS.items()]
    windows += [((2, 3008), side, f"{sum(side) + 1} taps {side}") for side in SMALL_WINDOWS]
    for (B, T), (left, right), name in windows:
        for dtype in (torch.bfloat16, torch.float32):
            for config in kernels.FORWARD_CONFIGS:
                forward = case(B, T, left, right, name, dtype, config, backward=False)
                if forward is not None:
                    yield forward
            for config in kernels.BACKWARD_CONFIGS:
                backward = case(B, T, left, right, name, dtype, config, backward=True)
                if backward is not None:
                    yield backward
