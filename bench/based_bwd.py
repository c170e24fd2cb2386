"""based-bwd side by side with its anchors, for the GPU run, and the launches compiled offline.

Every row of the backward case times the whole contract of the spec, `(q, k, v, do) -> (dq, dk, dv)`: ours
recomputes what it needs, so fla is timed forward + backward (its backward alone is given for information).
TFLOP/s are the spec's credited FLOPs (`canonical_work`, chunk 64) over the time; errors are relative Frobenius
against the spec's reference evaluated in fp32, computed once per shape.
"""

import contextlib
import importlib

import torch

from .harness import (attempt, device, errors, floor_row, free, gbps_row, latency_row, random_lengths, submodule,
                      tflops_row)

GRADS = ("dq", "dk", "dv")
# The decode step's shapes (B, T, H, K, V): one token of 64 sequences (issue #52's serving shape), 16 tokens of
# them (a draft or a prompt's tail: the token loop's cost beside the state's bytes), and the latency shape.
DECODE_SHAPES = ((64, 1, 16, 16, 64), (64, 16, 16, 16, 64))
DECODE_LATENCY_SHAPE = (1, 1, 16, 16, 64)


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
                      [o_ref], flops, config=str(dispatch.forward_config(K, q.device)))
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


def _decode_inputs(kernel, B, T, H, K, V, run_on, dtype=torch.bfloat16):
    """q, k, v and a state (S, z) for a decode step: a state over 64 earlier random steps, through the
    forward."""
    gen = torch.Generator(device=run_on).manual_seed(0)
    q, k = (torch.randn(B, T, H, K, generator=gen, device=run_on).to(dtype) for _ in range(2))
    v = torch.randn(B, T, H, V, generator=gen, device=run_on).to(dtype)
    prompt = [torch.randn(B, 64, H, D, generator=gen, device=run_on) for D in (K, K, V)]
    _, state = kernel.based_forward_reference(*prompt, output_final_state=True)
    return q, k, v, state


def _decode_bytes(B, T, H, K, V, elt) -> int:
    """What a decode step must move: the fp32 state (S and z) read and written, q, k, v read and o written."""
    P = 1 + K + K * K
    return 2 * B * H * (P * V + P) * 4 + B * T * H * (2 * K + 2 * V) * elt


def _decode_rows(kernel, bench, shape, run_on) -> list[dict]:
    """The decode step at `shape` (bf16 q, k, v; fp32 state): ours (`based_decode`), each other launch plan (with
    the sweep), and the eager reference step; GB/s on `_decode_bytes`, errors of o and S against the reference
    in float64."""
    B, T, H, K, V = shape
    dispatch = submodule(kernel, "dispatch")
    case = f"decode (B,T,H,K,V)=({B},{T},{H},{K},{V}) bf16, fp32 state"
    nbytes = _decode_bytes(B, T, H, K, V, 2)
    q, k, v, state = _decode_inputs(kernel, B, T, H, K, V, run_on)
    o_ref, (S_ref, _) = kernel.based_decode_reference(q.double(), k.double(), v.double(),
                                                      tuple(x.double() for x in state))

    def row(impl, fn, **extra):
        def measure():
            o, (S, _) = fn()
            errs = {"err_o": bench.rel_err(o, o_ref), "err_S": bench.rel_err(S, S_ref)}
            return gbps_row(case, impl, bench.time(fn), nbytes, bench, max(errs.values()), **errs, **extra)

        return attempt(case, impl, measure)

    with torch.no_grad():
        ours = row("based-bwd triton decode", lambda: kernel.based_decode(q, k, v, state),
                   config=str(dispatch.DEFAULT_DECODE_CONFIG))
        rows = [ours]
        if bench.sweep:
            for config in dispatch.DECODE_CONFIG_CHOICES:
                rows.append(row("based-bwd triton decode, other config",
                                lambda: dispatch.portable_decode(q, k, v, state, K**-0.5, config),  # noqa: B023
                                config=str(config)))
        eager = row("eager recurrent step (based_decode_reference)",
                    lambda: kernel.based_decode_reference(q, k, v, state))
        rows.append(eager)
    _speedup(ours, eager, "x_vs_eager")
    return rows


