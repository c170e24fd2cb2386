"""based-bwd side by side with its anchors, for the GPU run, and the launches compiled offline.

Every row of the backward case times the whole contract of the spec, `(q, k, v, do) -> (dq, dk, dv)`: ours
recomputes what it needs, so fla is timed forward + backward (its backward alone is given for information).
TFLOP/s are the spec's credited FLOPs (`canonical_work`, chunk 64) over the time; errors are relative Frobenius
against the spec's reference evaluated in fp32, computed once per shape.
"""

import importlib

import torch

from .harness import attempt, errors, free, submodule, tflops_row

GRADS = ("dq", "dk", "dv")


def _fla_fwd_bwd(fn):
    """fla's forward + backward through autograd: the same contract as the spec's function."""

    def run(q, k, v, do, scale):
        ins = [x.detach().requires_grad_(True) for x in (q, k, v)]
        o = fn(*ins, scale=scale, use_norm=True)
        return torch.autograd.grad(o, ins, do)

    return run


def _fla_bwd_only(fn, q, k, v, do, scale):
    """fla's backward alone, replaying a graph whose forward ran once, on the first call (o and z come
    for free, which our contract does not give)."""
    graph = []

    def replay():
        if not graph:
            ins = [x.detach().requires_grad_(True) for x in (q, k, v)]
            graph.extend([fn(*ins, scale=scale, use_norm=True), ins])
        return torch.autograd.grad(graph[0], graph[1], do, retain_graph=True)

    return replay


def _timed_row(bench, case, impl, fn, ref, flops, **extra):
    """The row of fn() -> (dq, dk, dv) or (o,), with its errors against ref (None: none), or its error row."""

    def measure():
        got = fn()
        errs = errors(bench, GRADS if len(ref) == 3 else ("o",), got, ref) if ref is not None else {}
        del got
        return tflops_row(case, impl, bench.time(fn), flops, **errs, **extra)

    return attempt(case, impl, measure)


def _speedup(own, anchor, key):
    """`own[key]`: the anchor's time over ours, where both ran."""
    if own.get("ms") and anchor.get("ms"):
        own[key] = anchor["ms"] / own["ms"]


def _forward_rows(bench, kernel, dispatch, fla_based, case, q, k, v, o_ref, flops, K, scale, sweep):
    """The forward alone (no autograd graph): ours, its other launch plans (with `sweep`), and fla's two
    forwards; ours gets its speed-up over the faster fla forward."""
    rows = []

    def fwd(fn):
        def run():
            with torch.no_grad():
                return (fn(),)

        return run

    ours = _timed_row(bench, case, "based-bwd triton forward", fwd(lambda: kernel.based_attention(q, k, v)),
                      [o_ref], flops, config=str(dispatch.DEFAULT_FORWARD_CONFIG[K]))
    rows.append(ours)
    if sweep:
        for config in dispatch.FORWARD_CONFIG_CHOICES:
            run = fwd(lambda: dispatch.portable_forward(q, k, v, scale, config))  # noqa: B023
            rows.append(_timed_row(bench, case, "based-bwd triton forward, other config", run, [o_ref], flops,
                                   config=str(config)))
    if fla_based is not None:
        for name in ("parallel_based", "fused_chunk_based"):
            fn = getattr(fla_based, name)
            row = _timed_row(bench, case, f"fla {name} forward",
                             fwd(lambda: fn(q, k, v, scale=scale, use_norm=True)), [o_ref], flops)  # noqa: B023
            rows.append(row)
            _speedup(ours, row, f"x_vs_fla_{name}")
        rivals = [r["ms"] for r in rows if r["impl"].startswith("fla") and r.get("ms")]
        if ours.get("ms") and rivals:
            ours["x_vs_fla"] = min(rivals) / ours["ms"]
    return rows


def _step(kernel, q, k, v, do):
    """Our training step: based_attention's forward and its backward through autograd."""
    ins = [x.detach().requires_grad_(True) for x in (q, k, v)]
    return torch.autograd.grad(kernel.based_attention(*ins), ins, do)


