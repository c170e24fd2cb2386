"""comba-bwd side by side with its anchors, for the GPU run, and the launches compiled offline.

Three cases a measure shape: the backward (`comba_backward`), the forward (`comba_attention` under no_grad, case
label "... forward") and the training step (`comba_attention` forward and backward through autograd, "... step").
Credited TFLOP/s use the spec's canonical_work W (2x the chunked forward's FLOPs, from the shape alone): W for the
backward, W / 2 for the forward, 3 W / 2 for the step. Errors are the relative Frobenius error of the output or of
each of the six gradients against the spec's reference run in fp32 on fp32 copies of the bf16 inputs.

Anchors in the same run (anchors/ANCHORS.md): the spec's seed reference (autograd through the chunked fp32
forward), and fla 0.6.0 `chunk_comba` forward + backward called with the exact adapter p' = exp(g) p (fla reads
the state before the decay, the spec after), with fla's Hopper/Triton guard (fla #640) lifted: a speed figure,
its errors are reported beside it. fla's kernels take p' in the inputs' dtype (bf16): an fp32 p' (exp(g) is
fp32) does not compile in its recompute_w_u kernel.

At one measure shape per K (SWEEP_SHAPES) the sweep times every stage (kernel) of the backward alone, in `ms_<stage>`
columns beside the whole, so the run shows where the time goes.

Decode (`comba_decode`, one new token a sequence after a carried fp32 state, under no_grad) at fla's layer sizes
(DECODE_SHAPE: B = 64, H = HV = 6, K = 256, V = 512, bf16, q/k/p L2-normalised inside) beside fla 0.6.0's
`fused_recurrent_comba`, both in fla's read order (the state read before the step's decay). GB/s count the state read
and written, 2 B HV K V 4 bytes, plus the inputs and o; errors of o and the new state against the recurrent reference
in fp32. At B = 1 (DECODE_LATENCY_B) the wall-clock per call of back-to-back calls from Python, beside an empty Triton
kernel's launch measured in the same run: the floor of any call.

fla's Comba layer's calls (LAYER_CASES, cases "fla layer ..."): `comba_bwd.fla.chunk_comba` beside fla 0.6.0's
`chunk_comba`, the same arguments as the layer passes (q/k/p L2-normalised inside, fla's read order, cu_seqlens for
the packed batch), forward and training step: the issue's speed bars.

A model's calls (MODEL_SHAPES, cases "(B,T,H,HV,K,V)=... step"): the training step through `comba_attention` with a
carried state in and out (the gradients of o and of the final state, all seven gradients checked against autograd
through the eager fp32 reference), and with value heads grouped two to a key head, beside fla 0.6.0 `chunk_comba`
called with the same arguments (the state case through the exact adapter; the grouped case with p as it is, since
p' = exp(g) p would need a p per value head: a speed figure only, no errors). Credited work: the spec's W per value
head.
"""

import functools

import torch

from .harness import (attempt, device, errors, floor_row, free, gbps_row, hub_benchmark, latency_row, random_lengths,
                      submodule, tflops_row)

SPEC = "comba_backward"
GRADS = ("dq", "dk", "dv", "dp", "dbeta", "dg")
HUB = hub_benchmark("comba-bwd")
SWEEP_SHAPES = [(8, 2048, 32, 128, 128), (16, 2048, 32, 64, 128)]
# fla chunk_comba's forward and training step are measured beside ours at every measure shape; the spec's seed
# reference (an eager fp32 autograd run) is timed at SEED_SHAPES alone.
SEED_SHAPES = [HUB.BENCH_SHAPE]
# Spills on sm_90a that the portable kernels' design accepts (tools.compile_offline reads the log of the ptxas run
# Triton makes, with its flags: --regAllocOptLevel=2 from Triton 3.7 on); the largest under Triton 3.6.0, 3.7.1, 3.8.0
# and 3.9.0 at the compile cases:
# - the reverse scan at K = 64 and 128 holds its (K, 64) fp32 dS block, dVn and X of a V block in 255 registers of 4
#   warps, so that two CTAs share an SM: 72, 68, 72 and 128 B;
# - at K = 256 (case labels holding ", 256, ") both scans hold the chunk's whole [64, K] tiles of k, p (and q) beside
#   a [K, 64] state block (`portable.chunk.SCAN_BLOCK`: narrower blocks miscompile under Triton 3.6 on sm_90): the
#   forward scan 164, 168, 168 and 116 B, the reverse scan 844, 824, 900 and 848 B; blocking the scans over K is
#   what removes them;
# - the gradient kernel at K = 128 (255 registers, P side's products beside Q's; a model's call adds dbeta's v part
#   from the adjoint stage): a model's call 156, 256, 116 and 152 B, the plain call 44, 128, 48 and 156 B;
# - the chunk transform at one warp (`portable.transform`): at K = 256, in four slices of 64 columns, 76, 76, 68 and
#   148 B (under 128 B at the other K).
# None of these has been timed against an unspilled variant under Triton 3.9 on a GPU.
SPILLS_BY_DESIGN = {"_reverse_scan_kernel": 240, ("_forward_scan_kernel", ", 256, "): 256,
                    ("_reverse_scan_kernel", ", 256, "): 1024, ("_grads_kernel", " model ("): 256,
                    ("_grads_kernel", " portable backward"): 160, ("_transform_kernel", ", 256, "): 160}

