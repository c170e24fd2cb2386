"""ldsa side by side with its anchors, for the GPU run, and the launches compiled offline.

Bytes are the minimal traffic: forward reads a_logits and v once and writes out once; backward reads
a_logits, v and grad_out once and writes dlogits and dv once. GB/s = those bytes / time, and pct_copy
compares it with the device-to-device copy bandwidth measured in the same run.
"""

import contextlib

import torch

from .harness import device, floor_row, free, gbps_row, hub_benchmark, latency_row, max_abs_err, submodule

HUB = hub_benchmark("ldsa")
H, DH, make_inputs = HUB.H, HUB.DH, HUB.make_inputs
WINDOWS = {"causal": (14, 0), "centered": (7, 7)}
# The card's table, plus the largest training batch of the issue.
CARD_SHAPES = [(16, 256), (16, 512), (32, 1024), (16, 2048), (32, 3000), (64, 3000)]
BACKWARD_SHAPES = [(64, 3000)]
COMPILE_SHAPES = [(64, 3000)]  # torch.compile(reference) anchor: compiled once per window, bf16 only
# The latency table's shapes (bf16, causal, forward): a streaming encoder's small window first (the bar: 8 us a call).
LATENCY_SHAPES = [(16, 256), (16, 1024), (32, 3000), (64, 3000)]
# The candidate sweep (every forward and backward configuration of both designs, side by side): each
# (shape, window, dtype) here costs one compile per configuration, so the cases are few.
SWEEP_CASES = [
    ((64, 3000), "causal", torch.bfloat16),
    ((64, 3000), "centered", torch.bfloat16),
    ((32, 1024), "causal", torch.bfloat16),
    ((64, 3000), "causal", torch.float32),
    ((32, 1024), "centered", torch.float32),
]
# Windows of 2 to 8 taps, which share the band kernels' smallest logits tile (BLOCK_W = 8), padded from 2 and 4 rows
# because such tiles fail to compile for sm_90: compiled offline in CI (tests/test_ldsa_local_attention.py), so
# that the whole window range stays compilable without a GPU.
SMALL_WINDOWS = [(1, 0), (1, 1), (3, 4)]


def unfold_einsum(a_logits, v, left, right):
    """The other eager formulation of the anchors: a materialized [B, H, Dh, T, W] unfold."""
    a = torch.softmax(a_logits.float(), dim=2)
    windows = torch.nn.functional.pad(v.float(), (left, right)).unfold(-1, left + right + 1, 1)
    return torch.einsum("bhkt,bhdtk->bhdt", a, windows).to(v.dtype)


def _errors(bench, x, ref) -> dict:
    return {"err": bench.rel_err(x, ref), "max_abs_err": max_abs_err(x, ref)}


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
        gbps_row(case, "ldsa triton", t_ours, nbytes, bench, **_errors(bench, ours, ref), x_vs_eager=t_eager / t_ours,
                 x_vs_unfold_einsum=t_unfold / t_ours, path=kernel.kernel_path(v)),
        gbps_row(case, "eager reference (shift-mul-add)", t_eager, nbytes, bench, 0.0, max_abs_err=0.0),
        gbps_row(case, "unfold + einsum", t_unfold, nbytes, bench, **_errors(bench, unfolded, ref)),
    ]
    if (B, T) in COMPILE_SHAPES and dtype == torch.bfloat16 and device == "cuda":
        compiled = torch.compile(kernel.ldsa_forward_reference, dynamic=False)
        with torch.no_grad():
            t_compiled = bench.time(lambda: compiled(a, v, left, right))
            rows.append(gbps_row(case, "torch.compile(reference)", t_compiled, nbytes, bench,
                                 **_errors(bench, compiled(a, v, left, right), ref),
                                 x_ours_vs_this=t_compiled / t_ours))
    return rows


