"""based-bwd benchmarks: the `kernels benchmark` class (small, medium and large workloads) and the side-by-side
table for the GPU run.

Every row of the side-by-side table times the whole contract of the spec, `(q, k, v, do) -> (dq, dk, dv)`:
ours recomputes what it needs, so fla is timed forward + backward (its backward alone is given for
information). TFLOP/s are the spec's credited FLOPs (`canonical_work`, chunk 64) over the time; errors are
relative Frobenius against the spec's reference evaluated in fp32, computed once per shape.
"""

import importlib

import torch
from kernels.benchmark import Benchmark

# (B, T, H, K, V) of the `kernels benchmark` workloads by device: on CUDA the spec's calibration shape is the
# medium one and a measure shape the large one; on the CPU (the eager reference) sizes that take seconds.
WORKLOADS = {
    "cuda": {"small": (1, 2048, 8, 16, 128), "medium": (2, 2048, 8, 16, 128), "large": (8, 4096, 16, 16, 128)},
    "cpu": {"small": (1, 128, 2, 8, 32), "medium": (1, 256, 2, 16, 64), "large": (2, 512, 4, 16, 64)},
}


def _make(B, T, H, K, V, device, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    q, k = (torch.randn(B, T, H, K, generator=g, device=device, dtype=torch.bfloat16) for _ in range(2))
    v, do = (torch.randn(B, T, H, V, generator=g, device=device, dtype=torch.bfloat16) for _ in range(2))
    return q, k, v, do


class BasedBackward(Benchmark):
    """bf16 `based_backward` at a small, a medium and a large (B, T, H, K, V) (`WORKLOADS`). The output is dq,
    dk, dv flattened into one fp32 vector in units of the reference's largest gradient, so that the runner's
    check (absolute 1e-2) asks for 1% of it: the gradients reach magnitudes where bf16's rounding alone is above
    1e-2. The reference is the eager analytic backward in fp32."""

    seed = 0

    def _setup(self, workload: str):
        shape = WORKLOADS["cuda" if str(self.device).startswith("cuda") else "cpu"][workload]
        self.q, self.k, self.v, self.do = _make(*shape, self.device)
        self.unit = 1 / self._reference().abs().max()
        self.out = None

    def _reference(self) -> torch.Tensor:
        ref = self.kernel.based_backward_reference(self.q.float(), self.k.float(), self.v.float(), self.do.float())
        return torch.cat([g.flatten() for g in ref])

    def _run(self):
        grads = self.kernel.based_backward(self.q, self.k, self.v, self.do)
        self.out = torch.cat([g.float().flatten() for g in grads]) * self.unit

    def _verify(self) -> torch.Tensor:
        return self._reference() * self.unit

    def setup_small(self):
        self._setup("small")

    def benchmark_small(self):
        self._run()

    def verify_small(self) -> torch.Tensor:
        return self._verify()

    def setup_medium(self):
        self._setup("medium")

    def benchmark_medium(self):
        self._run()

    def verify_medium(self) -> torch.Tensor:
        return self._verify()

    def setup_large(self):
        self._setup("large")

    def benchmark_large(self):
        self._run()

    def verify_large(self) -> torch.Tensor:
        return self._verify()


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
    """A row timing fn() -> (dq, dk, dv) or (o,), with its errors against ref; an implementation that cannot run
    this shape (fla's limits, a Hopper guard) gets a row with the error instead of stopping the run."""
    row = {"case": case, "impl": impl, "ms": None, "metric": "TFLOP/s", "value": None, "err": None}
    try:
        got = fn()
        errs = [bench.rel_err(g, r) for g, r in zip(got, ref)] if ref is not None else None
        del got
        ms = bench.time(fn)
    except Exception as e:
        # the end of the text holds the root cause (a Triton CompilationError starts with the source excerpt)
        row["error"] = f"{type(e).__name__}: ...{' '.join(str(e).split())[-600:]}"
        return row
    row.update(ms=ms, value=flops / (ms * 1e-3) / 1e12)
    if errs:
        row["err"] = max(errs)
        if len(errs) == 3:
            row.update(err_dq=errs[0], err_dk=errs[1], err_dv=errs[2])
    row.update(extra)
    return row


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
            if ours["ms"] and row["ms"]:
                ours[f"x_vs_fla_{name}"] = row["ms"] / ours["ms"]
        rivals = [r["ms"] for r in rows if r["impl"].startswith("fla") and r["ms"]]
        if ours["ms"] and rivals:
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
    dispatch = importlib.import_module(f"{kernel.__name__}.dispatch")
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
                step_rows.append(dict(row, case=step_case, value=row["value"] and 1.5 * row["value"]))
                for own in (ours, step):
                    if own["ms"] and row["ms"]:
                        own[f"x_vs_fla_{name}"] = row["ms"] / own["ms"]
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
        torch.cuda.empty_cache()
    return rows


def compile_cases(kernel, spec):
    """(label, call) pairs for `python -m tools.compile_sm90`: each launch plan the package uses or the
    benchmark times, at every measure shape, on meta tensors, for the backward and the forward; and the
    backward's fp32 path (IEEE matmuls, the interpreter tests' exact mode) with each K's default plan. The
    forward's fp32 mode is the interpreter's alone (CUDA fp32 calls take the reference), and fp16 calls run the
    bf16 kernels."""
    dispatch = importlib.import_module(f"{kernel.__name__}.dispatch")
    shapes = spec("based_backward").measure_shapes

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

    for shape in shapes:
        K = shape[3]
        for config in sorted(set(dispatch.BACKWARD_CONFIG_CHOICES) | {dispatch.DEFAULT_BACKWARD_CONFIG[K]}, key=str):
            yield case(shape, torch.bfloat16, config)
        for config in sorted(set(dispatch.FORWARD_CONFIG_CHOICES) | {dispatch.DEFAULT_FORWARD_CONFIG[K]}, key=str):
            yield forward_case(shape, torch.bfloat16, config)
    for K in sorted({shape[3] for shape in shapes}):
        first = next(s for s in shapes if s[3] == K)
        yield case(first, torch.float32, dispatch.DEFAULT_BACKWARD_CONFIG[K])
