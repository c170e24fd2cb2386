"""What the side-by-side harnesses share: the rows they return, the errors in them, where a call runs, the
latency rows and their empty-launch floor, and the Hub benchmark modules they take their workloads from.

A row is a dict with `case`, `impl`, `ms`, `metric` (the row's own unit: GB/s or TFLOP/s, or for a latency row
"us/call" with its GPU time in `gpu_us`), `value`, `err` (the largest relative Frobenius error against the spec's
reference, `rel_err`) and any further columns; an implementation that fails at a case gets an `error_row` instead, so
that one anchor's failure never hides the other rows. `bench` is the run's `tools.gpu_bench.Bench`.
"""

import importlib
import importlib.util
import random
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


def random_lengths(n: int, total: int, seed: int = 0) -> list[int]:
    """n seeded random lengths >= 1 summing to total: a packed batch's sequences."""
    cuts = sorted(random.Random(seed).sample(range(1, total), n - 1))
    return [b - a for a, b in zip([0] + cuts, cuts + [total])]


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


# The latency rows (`latency_row`): seconds of back-to-back calls before the timed passes (on a shared GPU host the
# first few tenths of a second of launches after heavy rows run slow for every call, torch's own included), the
# timed passes, the seconds each pass lasts (its calls from one call's time, at most MAX_LATENCY_CALLS), and the
# calls whose kernels the profiler sums for the GPU time.
LATENCY_WARMUP_S, LATENCY_PASSES, LATENCY_PASS_S, MAX_LATENCY_CALLS, GPU_TIME_CALLS = 0.5, 5, 0.05, 2000, 20
LATENCY_METRIC = "us/call"
FLOOR_CASE, FLOOR_IMPL = "latency: empty launch", "empty Triton kernel launched from Python"


def host_latency_us(fn, device: str) -> float:
    """Microseconds of wall-clock per call of `fn` from Python, host overhead included: LATENCY_WARMUP_S seconds of
    calls, then calls back to back with one synchronisation at the end of each pass (as many as last about
    LATENCY_PASS_S, at most MAX_LATENCY_CALLS), the best of LATENCY_PASSES passes (as timeit reports): on a shared
    GPU host passes of the same launches vary widely, and the best pass is the call's own cost."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    calls = 0
    warm_from = time.perf_counter()
    while time.perf_counter() - warm_from < LATENCY_WARMUP_S or calls < 2:
        fn()
        calls += 1
    sync()  # the warm-up's time a call, with the calls still queued on the GPU when it ended
    per_call = (time.perf_counter() - warm_from) / calls
    calls = max(2, min(MAX_LATENCY_CALLS, int(LATENCY_PASS_S / max(per_call, 1e-9))))
    best = float("inf")
    for _ in range(LATENCY_PASSES):
        sync()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        best = min(best, (time.perf_counter() - start) / calls * 1e6)
    return best


def gpu_us(fn, device: str, calls: int = GPU_TIME_CALLS) -> float | None:
    """Microseconds of GPU time per call of `fn`: the device time of every kernel and copy it runs, summed by the
    profiler over `calls` calls; None on the CPU."""
    if device != "cuda":
        return None
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    events = profile.key_averages()
    return sum(e.self_device_time_total for e in events if e.device_type == torch.autograd.DeviceType.CUDA) / calls


def latency_row(case, impl, fn, device: str, **extra) -> dict:
    """A latency row: `us/call`, the wall-clock per eager call of `fn` (`host_latency_us`; `ms` the same in
    milliseconds), and `gpu_us`, its GPU time (`gpu_us`)."""
    us = host_latency_us(fn, device)
    return {"case": case, "impl": impl, "ms": us * 1e-3, "metric": LATENCY_METRIC, "value": us,
            "gpu_us": gpu_us(fn, device), **extra}


def floor_row(device: str) -> dict:
    """The latency row of the empty-launch floor: a Triton kernel that does nothing, on one program, launched the
    way the kernels' calls are timed (FLOOR_CASE, FLOOR_IMPL)."""
    buffer = torch.zeros(1, device=device)
    return latency_row(FLOOR_CASE, FLOOR_IMPL, lambda: _empty_kernel[(1,)](buffer), device)


@triton.jit
def _empty_kernel(x_ptr):
    """The floor's kernel: one tensor argument, as the timed kernels have several, and nothing done."""
    pass