def _backward_errors(bench, dl, dv, ref_dl, ref_dv) -> dict:
    return {"err": max(bench.rel_err(dl, ref_dl), bench.rel_err(dv, ref_dv)),
            "max_abs_err": max(max_abs_err(dl, ref_dl), max_abs_err(dv, ref_dv))}


def _backward_rows(kernel, bench, B, T, window, dtype, device):
    left, right = WINDOWS[window]
    W, elt = left + right + 1, torch.finfo(dtype).bits // 8
    a, v = make_inputs(B, T, left, right, dtype, device)
    go = torch.randn_like(v)
    nbytes = B * H * T * (2 * W + 3 * DH) * elt
    case = f"bwd [B,T]=[{B},{T}] H={H} Dh={DH} W={W} {window} {str(dtype)[6:]}"
    ref_dl, ref_dv = kernel.ldsa_backward_reference(a, v, go, left, right)
    dl, dv = kernel.op.ldsa_backward_op(a, v, go, left, right)
    errs = _backward_errors(bench, dl, dv, ref_dl, ref_dv)
    t_ours = bench.time(lambda: kernel.op.ldsa_backward_op(a, v, go, left, right))
    # Eager autograd through the reference: the graph is built once, only the backward is timed.
    a_req, v_req = a.clone().requires_grad_(), v.clone().requires_grad_()
    out = kernel.ldsa_forward_reference(a_req, v_req, left, right)
    t_autograd = bench.time(lambda: torch.autograd.grad(out, (a_req, v_req), go, retain_graph=True))
    t_analytic = bench.time(lambda: kernel.ldsa_backward_reference(a, v, go, left, right))
    return [
        gbps_row(case, "ldsa triton backward", t_ours, nbytes, bench, **errs,
                 x_vs_eager_autograd=t_autograd / t_ours, x_vs_eager_analytic=t_analytic / t_ours),
        gbps_row(case, "eager autograd of the reference", t_autograd, nbytes, bench),
        gbps_row(case, "eager analytic backward (reference.py)", t_analytic, nbytes, bench),
    ]


def _latency_case(B, T) -> str:
    return f"latency [B,T]=[{B},{T}] H={H} Dh={DH} W=15 causal bf16 forward"


def latency_rows(kernel, shapes=LATENCY_SHAPES) -> list[dict]:
    """The latency table's rows: the empty-launch floor, then at each shape the wall-clock per eager call (calls back
    to back, one sync at the end) and GPU time of the public op without grad (its direct launch) and of the
    registered custom op."""
    run_on = device()
    rows = [floor_row(run_on)]
    left, right = WINDOWS["causal"]
    for B, T in shapes:
        a, v = make_inputs(B, T, left, right, torch.bfloat16, run_on)
        calls = {
            "ldsa_local_attention, no grad": lambda: kernel.ldsa_local_attention(a, v, left, right),
            "registered custom op": lambda: kernel.op.ldsa_forward_op(a, v, left, right),
        }
        with torch.no_grad():
            rows += [latency_row(_latency_case(B, T), impl, fn, run_on) for impl, fn in calls.items()]
        del a, v
        free()
    return rows


def _sweep_rows(kernel, bench, B, T, window, dtype, device):
    """Every candidate configuration (dispatch.FORWARD_CONFIGS / BACKWARD_CONFIGS) that takes the case,
    forward and backward: rows "fwd <config>" / "bwd <config>". A configuration that would run as another
    (band-tma where TMA cannot take the call) has no row."""
    kernels = submodule(kernel, "dispatch")
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
        rows.append(gbps_row(f"sweep fwd {shape}", f"fwd {config}", ms, B * H * T * (W + 2 * DH) * elt, bench,
                             **_errors(bench, out, ref), default=config == default))
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
        rows.append(gbps_row(f"sweep bwd {shape}", f"bwd {config}", ms, B * H * T * (2 * W + 3 * DH) * elt, bench,
                             err, default=config == default))
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