# Decode: (B, H, K, V) at one new token, HV = H; the latency batch.
DECODE_SHAPE = (64, 6, 256, 512)
DECODE_LATENCY_B = 1
FLA_DECODE = "fla 0.6.0 fused_recurrent_comba"
# The decode kernel's (V block, warps) candidates the sweep times at DECODE_SHAPE beside the shipped plan
# (portable/decode.py: block_v, DECODE_WARPS).
DECODE_SWEEP = [(8, 1), (16, 1), (8, 2), (16, 2), (16, 4), (32, 4), (32, 8)]

FLA_STEP = "fla 0.6.0 chunk_comba fwd+bwd (p'=exp(g)p bf16, guard lifted)"
# (B, T, H, HV, K, V) and whether the call carries a state in and out.
MODEL_SHAPES = [((8, 2048, 32, 32, 128, 128), True), ((4, 4096, 8, 16, 128, 128), False)]
# Compiled too (tools.compile_offline), not measured: the model call's kernels at K = 64, with V = 256 and 512
# (more V blocks in the scans and the output) at either K, and at K = 256 (fla's layer default, V = 512, and grouped
# heads at V = 64, one output block; the plain call's cases take V = 128), and a T that is not a multiple of the chunk
# (its last chunk masked).
MODEL_COMPILE_SHAPES = [((16, 2048, 32, 32, 64, 128), True), ((4, 2048, 8, 16, 128, 256), True),
                        ((4, 2048, 4, 4, 64, 512), True), ((4, 2048, 4, 8, 128, 512), False),
                        ((4, 2048, 6, 6, 256, 512), True), ((4, 2048, 4, 8, 256, 64), True),
                        ((4, 2047, 4, 8, 128, 256), True)]
# Compiled too, not measured: a model's call in fla's read order (the transform, the scans, the gradients and dg take
# the read's decay), at every K, with q, k and p L2-normalised inside as fla's layer calls it.
FLA_COMPILE_SHAPES = [((4, 2048, 8, 16, 128, 256), True), ((16, 2048, 32, 32, 64, 128), True),
                      ((4, 2048, 6, 6, 256, 512), True)]
# And a model's call over packed sequences at the packed batch, 8 sequences (N) packed on T rows, each on chunks
# of its own (T / 64 + N of them at most), (T, N, H, HV, K, V), in both read orders, and at fla's layer sizes.
PACKED_COMPILE_SHAPES = [(32768, 8, 8, 16, 128, 256), (32768, 8, 6, 6, 256, 512)]
# The plain call (no state, equal heads) at K = 256, which only the portable kernels take, at V = 64 with a ragged T
# (its last chunk masked), and at K = 64 with V = 64 and a ragged T (the scans forming their chunk-local terms in their
# loops, `dispatch.Plan.local_terms`, over a masked last chunk): (B, T, H, K, V).
PLAIN_COMPILE_SHAPES = [(4, 2048, 8, 256, 128), (4, 2047, 8, 256, 64), (4, 2047, 8, 64, 64)]
# The L2 normalisation of q, k, p and its backward with the group sum (`portable.l2norm`) alone, at the packed
# layer rows: (B, T, H, HV, K, dtype, normalised), the group sum without the normalisation too, and 16-bit and fp32.
L2NORM_COMPILE_CASES = [(1, 32768, 8, 16, K, torch.bfloat16, l2norm)
                        for K in (64, 128, 256) for l2norm in (True, False)]
L2NORM_COMPILE_CASES += [(1, 32768, 8, 8, 128, dtype, True) for dtype in (torch.float16, torch.float32)]
MODEL_STEP = "comba-bwd step (model call)"
FLA_MODEL_STEP = "fla 0.6.0 chunk_comba fwd+bwd, same arguments (guard lifted)"
MODEL_GRADS = (*GRADS, "d_initial_state")
FLA_FORWARD = "fla 0.6.0 chunk_comba forward (p'=exp(g)p bf16, guard lifted)"
# fla's Comba layer's calls (LAYER_CASES): its default sizes on a padded batch, and a packed batch of 8 sequences of
# seeded random lengths summing to 32768 with grouped value heads; (B, T, H, HV, K, V) and the packed lengths' count.
LAYER_CASES = [((4, 4096, 6, 6, 256, 512), None), ((1, 32768, 8, 16, 128, 256), 8)]
LAYER_IMPL, FLA_LAYER_IMPL = "comba_bwd.fla.chunk_comba", "fla 0.6.0 chunk_comba (guard lifted)"


def _fla_chunk_comba(bench):
    """fla 0.6.0's chunk_comba with its Hopper guard (fla #640) lifted, a timing anchor only; None when fla is not
    installed."""
    if bench.optional("fla") is None:
        return None
    import fla.ops.common.chunk_o as chunk_o
    from fla.ops.comba import chunk_comba

    chunk_o.TRITON_ABOVE_3_7_1 = True
    return chunk_comba