def _decode_latency_rows(kernel, shape, run_on, bench) -> list[dict]:
    """Wall-clock per call at a launch-bound `shape` (`harness.latency_row`): `based_decode`, its registered custom op
    (the dispatch layers the eager call skips), its CUDA graph replayed, the eager reference step, and the
    empty-launch floor of the same run; ours gets its distance to the floor and its speed-up over eager."""
    B, T, H, K, V = shape
    case = f"decode latency (B,T,H,K,V)=({B},{T},{H},{K},{V}) bf16"
    q, k, v, state = _decode_inputs(kernel, B, T, H, K, V, run_on)
    out = tuple(torch.empty_like(x) for x in state)
    calls = {"based_decode (eager call)": lambda: kernel.based_decode(q, k, v, state),
             "registered custom op": lambda: kernel.op.based_decode_op(q, k, v, *state, K**-0.5, *out)}
    if run_on == "cuda":
        calls["based_decode in a CUDA graph, replayed"] = _captured(lambda: kernel.based_decode(q, k, v, state))
    calls["eager recurrent step (based_decode_reference)"] = lambda: kernel.based_decode_reference(q, k, v, state)
    with torch.no_grad():
        rows = {impl: latency_row(case, impl, fn, run_on) for impl, fn in calls.items()}
    floor = floor_row(run_on)
    ours, eager = rows["based_decode (eager call)"], rows["eager recurrent step (based_decode_reference)"]
    ours["us_over_floor"] = ours["value"] - floor["value"]
    ours["x_vs_eager"] = eager["value"] / ours["value"]
    return [*rows.values(), floor]


def _captured(fn):
    """fn captured once in a CUDA graph (after warm-up calls on a side stream); returns the graph's replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def decode_side_by_side(kernel, bench, shapes=DECODE_SHAPES, latency_shape=DECODE_LATENCY_SHAPE) -> list[dict]:
    """The decode step's rows: throughput at each of `shapes`, latency at `latency_shape` (tiny shapes for a CPU
    dry run, where the kernel runs in Triton's interpreter)."""
    run_on = device()
    rows = []
    for shape in shapes:
        rows += _decode_rows(kernel, bench, tuple(shape), run_on)
        free()
    return rows + _decode_latency_rows(kernel, tuple(latency_shape), run_on, bench)


# The packed batch: 16 sequences of random lengths (seeded) summing to 65536 tokens, at (H, K) = (16, 16)
PACKED_SEQUENCES, PACKED_TOKENS, PACKED_HK = 16, 65536, (16, 16)
PACKED_VS = (64, 128)
# The packed step's scan plans timed beside the default plan's (each the default with these fields changed): in
# segments of 32 and 64 chunks, and 16 feature rows a scan program (twice the programs, half the work a serial step
# for the longest sequences' chains), whole and in segments of 64 chunks
PACKED_SCAN_PLANS = {"segments of 32 chunks": dict(scan_segment_chunks=32),
                     "segments of 64 chunks": dict(scan_segment_chunks=64),
                     "16 feature rows a scan program": dict(scan_rows=16),
                     "16 feature rows a scan program, segments of 64 chunks": dict(scan_rows=16, scan_segment_chunks=64)}


def _packed_step(kernel, q, k, v, do, cu_seqlens):
    """Our training step on packed sequences: based_attention with cu_seqlens, backward through autograd."""
    ins = [x.detach().requires_grad_(True) for x in (q, k, v)]
    return torch.autograd.grad(kernel.based_attention(*ins, cu_seqlens=cu_seqlens), ins, do)


@contextlib.contextmanager
def _scan_plans(dispatch, K: int, device: torch.device, changes: dict):
    """Inside: the forward and backward plans the public function takes at K on `device` (`dispatch.forward_config`,
    `dispatch.backward_config`) with the scan fields `changes` (PACKED_SCAN_PLANS' values)."""
    saved = dispatch.forward_config, dispatch.backward_config
    forward, backward = (plan._replace(**changes) for plan in (saved[0](K, device), saved[1](K)))
    dispatch.forward_config, dispatch.backward_config = (lambda *_: forward), (lambda *_: backward)
    try:
        yield
    finally:
        dispatch.forward_config, dispatch.backward_config = saved


def _planned_packed_step(kernel, dispatch, changes, q, k, v, do, cu_seqlens):
    """`_packed_step` with the scan plan changes `changes` (`_scan_plans`)."""
    with _scan_plans(dispatch, q.shape[-1], q.device, changes):
        return _packed_step(kernel, q, k, v, do, cu_seqlens)