def _design_latency_rows(kernel, B, T, device):
    """Per-call time of each forward configuration at a small shape: the launcher called directly (no
    validation), the public op without grad (direct launch) and the registered custom op."""
    kernels = submodule(kernel, "dispatch")
    left, right = WINDOWS["causal"]
    a, v = make_inputs(B, T, left, right, torch.bfloat16, device)
    rows = []
    for config in kernels.FORWARD_CONFIGS:
        calls = {
            "launcher": lambda: kernels.ldsa_forward_cuda(a, v, left, right, config=config),
            "public op, no grad": lambda: kernel.ldsa_local_attention(a, v, left, right),
            "custom op": lambda: kernel.op.ldsa_forward_op(a, v, left, right),
        }
        with _forward_default(kernels, config), torch.no_grad():
            for path, fn in calls.items():
                rows.append(latency_row(_latency_case(B, T), f"{config} via {path}", fn, device))
    return rows


def side_by_side(kernel, bench, shapes=None, backward_shapes=None, latency_shapes=None, sweep_cases=None) -> list[dict]:
    """Every card shape plus [64, 3000], causal and centered, bf16 and fp32, with the default configuration;
    the backward at [64, 3000]; the latency table's rows (`latency_rows`); then the candidate sweep and each
    configuration's latency at the smallest latency shape. The keyword arguments exist for a dry run at tiny shapes
    on the CPU."""
    run_on = device()
    rows = []
    for dtype in (torch.bfloat16, torch.float32):
        for window in WINDOWS:
            for B, T in shapes or CARD_SHAPES:
                rows += _forward_rows(kernel, bench, B, T, window, dtype, run_on)
                free()
            for B, T in backward_shapes or BACKWARD_SHAPES:
                rows += _backward_rows(kernel, bench, B, T, window, dtype, run_on)
                free()
    latency_shapes = latency_shapes or LATENCY_SHAPES
    rows += latency_rows(kernel, latency_shapes)
    if not bench.sweep:
        return rows
    for (B, T), window, dtype in sweep_cases or SWEEP_CASES:
        rows += _sweep_rows(kernel, bench, B, T, window, dtype, run_on)
        free()
    rows += _design_latency_rows(kernel, *latency_shapes[0], run_on)
    return rows


def compile_cases(kernel, spec):
    """(label, call) pairs for `python -m tools.compile_offline`: every forward and backward configuration at
    three card shapes (one chunk a program, several, and the launch-bound one), both window kinds, bf16 and
    fp32, and at [2, 3008] for SMALL_WINDOWS (labelled "taps"), on meta tensors. The fast paths' configurations
    come only where `dispatch.FAST_PATHS` runs them on meta tensors (the target claims them and they compile under
    this Triton); elsewhere the dispatcher would run the portable configurations, which have cases of their own.
    band-gluon, which the dispatcher gives only CUDA devices, is launched directly where its rules take the case
    (`dispatch.gluon_launch`)."""
    kernels = submodule(kernel, "dispatch")
    meta = torch.device("meta")

    def case(B, T, left, right, name, dtype, config, backward):
        a = torch.empty(B, H, left + right + 1, T, dtype=dtype, device="meta")
        v = torch.empty(B, H, DH, T, dtype=dtype, device="meta")
        label = f"[{B},{T}] {name} {str(dtype)[6:]} {'bwd' if backward else 'fwd'} {config}"
        direction = "backward" if backward else "forward"
        if config == kernels.BAND_GLUON:
            launch = kernels.gluon_launch(direction, left + right + 1, left, DH, T, B * H, dtype, -1)
            if launch is None or not kernels.FAST_PATHS.runs(f"band-gluon {direction}", meta):
                return None
            tensors = (a, v, torch.empty_like(v), torch.empty_like(a), torch.empty_like(v)) if backward else (
                a, v, torch.empty_like(v))
            return label, lambda: kernels.launch(launch, tensors)
        if config == kernels.BAND_TMA and not kernels.FAST_PATHS.runs(f"band-tma {direction}", meta):
            return None
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