def _fla(bench):
    """(forward, forward + backward) of fla chunk_comba through the exact adapter, or None when fla is not
    installed."""
    chunk_comba = _fla_chunk_comba(bench)
    if chunk_comba is None:
        return None

    def forward(q, k, v, p, beta, g):
        p_read = (g.exp()[..., None] * p).to(p.dtype)       # fla reads before the decay; the spec after
        return chunk_comba(q, k, v, p_read, g, beta)[0]     # fla's order: (..., p, g, beta)

    def inference(q, k, v, p, beta, g):
        with torch.no_grad():
            return forward(q, k, v, p, beta, g)

    def step(q, k, v, p, beta, g, do):
        ins = [x.detach().requires_grad_(True) for x in (q, k, v, p, beta, g)]
        return torch.autograd.grad(forward(*ins), ins, do)

    return inference, step


def _model_inputs(B, T, H, HV, K, V, with_state, seed=0):
    """A model's call on the GPU: q, k, p (B, T, H, K) bf16 with unit-norm k and p, v (B, T, HV, V) bf16, beta
    (B, T, HV) bf16 in (0.5, 0.73), g (B, T, HV) fp32 <= 0, the initial state (B, HV, K, V) fp32 or None, and the
    gradients of o and of the final state (or None)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    randn = lambda *shape: torch.randn(*shape, generator=gen, device="cuda")  # noqa: E731
    unit = lambda x: torch.nn.functional.normalize(x, dim=-1)  # noqa: E731
    q, k, p = randn(B, T, H, K), unit(randn(B, T, H, K)), unit(randn(B, T, H, K))
    v, beta = randn(B, T, HV, V), randn(B, T, HV).sigmoid() * 0.23 + 0.5
    g = torch.nn.functional.logsigmoid(randn(B, T, HV)) / 4
    inputs = [x.bfloat16() for x in (q, k, v, p, beta)] + [g]
    state = 0.3 * randn(B, HV, K, V) if with_state else None
    d_final = randn(B, HV, K, V) if with_state else None
    return inputs, state, randn(B, T, HV, V).bfloat16(), d_final


def _model_step(attention):
    """The training step of a model's call `attention(q, k, v, p, beta, g, state) -> (o, final state or None)`: the
    gradients of <o, do> (+ <final, d_final>) with respect to the six inputs and the state, where there is one."""

    def step(inputs, state, do, d_final):
        leaves = [x.detach().requires_grad_(True) for x in (*inputs, *([] if state is None else [state]))]
        o, final = attention(*leaves[:6], leaves[6] if state is not None else None)
        if final is None:
            return torch.autograd.grad(o, leaves, do)
        return torch.autograd.grad((o, final), leaves, (do, d_final))

    return step


def _model_rows(kernel, bench, fla, shape, with_state) -> list[dict]:
    """Our training step of a model's call at `shape` and fla's with the same arguments (see the module docstring)."""
    B, T, H, HV, K, V = shape
    case = "(B,T,H,HV,K,V)=" + ",".join(map(str, shape)) + (" state" if with_state else " grouped") + " bf16 step"
    flops = 1.5 * bench.spec(SPEC).work(B, T, HV, K, V)
    args = _model_inputs(*shape, with_state)
    final = {"output_final_state": True} if with_state else {}

    def ours(q, k, v, p, beta, g, state):
        out = kernel.comba_attention(q, k, v, p, beta, g, initial_state=state, **final)
        return out if with_state else (out, None)

    def reference(q, k, v, p, beta, g, state):
        out = kernel.comba_forward_reference(q, k, v, p, beta, g, initial_state=state, **final)
        return out if with_state else (out, None)

    inputs, state, do, d_final = args
    ref = _model_step(reference)([x.float() for x in inputs], state, do.float(), d_final)
    names = MODEL_GRADS if with_state else GRADS
    row = _measured(bench, case, MODEL_STEP, _model_step(ours), args, ref, flops,
                    lambda b, got, r: errors(b, names, got, r))
    rows = [row]
    del ref
    if fla is not None:
        from fla.ops.comba import chunk_comba

        def fla_call(q, k, v, p, beta, g, state):
            p_read = (g.exp()[..., None] * p).to(p.dtype) if with_state else p   # the exact adapter, equal heads
            return chunk_comba(q, k, v, p_read, g, beta, initial_state=state, output_final_state=with_state)

        fla_step = _model_step(fla_call)
        measure = lambda: tflops_row(case, FLA_MODEL_STEP, bench.time(lambda: fla_step(*args)), flops)  # noqa: E731
        fla_row = attempt(case, FLA_MODEL_STEP, measure)
        if "ms" in fla_row:
            row["x_vs_fla"] = fla_row["ms"] / row["ms"]
        rows.append(fla_row)
    free()
    return rows


def _layer_inputs(B, T, H, HV, K, V, n_packed, seed=0):
    """A Comba layer's call as fla's layer makes it: q, k, p (B, T, H, K) bf16 (normalised inside the call), v
    (B, T, HV, V) bf16, g (B, T, HV) fp32 <= 0, beta (B, T, HV) bf16 in (0, 1), do, and the int32 offsets of
    `n_packed` seeded random lengths summing to T (None for a padded batch)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    randn = lambda *shape: torch.randn(*shape, generator=gen, device="cuda")  # noqa: E731
    q, k, p, v = randn(B, T, H, K), randn(B, T, H, K), randn(B, T, H, K), randn(B, T, HV, V)
    g = -torch.nn.functional.softplus(randn(B, T, HV)) / 4
    beta = randn(B, T, HV).sigmoid()
    cu = None
    if n_packed:
        lengths = random_lengths(n_packed, T, seed)
        cu = torch.tensor([0, *lengths], device="cuda").cumsum(0).to(torch.int32)
    return [x.bfloat16() for x in (q, k, v, p)] + [g, beta.bfloat16()], randn(B, T, HV, V).bfloat16(), cu