def _packed_rows(bench, kernel, fla_based, spec) -> list[dict]:
    """The issue's packed batch, per V: our step on the packed sequences (cu_seqlens), the same step with each of
    PACKED_SCAN_PLANS' scan plans (the default plan otherwise), fla's parallel_based forward +
    backward on the same sequences zero-padded to the longest, rounded up to a multiple of 64 (what a fla user runs;
    padding at the end changes no real position's output), and our step on an equal-length batch of the same token
    count. The packed rows get x_vs_equal_length (bar 0.9), the default's also x_vs_fla (fla's time over ours, bar
    3). Credited FLOPs: the equal-length batch's step (the spec's canonical_work, times 1.5) on every row; no errors
    (the tests check the packed path against float64 and the fp32 reference)."""
    lengths = random_lengths(PACKED_SEQUENCES, PACKED_TOKENS)
    L, N, T = -(-max(lengths) // 64) * 64, len(lengths), sum(lengths)  # fla's padded length: a chunk multiple
    H, K = PACKED_HK
    scale = K**-0.5
    cu = torch.tensor([0] + lengths, device="cuda").cumsum(0).to(torch.int32)
    dispatch = submodule(kernel, "dispatch")
    rows = []
    for V in PACKED_VS:
        case = f"packed {N} seqs, {T} tokens (longest {max(lengths)}), (H,K,V)=({H},{K},{V}) bf16 step"
        equal = (N, T // N, H, K, V)
        flops = 1.5 * spec.work(*equal)
        q, k, v, do = spec.make(1, T, H, K, V, 0)
        ours = _timed_row(bench, case, "based-bwd triton step, packed (cu_seqlens)",
                          lambda: _packed_step(kernel, q, k, v, do, cu), None, flops)  # noqa: B023
        rows.append(ours)
        planned = []
        for label, changes in PACKED_SCAN_PLANS.items():
            run = lambda: _planned_packed_step(kernel, dispatch, changes, q, k, v, do, cu)  # noqa: B023, E731
            config = ", ".join(f"{field}={value}" for field, value in changes.items())
            planned.append(_timed_row(bench, case, f"based-bwd triton step, packed, {label}", run, None, flops,
                                      config=config))
        rows += planned
        eq = spec.make(*equal, 0)
        row = _timed_row(bench, case, f"based-bwd triton step, equal lengths {N} x {T // N}",
                         lambda: _step(kernel, *eq), None, flops)  # noqa: B023
        rows.append(row)
        for own in (ours, *planned):
            _speedup(own, row, "x_vs_equal_length")
        del eq
        if fla_based is not None:
            padded = []
            for x in (q, k, v, do):
                out = x.new_zeros(N, L, *x.shape[2:])
                for n, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
                    out[n, : b - a] = x[0, a:b]
                padded.append(out)
            run = _fla_fwd_bwd(fla_based.parallel_based)
            row = _timed_row(bench, case, f"fla parallel_based fwd+bwd, padded to {N} x {L}",
                             lambda: run(*padded, scale), None, flops)  # noqa: B023
            rows.append(row)
            _speedup(ours, row, "x_vs_fla")
            del padded
        del q, k, v, do
        free()
    return rows


def side_by_side(kernel, bench, decode_shapes=DECODE_SHAPES, decode_latency_shape=DECODE_LATENCY_SHAPE) -> list[dict]:
    """The decode step (`decode_side_by_side`); then at every measure shape: the backward contract (ours, fla
    forward + backward, fla's backward alone, the spec's fp32 reference), the training step (case "... step":
    ours, forward + backward through autograd, beside fla's forward + backward) and the forward alone (case
    "... forward": ours, fla's forwards). Credited FLOPs: the backward the spec's canonical_work, the forward
    half of it, the step one and a half. Then the issue's packed batch (`_packed_rows`)."""
    rows = decode_side_by_side(kernel, bench, decode_shapes, decode_latency_shape)
    spec = bench.spec("based_backward")
    if spec is None:
        return rows
    fla_based = importlib.import_module("fla.ops.based") if bench.optional("fla") is not None else None
    dispatch = submodule(kernel, "dispatch")
    spec_forward = spec.ref.__globals__["_based_forward"]
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
                          flops, path=kernel.kernel_path(q), config=str(dispatch.backward_config(K)))
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
    return rows + _packed_rows(bench, kernel, fla_based, spec)


def compile_cases(kernel, spec):
    """(label, call) pairs for `python -m tools.compile_offline`: each launch plan the package uses or the
    benchmark times, at every measure shape, on meta tensors, for the backward and the forward; and the
    backward's fp32 path (IEEE matmuls, the interpreter tests' exact mode) with each K's default plan; and the
    stateful forward and backward on the issue's packed batch (`packed_cases`) with the default plans and each of
    PACKED_SCAN_PLANS' (a segment length is a kernel argument: one compile covers every length). The
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

    def packed_cases(V, label=None, changes=None):
        """The stateful launches at the issue's packed batch: with an initial and a final state (the plain
        launches' kernels under their INITIAL, FINAL and VARLEN flags), and without (VARLEN alone); with changes,
        the default plans with those scan fields (in segments: SEGMENTED, and the totals' TOTAL_ONLY)."""
        H, K = PACKED_HK
        q, k, v, do = tensors((1, PACKED_TOKENS, H, K, V), torch.bfloat16)
        N, P = PACKED_SEQUENCES, 1 + K + K * K
        cu = torch.empty(N + 1, dtype=torch.int32, device="meta")
        state = (torch.empty(N, H, P, V, device="meta"), torch.empty(N, H, P, device="meta"))
        shape = f"{N} packed, {PACKED_TOKENS} tokens, (H,K,V)=({H},{K},{V}) bfloat16"
        fwd, bwd = dispatch.forward_config(K, q.device), dispatch.backward_config(K)
        if changes is not None:
            shape += f", {label}"
            fwd, bwd = (c._replace(**changes) for c in (fwd, bwd))
        yield f"state forward {shape}", lambda: dispatch.portable_state_forward(q, k, v, K**-0.5, state, cu,
                                                                                 config=fwd)
        yield f"state backward {shape}", lambda: dispatch.portable_state_backward(q, k, v, do, state, K**-0.5,
                                                                                   state, cu, bwd)
        # the packed training step (no state in or out): VARLEN alone
        yield f"stateless forward {shape}", lambda: dispatch.portable_state_forward(q, k, v, K**-0.5, None, cu,
                                                                                     False, fwd)
        yield f"stateless backward {shape}", lambda: dispatch.portable_state_backward(q, k, v, do, None, K**-0.5,
                                                                                       None, cu, bwd)

    backward_choices = set(dispatch.BACKWARD_CONFIG_CHOICES) if tuning else set()
    forward_choices = set(dispatch.FORWARD_CONFIG_CHOICES) if tuning else set()
    for shape in shapes:
        K = shape[3]
        for config in sorted(backward_choices | {dispatch.backward_config(K)}, key=str):
            yield case(shape, torch.bfloat16, config)
        for config in sorted(forward_choices | {dispatch.forward_config(K, torch.device("meta"))}, key=str):
            yield forward_case(shape, torch.bfloat16, config)
    for K in sorted({shape[3] for shape in shapes} if tuning else ()):
        first = next(s for s in shapes if s[3] == K)
        yield case(first, torch.float32, dispatch.backward_config(K))
    for V in PACKED_VS:
        yield from packed_cases(V)
        for label, changes in PACKED_SCAN_PLANS.items():
            yield from packed_cases(V, label, changes)
    yield from _decode_compile_cases(dispatch)


def _decode_compile_cases(dispatch):
    """The decode step: every launch plan at the issue's serving shape, one token, bf16; the default at each K,
    dtype and the widest V with the most tokens (T only bounds a loop: one compile covers every T)."""

    def decode_case(B, T, H, K, V, dtype, config):
        q, k = (torch.empty(B, T, H, K, dtype=dtype, device="meta") for _ in range(2))
        v = torch.empty(B, T, H, V, dtype=dtype, device="meta")
        P = 1 + K + K * K
        state = (torch.empty(B, H, P, V, device="meta"), torch.empty(B, H, P, device="meta"))
        label = f"decode (B,T,H,K,V)={(B, T, H, K, V)} {str(dtype)[6:]} {config}"
        return label, lambda: dispatch.portable_decode(q, k, v, state, K**-0.5, config)

    for config in sorted(set(dispatch.DECODE_CONFIG_CHOICES) | {dispatch.DEFAULT_DECODE_CONFIG}, key=str):
        yield decode_case(*DECODE_SHAPES[0], torch.bfloat16, config)
    for K in (8, 16):
        for dtype in (torch.float32, torch.float16):
            yield decode_case(64, 64, 16, K, 256, dtype, dispatch.DEFAULT_DECODE_CONFIG)
