"""What the side-by-side harnesses share: the rows they return, the errors in them, where a call runs, the
per-call latency loop and its floor (an empty kernel's launch), and the Hub benchmark modules they take their workloads from.

A row is a dict with `case`, `impl`, `ms`, `metric` (the row's own unit: GB/s or TFLOP/s), `value`, `err` (the
largest relative Frobenius error against the spec's reference, `rel_err`) and any further columns; an
implementation that fails at a case gets an `error_row` instead, so that one anchor's failure never hides the
other rows. `bench` is the run's `tools.gpu_bench.Bench`.
"""

import importlib
import importlib.util
import sys
import time
import traceback

import torch
import triton

from tools.common import REPO_ROOT


def hub_benchmark(name: str):
    """kernels/<name>/benchmarks/benchmark.py as a module (the Hub benchmark: its workloads and input makers),
    loaded once."""
    module_name = f"tessera_benchmark_{name.replace('-', '_')}"
    if module_name not in sys.modules:
        path = REPO_ROOT / "kernels" / name / "benchmarks" / "benchmark.py"
        module_spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[module_name] = module
        module_spec.loader.exec_module(module)
    return sys.modules[module_name]


def submodule(kernel, name: str):
    """A module of a loaded kernel that its __init__ does not import (the launchers the sweeps call directly)."""
    return importlib.import_module(f"{kernel.__name__}.{name}")


def device() -> str:
    """Where the run's tensors go: the GPU, or the CPU of a dry run (Triton under TRITON_INTERPRET=1)."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def free() -> None:
    """Hand the cached blocks of the case just measured back, so that the next case's largest shape fits."""
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def gbps_row(case, impl, ms, nbytes, bench, err=None, **extra) -> dict:
    """A row on bytes moved: GB/s and its percent of the copy bandwidth measured in the same run (`pct_copy`)."""
    gbps = nbytes / ms / 1e6
    return {"case": case, "impl": impl, "ms": ms, "metric": "GB/s", "value": gbps, "err": err,
            "pct_copy": 100.0 * gbps / bench.copy_gbps, **extra}


def tflops_row(case, impl, ms, flops, err=None, **extra) -> dict:
    """A row on credited work: TFLOP/s of `flops` in `ms`."""
    return {"case": case, "impl": impl, "ms": ms, "metric": "TFLOP/s", "value": flops / ms / 1e9, "err": err,
            **extra}


def error_row(case, impl, error: BaseException) -> dict:
    """The row of an implementation that failed at `case`: the end of its message (where Triton puts the
    reason, after the source excerpt of a CompilationError) and of the traceback."""
    text = f"{type(error).__name__}: {' '.join(str(error).split())}"
    return {"case": case, "impl": impl, "error": text[-600:], "where": traceback.format_exc()[-400:]}


def attempt(case, impl, measure) -> dict:
    """`measure()`'s row, or the `error_row` of the exception it raises (an anchor's limits, a Hopper guard)."""
    try:
        return measure()
    except Exception as e:  # noqa: BLE001 - one implementation failing must not end the run
        return error_row(case, impl, e)


def errors(bench, names, got, ref) -> dict:
    """`err_<name>` for each output against its reference, and `err`, the largest of them."""
    errs = {f"err_{n}": bench.rel_err(g, r) for n, g, r in zip(names, got, ref)}
    return {"err": max(errs.values()), **errs}


def max_abs_err(x, ref) -> float:
    """The largest absolute difference, in float64 on x's device."""
    return (x.double() - ref.to(x.device).double()).abs().max().item()


def host_latency_us(fn, device: str, calls: int, passes: int, warmup_s: float) -> float:
    """Microseconds per call of `fn` from Python, host overhead included: `warmup_s` seconds of calls, then
    `calls` back to back between syncs, the best of `passes` such passes (as timeit reports): on a shared GPU host
    passes of the same launches vary widely, and the best pass is the call's own cost."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    warm_until = time.perf_counter() + warmup_s
    while time.perf_counter() < warm_until:
        fn()
    sync()
    best = float("inf")
    for _ in range(passes):
        for _ in range(20):
            fn()
        sync()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        best = min(best, (time.perf_counter() - start) / calls * 1e6)
    return best



@triton.jit
def _empty_kernel(x):
    pass


def empty_launch(device: str):
    """A call that launches an empty Triton kernel of one program on `device`: the floor of a latency row, the
    host's and the driver's cost of any launch from Python."""
    x = torch.empty(1, device=device)
    return lambda: _empty_kernel[(1,)](x)