def _layer_rows(kernel, bench, shape, n_packed) -> list[dict]:
    """fla's Comba layer's training-and-prefill call at `shape` (LAYER_CASES): `comba_bwd.fla.chunk_comba` and fla's
    own with the same arguments (use_qk_l2norm_in_kernel, cu_seqlens where packed), the forward under no_grad (case
    "... forward") and the step, forward and backward through autograd ("... step"). Errors: ours against fla's
    (two bf16 computations: a cross-check; the tests hold the accuracy). Credited work: the spec's W per value head,
    W / 2 for the forward and 3 W / 2 for the step."""
    B, T, H, HV, K, V = shape
    inputs, do, cu = _layer_inputs(*shape, n_packed)
    kind = f"packed {n_packed} seqs" if n_packed else "padded batch"
    case = "fla layer (B,T,H,HV,K,V)=" + ",".join(map(str, shape)) + f" {kind} bf16"
    work = bench.spec(SPEC).work(B, T, HV, K, V)
    ours = submodule(kernel, "fla").chunk_comba
    fla = _fla_chunk_comba(bench)

    def forward(fn):
        def run(q, k, v, p, g, beta):
            with torch.no_grad():
                return fn(q, k, v, p, g, beta, use_qk_l2norm_in_kernel=True, cu_seqlens=cu)[0]
        return run

    def step(fn):
        def run(*args):
            ins = [x.detach().requires_grad_(True) for x in args]
            o = fn(*ins, use_qk_l2norm_in_kernel=True, cu_seqlens=cu)[0]
            return torch.autograd.grad(o, ins, do)
        return run

    rows = []
    for label, wrap, flops, names in ((" forward", forward, work / 2, ("o",)),
                                      (" step", step, 1.5 * work, ("dq", "dk", "dv", "dp", "dg", "dbeta"))):
        outputs = {}

        def measure(impl, fn):
            out = wrap(fn)(*inputs)
            outputs[impl] = [out] if label == " forward" else out  # noqa: B023
            return tflops_row(case + label, impl, bench.time(lambda: wrap(fn)(*inputs)), flops)  # noqa: B023

        row = attempt(case + label, LAYER_IMPL, lambda: measure(LAYER_IMPL, ours))  # noqa: B023
        rows.append(row)
        if fla is not None:
            fla_row = attempt(case + label, FLA_LAYER_IMPL, lambda: measure(FLA_LAYER_IMPL, fla))  # noqa: B023
            rows.append(fla_row)
            if "ms" in row and "ms" in fla_row:
                row["x_vs_fla"] = fla_row["ms"] / row["ms"]
                row.update({f"err_vs_fla_{n}": bench.rel_err(a, b)
                            for n, a, b in zip(names, outputs[LAYER_IMPL], outputs[FLA_LAYER_IMPL])})
        del outputs
        free()
    return rows


def _inference(kernel):
    def forward(q, k, v, p, beta, g):
        with torch.no_grad():
            return kernel.comba_attention(q, k, v, p, beta, g)

    return forward


def _spec_forward(s):
    """The spec's chunked fp32 forward, `_comba_forward`, as its reference code defines it."""
    env = {}
    exec(s.reference_imports, env)
    exec(s.reference_src, env)
    return env["_comba_forward"]


def _grad_errors(bench, got, ref):
    return errors(bench, GRADS, got, ref)


def _output_error(bench, got, ref):
    return errors(bench, ("o",), [got], [ref])


def _stage_sweep(bench, pipeline, case, flops, inputs, ref, scale):
    """The whole backward and each of its stages alone (`ms_<stage>`), at one shape."""
    stages, grads = pipeline.backward_stages(*inputs, scale)
    run = lambda: [stage.run() for stage in stages]  # noqa: E731
    run()
    errs = _grad_errors(bench, [x[:, : inputs[0].shape[1]] for x in grads], ref)   # grads are padded in time
    t_all = bench.time(run)
    return tflops_row(case, "sweep stages", t_all, flops, **errs,
                      **{f"ms_{s.name}": bench.time(s.run) for s in stages})


