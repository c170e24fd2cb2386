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
"""

import torch

from .harness import attempt, errors, free, hub_benchmark, submodule, tflops_row

SPEC = "comba_backward"
GRADS = ("dq", "dk", "dv", "dp", "dbeta", "dg")
HUB = hub_benchmark("comba-bwd")
SWEEP_SHAPES = [(8, 2048, 32, 128, 128), (16, 2048, 32, 64, 128)]
# fla chunk_comba's forward and training step are measured beside ours at every measure shape; the spec's seed
# reference (an eager fp32 autograd run) is timed at SEED_SHAPES alone.
SEED_SHAPES = [HUB.BENCH_SHAPE]
# The portable reverse scan at K = 128 holds its (128, 64) fp32 dS block, dVn and X of a V block in 255 registers of
# 4 warps, so that two CTAs share an SM; it spills up to 148 B under the supported Tritons (tools.compile_offline).
SPILLS_BY_DESIGN = {"_reverse_scan_kernel": 160}

FLA_STEP = "fla 0.6.0 chunk_comba fwd+bwd (p'=exp(g)p bf16, guard lifted)"
FLA_FORWARD = "fla 0.6.0 chunk_comba forward (p'=exp(g)p bf16, guard lifted)"


def _fla(bench):
    """(forward, forward + backward) of fla chunk_comba through the exact adapter, or None when fla is not
    installed."""
    fla = bench.optional("fla")
    if fla is None:
        return None
    import fla.ops.common.chunk_o as chunk_o
    from fla.ops.comba import chunk_comba

    chunk_o.TRITON_ABOVE_3_7_1 = True  # lift the Hopper guard of fla #640: a timing anchor only

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


def side_by_side(kernel, bench, shapes=None, sweep_shapes=None, seed_shapes=None) -> list[dict]:
    """Every measure shape of the spec: our backward, forward and training step with fla chunk_comba's forward and
    forward + backward beside them (if installed); the spec's seed reference at SEED_SHAPES; then the stage sweep at
    SWEEP_SHAPES. `shapes`/`sweep_shapes`/`seed_shapes` exist for a dry run at tiny shapes on the CPU (and for a run
    cut into one call a shape)."""
    s = bench.spec(SPEC)
    fla = _fla(bench)
    spec_forward = _spec_forward(s)
    pipeline = submodule(kernel, "pipeline")
    step = HUB.training_step(kernel)
    shapes = [tuple(x) for x in (shapes or s.measure_shapes)]
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
    return rows


def compile_cases(kernel, spec):
    """(label, call) pairs for `python -m tools.compile_offline`: the forward and the backward at every measure shape,
    on meta tensors (bf16, g in float32), and the backward's portable Triton stages at the first measure shape of each
    K (what runs where the Gluon path does not: other GPUs, Triton releases it is not verified under)."""
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
        portable = dispatch.Plan(gluon=(), v_adjoint_in_grads=False, pieces=1)

        def stages():
            for stage in pipeline.backward_stages(*inputs, shape[3] ** -0.5, plan=portable)[0]:
                stage.run()

        return f"(B,T,H,K,V)={shape} portable backward", stages

    shapes = spec(SPEC).measure_shapes
    for shape in shapes:
        yield case(shape)
    for K in sorted({shape[3] for shape in shapes}):
        yield portable_case(next(shape for shape in shapes if shape[3] == K))