def side_by_side(kernel, bench) -> list[dict]:
    """At every measure shape: the backward contract (ours, fla forward + backward, fla's backward alone, the
    spec's fp32 reference), the training step (case "... step": ours, forward + backward through autograd,
    beside fla's forward + backward) and the forward alone (case "... forward": ours, fla's forwards). Credited
    FLOPs: the backward the spec's canonical_work, the forward half of it, the step one and a half."""
    spec = bench.spec("based_backward")
    if spec is None:
        return []
    fla_based = importlib.import_module("fla.ops.based") if bench.optional("fla") is not None else None
    dispatch = submodule(kernel, "dispatch")
    spec_forward = spec.ref.__globals__["_based_forward"]
    rows = []
    for shape in spec.measure_shapes:
        B, T, H, K, V = shape
        case = f"(B,T,H,K,V)=({B},{T},{H},{K},{V}) bf16"
        flops = spec.work(*shape)
        scale = K**-0.5
        q, k, v, do = spec.make(*shape, 0)
        ref = spec.ref(q.float(), k.float(), v.float(), do.float())  # the fp32 spec, once per shape
        o_ref = spec_forward(q.float(), k.float(), v.float())
        first_of_k = shape == next(s for s in spec.measure_shapes if s[3] == K)

        ours = _timed_row(bench, case, "based-bwd triton", lambda: kernel.based_backward(q, k, v, do), ref,
                          flops, path=kernel.kernel_path(q), config=str(dispatch.DEFAULT_BACKWARD_CONFIG[K]))
        rows.append(ours)
        # the launch configurations the default could take, at the first shape of each K (compile time)
        if bench.sweep and first_of_k:
            for config in dispatch.BACKWARD_CONFIG_CHOICES:
                run = lambda: dispatch.portable_backward(q, k, v, do, scale, config)  # noqa: E731
                rows.append(_timed_row(bench, case, "based-bwd triton, other config", run, ref, flops,
                                       config=str(config)))
        # the training step, in a case of its own beside fla's forward + backward (the same contract; its rows
        # are the backward case's measurements, shown again)
        step_case = f"{case} step"
        step = _timed_row(bench, step_case, "based-bwd triton step (fwd+bwd autograd)",
                          lambda: _step(kernel, q, k, v, do), ref, 1.5 * flops)
        step_rows = [step]

        if fla_based is not None:
            for name in ("parallel_based", "fused_chunk_based"):
                run = _fla_fwd_bwd(getattr(fla_based, name))
                row = _timed_row(bench, case, f"fla {name} fwd+bwd", lambda: run(q, k, v, do, scale), ref, flops)
                rows.append(row)
                step_row = dict(row, case=step_case)
                if "value" in step_row:
                    step_row["value"] *= 1.5
                step_rows.append(step_row)
                for own in (ours, step):
                    _speedup(own, row, f"x_vs_fla_{name}")
            replay = _fla_bwd_only(fla_based.parallel_based, q, k, v, do, scale)
            rows.append(_timed_row(bench, case, "fla parallel_based bwd only (info)", replay, None, flops))
            del replay
            for own in (ours, step):
                if "x_vs_fla_parallel_based" in own:
                    own["x_vs_fla"] = own["x_vs_fla_parallel_based"]
        rows += step_rows

        rows += _forward_rows(bench, kernel, dispatch, fla_based, f"{case} forward", q, k, v, o_ref, flops / 2, K,
                              scale, sweep=bench.sweep and first_of_k)
        rows.append(_timed_row(bench, case, "spec seed reference (fp32 autograd)",
                               lambda: spec.ref(q, k, v, do), ref, flops))
        del q, k, v, do, ref, o_ref
        free()
    return rows


def compile_cases(kernel, spec):
    """(label, call) pairs for `python -m tools.compile_offline`: each launch plan the package uses or the
    benchmark times, at every measure shape, on meta tensors, for the backward and the forward; and the
    backward's fp32 path (IEEE matmuls, the interpreter tests' exact mode) with each K's default plan. The
    forward's fp32 mode is the interpreter's alone (CUDA fp32 calls take the reference), and fp16 calls run the
    bf16 kernels.

    The benchmark's alternatives to the default plans are the H100 / H200's tuning candidates, and the fp32 mode
    runs on no GPU (CUDA fp32 calls take the reference; it is compiled to hold the interpreter's exact mode to
    what the compiler takes): both come only where the meta tensors stand for a 9.0 GPU (`common.devices.meta_gpu`).
    Elsewhere the cases are the default plans, the launches the package makes there (the forward's bv = 128 plan
    at K = 16 and the fp32 dk/dv kernel need more shared memory than the 99 KB 8.6, 8.9 and 12.0 GPUs give a CTA)."""
    dispatch = submodule(kernel, "dispatch")
    shapes = spec("based_backward").measure_shapes
    tuning = submodule(kernel, "common.devices").gpu(torch.device("meta")).capability == (9, 0)

    def tensors(shape, dtype):
        B, T, H, K, V = shape
        q, k = (torch.empty(B, T, H, K, dtype=dtype, device="meta") for _ in range(2))
        v, do = (torch.empty(B, T, H, V, dtype=dtype, device="meta") for _ in range(2))
        return q, k, v, do

    def case(shape, dtype, config):
        q, k, v, do = tensors(shape, dtype)
        label = f"backward (B,T,H,K,V)={shape} {str(dtype)[6:]} {config}"
        return label, lambda: dispatch.portable_backward(q, k, v, do, shape[3] ** -0.5, config)

    def forward_case(shape, dtype, config):
        q, k, v, _ = tensors(shape, dtype)
        label = f"forward (B,T,H,K,V)={shape} {str(dtype)[6:]} {config}"
        return label, lambda: dispatch.portable_forward(q, k, v, shape[3] ** -0.5, config)

    backward_choices = set(dispatch.BACKWARD_CONFIG_CHOICES) if tuning else set()
    forward_choices = set(dispatch.FORWARD_CONFIG_CHOICES) if tuning else set()
    for shape in shapes:
        K = shape[3]
        for config in sorted(backward_choices | {dispatch.DEFAULT_BACKWARD_CONFIG[K]}, key=str):
            yield case(shape, torch.bfloat16, config)
        for config in sorted(forward_choices | {dispatch.DEFAULT_FORWARD_CONFIG[K]}, key=str):
            yield forward_case(shape, torch.bfloat16, config)
    for K in sorted({shape[3] for shape in shapes} if tuning else ()):
        first = next(s for s in shapes if s[3] == K)
        yield case(first, torch.float32, dispatch.DEFAULT_BACKWARD_CONFIG[K])