def _forward_stage_sweep(bench, pipeline, case, flops, inputs, ref_o, scale):
    """The whole forward and each of its stages alone (`ms_<stage>`), at one shape (T a multiple of the chunk)."""
    stages, o = pipeline.forward_stages(*inputs, scale)
    run = lambda: [stage.run() for stage in stages]  # noqa: E731
    run()
    t_all = bench.time(run)
    return tflops_row(case, "sweep forward stages", t_all, flops, **_output_error(bench, o, ref_o),
                      **{f"ms_{s.name}": bench.time(s.run) for s in stages})


def _measured(bench, case, impl, fn, args, ref, flops, errors_of, **extra):
    """The row of `fn(*args)`: its errors against `ref` (`errors_of(bench, got, ref)`) and its median time."""
    errs = errors_of(bench, fn(*args), ref)
    return tflops_row(case, impl, bench.time(lambda: fn(*args)), flops, **errs, **extra)


def _anchor(bench, case, impl, fn, args, ref, flops, errors_of, ours):
    """An anchor's row beside `ours`, which gets its time over ours (`x_vs_fla`); its error row if it fails."""
    row = attempt(case, impl, lambda: _measured(bench, case, impl, fn, args, ref, flops, errors_of))
    if "ms" in row:
        ours["x_vs_fla"] = row["ms"] / ours["ms"]
    return row


def _decode_inputs(B, H, K, V, device):
    """One new token a sequence at fla's layer distribution: q, k, p, v, beta (bf16), g fla's gate
    -exp(A) softplus(x) (fp32) and a carried fp32 state (B, H, K, V)."""
    import torch.nn.functional as F

    gen = torch.Generator(device=device).manual_seed(0)
    bf = dict(device=device, dtype=torch.bfloat16, generator=gen)
    q, k, p = (torch.randn(B, 1, H, K, **bf) for _ in range(3))
    v = torch.randn(B, 1, H, V, **bf)
    beta = torch.rand(B, 1, H, **bf)
    A = -3 * torch.rand(H, device=device, generator=gen)
    g = -A.exp() * F.softplus(torch.randn(B, 1, H, device=device, generator=gen) - 2)
    state = 0.1 * torch.randn(B, H, K, V, device=device, generator=gen)
    return (q, k, v, p, beta, g), state


def _decode_calls(kernel, bench, x, state):
    """{impl: call} of one decode step in fla's order with q/k/p L2 norm: ours, and fla's when installed."""
    q, k, v, p, beta, g = x

    def ours():
        with torch.no_grad():
            return kernel.comba_decode(q, k, v, p, beta, g, state, use_qk_l2norm=True, read_order="fla")

    calls = {"comba-bwd decode": ours}
    if bench.optional("fla") is not None:
        from fla.ops.comba import fused_recurrent_comba

        def theirs():
            with torch.no_grad():
                return fused_recurrent_comba(q, k, p, v, g, beta, initial_state=state, output_final_state=True,
                                             use_qk_l2norm_in_kernel=True)

        calls[FLA_DECODE] = theirs
    return calls


def _decode_rows(kernel, bench, shape, device) -> list[dict]:
    """Decode of one token at `shape` (B, H, K, V): time, GB/s and % of copy of ours and fla's, errors against the
    fp32 recurrent reference, and ours over fla's time (`x_vs_fla`)."""
    B, H, K, V = shape
    x, state = _decode_inputs(B, H, K, V, device)
    ref = kernel.comba_decode_reference(*(t.float() for t in x), state, use_qk_l2norm=True, read_order="fla")
    nbytes = 2 * B * H * K * V * 4 + B * H * (3 * K * 2 + 2 * V * 2 + 2 + 4)
    case = "decode T=1 (B,H,K,V)=" + ",".join(map(str, shape)) + " bf16, fla order, q/k/p l2norm"
    rows = []
    for impl, call in _decode_calls(kernel, bench, x, state).items():
        def measure(call=call):
            errs = errors(bench, ("o", "state"), call(), ref)
            return gbps_row(case, impl, bench.time(call), nbytes, bench, **errs)

        rows.append(attempt(case, impl, measure))
    if len(rows) == 2 and "ms" in rows[0] and "ms" in rows[1]:
        rows[0]["x_vs_fla"] = rows[1]["ms"] / rows[0]["ms"]
    if bench.sweep:
        rows += _decode_sweep_rows(kernel, bench, case, x, state, ref, nbytes)
    del x, state, ref
    free()
    return rows


def _decode_sweep_rows(kernel, bench, case, x, state, ref, nbytes) -> list[dict]:
    """The decode kernel alone (portable.decode.launch, no checks) at each DECODE_SWEEP (V block, warps)."""
    decode = submodule(kernel, "portable.decode")
    q, k, v, p, beta, g = x
    o, new = torch.empty_like(v), torch.empty_like(state)
    rows = []
    for block, warps in DECODE_SWEEP:
        impl = f"sweep decode kernel BV={block} warps={warps}"

        def run(block=block, warps=warps):
            decode.launch(q, k, v, p, beta, g, state, o, new, q.shape[-1] ** -0.5, None, True, True, block, warps)
            return o, new

        rows.append(attempt(case, impl, lambda run=run, impl=impl: gbps_row(
            case, impl, bench.time(run), nbytes, bench, **errors(bench, ("o", "state"), run(), ref))))
    return rows


def _graph_replay(call):
    """`call` captured in a CUDA graph at its first use (after a warm-up call on a side stream that compiles it), then
    that graph's replay."""
    graphs = []

    def replay():
        if not graphs:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                call()
            torch.cuda.current_stream().wait_stream(side)
            graphs.append(torch.cuda.CUDAGraph())
            with torch.cuda.graph(graphs[0]):
                call()
        graphs[0].replay()

    return replay


def _decode_latency_rows(kernel, bench, shape, device) -> list[dict]:
    """Wall-clock per call at B = DECODE_LATENCY_B (`harness.latency_row`): ours, its registered custom op (the
    dispatch layers the eager call skips; grad mode on, no input requiring grad), on CUDA its replay as a captured CUDA
    graph, and fla's, beside the empty-launch floor of the same run; ours gets `us_over_floor`."""
    _, H, K, V = shape
    B = DECODE_LATENCY_B
    x, state = _decode_inputs(B, H, K, V, device)
    case = f"decode latency T=1 (B,H,K,V)={B},{H},{K},{V} bf16"
    calls = _decode_calls(kernel, bench, x, state)
    q, k, v, p, beta, g = x
    calls["registered custom op"] = lambda: kernel.op.comba_decode_op(q, k, v, p, beta, g, state, None, K**-0.5,
                                                                      True, "fla")
    if device == "cuda":
        calls["comba-bwd decode, one CUDA graph replay"] = _graph_replay(calls["comba-bwd decode"])
    rows = [attempt(case, impl, lambda call=call, impl=impl: latency_row(case, impl, call, device))
            for impl, call in calls.items()]
    floor = floor_row(device)
    if "value" in rows[0]:
        rows[0]["us_over_floor"] = rows[0]["value"] - floor["value"]
    return [*rows, floor]


def side_by_side(kernel, bench, shapes=None, sweep_shapes=None, seed_shapes=None, model_shapes=None, decode_shape=None,
                 decode_only=False, layer_cases=None) -> list[dict]:
    """Every measure shape of the spec: our backward, forward and training step with fla chunk_comba's forward and
    forward + backward beside them (if installed); the spec's seed reference at SEED_SHAPES; then the stage sweep at
    SWEEP_SHAPES; then a model's training step at MODEL_SHAPES; then fla's Comba layer's calls at LAYER_CASES
    (`_layer_rows`); then the decode rows at `decode_shape` (DECODE_SHAPE)
    and its latency at B = DECODE_LATENCY_B. `shapes`/`sweep_shapes`/`seed_shapes`/`model_shapes`/`decode_shape`
    exist for a run cut into one call a shape (model_shapes: [[(B, T, H, HV, K, V), with_state], ...]; a run given
    `shapes` runs no model shape or layer case unless given model_shapes / layer_cases too
    (layer_cases: [[(B, T, H, HV, K, V), packed sequences or null], ...]), and `shapes=[]` no measure shape); `decode_only` runs
    the decode rows alone."""
    decode_shape = tuple(decode_shape or DECODE_SHAPE)
    decode_rows = lambda: (_decode_rows(kernel, bench, decode_shape, device())  # noqa: E731
                           + _decode_latency_rows(kernel, bench, decode_shape, device()))
    if decode_only:
        return decode_rows()
    s = bench.spec(SPEC)
    fla = _fla(bench)
    spec_forward = _spec_forward(s)
    pipeline = submodule(kernel, "pipeline")
    step = HUB.training_step(kernel)
    if model_shapes is None:
        model_shapes = MODEL_SHAPES if shapes is None else []
    if layer_cases is None:
        layer_cases = LAYER_CASES if shapes is None else []
    shapes = [tuple(x) for x in (s.measure_shapes if shapes is None else shapes)]
    sweep_shapes = [tuple(x) for x in (sweep_shapes or SWEEP_SHAPES)] if bench.sweep else []
    seed_shapes = [tuple(x) for x in (SEED_SHAPES if seed_shapes is None else seed_shapes)]
    rows = []
    for shape in dict.fromkeys(shapes + sweep_shapes):
        case = "(B,T,H,K,V)=" + ",".join(map(str, shape)) + " bf16"
        flops = s.work(*shape)
        inputs = s.make(*shape, 0)
        ref_o = spec_forward(*(x.float() for x in inputs[:6]))
        if shape in sweep_shapes:
            rows.append(_forward_stage_sweep(bench, pipeline, case + " forward", flops / 2, inputs[:6], ref_o,
                                             shape[3] ** -0.5))
        if shape in shapes:
            ours = _measured(bench, case + " forward", "comba-bwd forward", _inference(kernel), inputs[:6], ref_o,
                             flops / 2, _output_error)
            rows.append(ours)
            if fla is not None:
                rows.append(_anchor(bench, case + " forward", FLA_FORWARD, fla[0], inputs[:6], ref_o, flops / 2,
                                    _output_error, ours))
        del ref_o
        ref = s.ref(*(x.float() for x in inputs))
        if shape in shapes:
            ours = _measured(bench, case, "comba-bwd triton", kernel.comba_backward, inputs, ref, flops, _grad_errors,
                             path=kernel.kernel_path(inputs[0]))
            ours_step = _measured(bench, case + " step", "comba-bwd step", step, inputs, ref, 1.5 * flops,
                                  _grad_errors)
            rows += [ours, ours_step]
            if fla is not None:
                fla_step = _anchor(bench, case + " step", FLA_STEP, fla[1], inputs, ref, 1.5 * flops, _grad_errors,
                                   ours_step)
                rows.append(fla_step)
                if "ms" in fla_step:  # the same run beside the backward
                    rows.append(tflops_row(case, FLA_STEP, fla_step["ms"], flops,
                                           **{k: v for k, v in fla_step.items() if k.startswith("err")}))
                    ours["x_vs_fla"] = fla_step["ms"] / ours["ms"]
            if shape in seed_shapes:
                t_seed = bench.time(lambda: s.ref(*inputs))
                rows.append(tflops_row(case, "spec seed reference (autograd, fp32)", t_seed, flops))
                ours["x_vs_seed_reference"] = t_seed / ours["ms"]
        if shape in sweep_shapes:
            rows.append(_stage_sweep(bench, pipeline, case, flops, inputs, ref, shape[3] ** -0.5))
        del inputs, ref
        free()
    for shape, with_state in model_shapes:
        rows += _model_rows(kernel, bench, fla, tuple(shape), with_state)
    for shape, n_packed in layer_cases:
        rows += _layer_rows(kernel, bench, tuple(shape), n_packed)
    return rows + decode_rows()


def compile_cases(kernel, spec):
    """(label, call) pairs for `python -m tools.compile_offline`: the forward and the backward at every measure shape,
    on meta tensors (bf16, g in float32), the backward's portable Triton stages at the first measure shape of each
    K (what runs where the Gluon path does not: other GPUs, Triton releases it is not verified under), a model's
    call, forward and backward, at MODEL_SHAPES and MODEL_COMPILE_SHAPES, in fla's read order with q/k/p normalised at
    FLA_COMPILE_SHAPES and on packed sequences at PACKED_COMPILE_SHAPES, the plain call at PLAIN_COMPILE_SHAPES, the
    normalisation and the group sum alone at L2NORM_COMPILE_CASES, and the decode kernel at DECODE_SHAPE in both read
    orders, with 64 tokens, grouped heads and fp32, and at the smaller K."""
    pipeline = submodule(kernel, "pipeline")
    dispatch = submodule(kernel, "dispatch")

    def meta_inputs(B, T, H, K, V):
        q, k, p = (torch.empty(B, T, H, K, dtype=torch.bfloat16, device="meta") for _ in range(3))
        v, do = (torch.empty(B, T, H, V, dtype=torch.bfloat16, device="meta") for _ in range(2))
        beta = torch.empty(B, T, H, dtype=torch.bfloat16, device="meta")
        g = torch.empty(B, T, H, dtype=torch.float32, device="meta")
        return q, k, v, p, beta, g, do

    def case(shape):
        q, k, v, p, beta, g, do = meta_inputs(*shape)
        K = shape[3]

        def both():
            dispatch.comba_forward_cuda(q, k, v, p, beta, g, K**-0.5)
            dispatch.comba_backward_cuda(q, k, v, p, beta, g, do, K**-0.5)

        return f"(B,T,H,K,V)={shape}", both

    def portable_case(shape):
        inputs = meta_inputs(*shape)
        portable = dispatch.plan(inputs[0], shape[4])._replace(gluon=(), v_adjoint_in_grads=False, pieces=1)

        def stages():
            for stage in pipeline.backward_stages(*inputs, shape[3] ** -0.5, plan=portable)[0]:
                stage.run()

        return f"(B,T,H,K,V)={shape} portable backward", stages

    def decode_case(B, T, H, HV, K, V, dtype, read_order, l2norm, packed=False):
        """A decode call; `packed`: B sequences of one token packed by cu_seqlens (fla's generate()), from zeros."""
        rows, steps = (1, B) if packed else (B, T)
        q, k, p = (torch.empty(rows, steps, H, K, dtype=dtype, device="meta") for _ in range(3))
        v = torch.empty(rows, steps, HV, V, dtype=dtype, device="meta")
        beta = torch.empty(rows, steps, HV, dtype=dtype, device="meta")
        g = torch.empty(rows, steps, HV, dtype=torch.float32, device="meta")
        state = None if packed else torch.empty(B, HV, K, V, dtype=torch.float32, device="meta")
        offsets = torch.empty(B + 1, dtype=torch.int32, device="meta") if packed else None
        label = (f"decode (B,T,H,HV,K,V)={(B, T, H, HV, K, V)} {str(dtype).removeprefix('torch.')} {read_order}"
                 + " l2norm" * l2norm + " packed, no state" * packed)
        return label, lambda: dispatch.comba_decode_cuda(q, k, v, p, beta, g, state, None, offsets, l2norm,
                                                         read_order)

    def model_case(shape, with_state, read_order="decay_first", l2norm=False):
        B, T, H, HV, K, V = shape
        q, k, _, p, _, _, _ = meta_inputs(B, T, H, K, V)
        _, _, v, _, beta, g, do = meta_inputs(B, T, HV, K, V)
        state = torch.empty(B, HV, K, V, dtype=torch.float32, device="meta") if with_state else None

        def both():
            dispatch.comba_state_forward_cuda(q, k, v, p, beta, g, state, K**-0.5, with_state, None, read_order,
                                              l2norm)
            dispatch.comba_state_backward_cuda(q, k, v, p, beta, g, state, do, state, K**-0.5, None, read_order,
                                               l2norm)

        order = " fla" if read_order == "fla" else ""
        kind = f"model ({'state' if with_state else 'grouped'}){order}{' l2norm' * l2norm}"
        return f"(B,T,H,HV,K,V)={shape} {kind}", both

    def l2norm_case(B, T, H, HV, K, dtype, l2norm):
        """The normalisation's launch and the backward's last launch (group sum, normalisation's backward)."""
        stage = submodule(kernel, "portable.l2norm")
        q, k, p = (torch.empty(B, T, H, K, dtype=dtype, device="meta") for _ in range(3))
        heads = [torch.empty(B, T, HV, K, dtype=torch.float32, device="meta") for _ in range(3)]

        def both():
            if l2norm:
                stage.launch_forward(q, k, p)
            stage.launch_backward(q, k, p, *heads, l2norm)

        alone = "" if l2norm else ", group sum alone"
        return f"l2norm stage (B,T,H,HV,K)={(B, T, H, HV, K)} {str(dtype).removeprefix('torch.')}{alone}", both

    def packed_case(T, N, H, HV, K, V, read_first):
        """A model's call on N sequences packed on T rows (B = 1) as its stages run it, on T / 64 + N chunks (the
        `pipeline.Packing` of offsets that meta tensors have no values for): the forward's and the backward's stages
        with a state per sequence, in fla's read order where read_first."""
        q, k, _, p, _, _, _ = meta_inputs(1, T, H, K, V)
        _, _, v, _, beta, g, do = meta_inputs(1, T, HV, K, V)
        state = torch.empty(N, HV, K, V, dtype=torch.float32, device="meta")
        chunks = T // 64 + N
        packing = pipeline.Packing(torch.empty(N + 1, dtype=torch.int32, device="meta"),
                                   torch.empty(chunks, 2, dtype=torch.int32, device="meta"), chunks)
        model = dispatch.plan(q, V, model=True)

        def stages():
            forward = pipeline.forward_stages(q, k, v, p, beta, g, K**-0.5, model, state, torch.empty_like(state),
                                              packing, read_first)[0]
            backward = pipeline.backward_stages(q, k, v, p, beta, g, do, K**-0.5, None, model, state, state,
                                                torch.empty_like(state), packing, read_first)[0]
            for stage in forward + backward:
                stage.run()

        return f"(T,N,H,HV,K,V)={(T, N, H, HV, K, V)} model (packed){' fla' * read_first}", stages

    shapes = spec(SPEC).measure_shapes
    for shape in shapes:
        yield case(shape)
    B, H, K, V = DECODE_SHAPE
    yield decode_case(B, 1, H, H, K, V, torch.bfloat16, "fla", True)
    yield decode_case(B, 1, H, H, K, V, torch.bfloat16, "decay_first", False)
    yield decode_case(B, 64, H, 2 * H, K, V, torch.float32, "fla", True)
    yield decode_case(B, 1, H, H, K, V, torch.bfloat16, "fla", True, packed=True)
    for K, V in ((128, 256), (64, 64)):
        yield decode_case(8, 1, 4, 8, K, V, torch.float16, "fla", True)
    for K in sorted({shape[3] for shape in shapes}):
        yield portable_case(next(shape for shape in shapes if shape[3] == K))
    # The fused kernels take K = 256 only on GPUs with the shared memory it needs (`validation.fused_k`); elsewhere
    # those calls take the eager reference, and their cases compile nothing.
    takes = functools.partial(submodule(kernel, "validation").fused_k, torch.device("meta"))
    for shape, with_state in MODEL_SHAPES + MODEL_COMPILE_SHAPES:
        if takes(shape[4]):
            yield model_case(shape, with_state)
    for shape, with_state in FLA_COMPILE_SHAPES:
        if takes(shape[4]):
            yield model_case(shape, with_state, "fla", l2norm=True)
    for shape in PACKED_COMPILE_SHAPES:
        for read_first in (False, True):
            if takes(shape[4]):
                yield packed_case(*shape, read_first)
    for shape in PLAIN_COMPILE_SHAPES:
        if takes(shape[3]):
            yield case(shape)
    for args in L2NORM_COMPILE_CASES:
        yield l2norm_case(*args)
