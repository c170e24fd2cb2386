"""Host (Python) time of the small eager CUDA calls, measured without a GPU: how long our own code takes from the
public function to the launch, per call, and where that time goes.

Each case calls a public function of a built kernel (loaded like model code does, `get_kernel` from the local Hub
cache `.hub/`, so rebuild with `make hub` after editing torch-ext) on CPU tensors, with only the CUDA-only pieces
stubbed, so that the call runs the eager CUDA path itself: public function -> the CUDA entry point of `dispatch`
(`<op>_cuda`) -> the stage module's launch -> `common.launch.launch`, or where the package keeps direct calls
(`common.direct_calls.DirectCalls`), public function -> the kept direct call of the signature, which its first call
keeps -> `common.launch.kept_launcher`'s launch. The stubs:

- `torch.Tensor.is_cuda` answers True (a Python property in place of torch's C getter);
- `torch._C._cuda_getDevice()` (what `devices.on_device` and a kept direct call ask) answers the CPU tensors'
  device index (None), so that every launch finds its tensors on the current device; the kept direct calls' scratch
  (`common.direct_calls.StreamScratch`) finds no capture and one stream;
- the package's kept launchers (`common.launch._compiled`) hold a no-op launcher and stream lookup for each
  specialization the case launches, so that every launch takes the kept-launcher path of a warm CUDA call.

What is measured is the code that runs, so a later change to the path shows here. The stubs' own time (measured
alone, times their calls a call) is reported separately and taken out of the path's time. Not included: the device
launch cost, Triton's compiled launcher (its C launch function, past `CompiledKernel.run`'s Python wrapper under
Triton 3.6: `common.launch._launcher_call`; the driver call), the current-device, current-stream and capture
queries, and what `torch.empty` costs on CUDA (the caching allocator): CPU allocations are measured in their place,
with glibc keeping freed memory as the caching allocator does. Branches taken on a CUDA device only are not measured
either: the Hopper fast paths (each case runs the portable path), `FAST_PATHS.runs` past its device-type test, and
the first call's kept folded-floor counters (`portable.floor.counters` makes fresh zeros on CPU tensors). Figures
are this machine's: compare them with each other, not with GPU wall-clock.

The breakdown is cProfile's (its own overhead inflates Python calls, so read it as shares): per function, its calls
and its own time a call of the op.
"""

import argparse
import contextlib
import cProfile
import gc
import os
import pstats
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from .common import HUB_CACHE, HUB_ORG


@dataclass(frozen=True)
class Case:
    """One measured call: the kernel it loads, its public function's call on CPU tensors (`make(kernel)` returns a
    no-argument callable), whether it runs under torch.no_grad (as the GPU latency rows do), and the launches it
    makes."""

    kernel: str
    description: str
    make: object
    no_grad: bool
    launches: int


def _based_decode(kernel):
    import torch

    B, T, H, K, V = 1, 1, 16, 16, 64
    P = 1 + K + K * K
    q, k = (torch.randn(B, T, H, K, dtype=torch.bfloat16) for _ in range(2))
    v = torch.randn(B, T, H, V, dtype=torch.bfloat16)
    state = (torch.randn(B, H, P, V), torch.rand(B, H, P) + 1)
    return lambda: kernel.based_decode(q, k, v, state)


def _comba_decode(kernel):
    import torch

    B, H, K, V = 1, 6, 256, 512
    q, k, p = (torch.randn(B, 1, H, K, dtype=torch.bfloat16) for _ in range(3))
    v = torch.randn(B, 1, H, V, dtype=torch.bfloat16)
    beta = torch.rand(B, 1, H, dtype=torch.bfloat16)
    g = -torch.rand(B, 1, H)
    state = torch.randn(B, H, K, V)
    return lambda: kernel.comba_decode(q, k, v, p, beta, g, state, use_qk_l2norm=True, read_order="fla")


def _ldsa(kernel):
    import torch

    B, T, H, Dh, left, right = 16, 256, 8, 64, 14, 0
    a = torch.randn(B, H, left + right + 1, T, dtype=torch.bfloat16)
    v = torch.randn(B, H, Dh, T, dtype=torch.bfloat16)
    return lambda: kernel.ldsa_local_attention(a, v, left, right)


def _whisper(clips: int):
    def make(kernel):
        import torch

        audio = torch.randn(clips, 30 * 16000) * 0.1
        return lambda: kernel.whisper_log_mel(audio, 80)

    return make


def _spectrogram(kernel):
    import torch

    stft = torch.randn(1, 3000, 201, dtype=torch.complex64)
    mel_filters = kernel.mel_filters(80)
    return lambda: kernel.log_mel_spectrogram(stft, mel_filters)


CASES = {
    "based_decode": Case("based-bwd", "B=1 T=1 (H,K,V)=(16,16,64) bf16, no grad", _based_decode, True, 1),
    "comba_decode": Case("comba-bwd", "B=1 T=1 (H,K,V)=(6,256,512) bf16, fla order, l2norm, no grad", _comba_decode,
                         True, 1),
    "ldsa_local_attention": Case("ldsa", "[B,T]=[16,256] H=8 Dh=64 W=15 causal bf16 forward, no grad", _ldsa, True, 1),
    "whisper_log_mel": Case("log-mel", "1 clip of 30 s, 80 mels, fp32", _whisper(1), False, 1),
    "whisper_log_mel_16": Case("log-mel", "16 clips of 30 s, 80 mels, fp32", _whisper(16), False, 2),
    "log_mel_spectrogram": Case("log-mel", "1 clip of 3000 frames, 201 bins, 80 mels", _spectrogram, False, 4),
}


def _stub_launcher(*arguments):
    """Stands for a compiled kernel's launcher (`CompiledKernel.run`)."""


def _stub_stream(device):
    """Stands for Triton's current-stream query."""
    return 0


def _stub_get_device():
    """Stands for torch._C._cuda_getDevice(): the CPU tensors' device index."""
    return None


def _stub_capturing() -> bool:
    """Stands for torch._C._cuda_isCurrentStreamCapturing(): no capture."""
    return False


# torch's C functions that the kept direct calls ask, and their stubs.
_C_STUBS = {"_cuda_getDevice": _stub_get_device, "_cuda_getCurrentRawStream": _stub_stream,
            "_cuda_isCurrentStreamCapturing": _stub_capturing}


def _stub_is_cuda(tensor) -> bool:
    """Stands for torch.Tensor.is_cuda."""
    return True


class _Recorder(dict):
    """The package's kept launchers while a case's first call runs: every lookup answers a stub launcher for its
    key (the arguments a kept one is called with, as `common.launch.launch` stores them) and records it."""

    def get(self, key, default=None):
        plan = key[0]
        n_tensors = len(key) - 2  # (plan, device, one entry a tensor)
        constexprs = tuple(plan.meta[name] for name in plan.kernel.arg_names[n_tensors + len(plan.ints):])
        hit = self[key] = (_stub_launcher, None, (None,) * 4, _stub_stream, (*plan.ints, *constexprs))
        return hit


def _direct_calls(package: str) -> list:
    """The package's kept direct calls (`common.direct_calls.DirectCalls`, held by its dispatch module)."""
    import importlib

    kind = importlib.import_module(f"{package}.common.direct_calls").DirectCalls
    return [calls for calls in vars(importlib.import_module(f"{package}.dispatch")).values() if isinstance(calls, kind)]


@contextlib.contextmanager
def cuda_stubs(launch_module):
    """The stubs above in place (`launch_module`: the package's `common.launch`); the kept launchers a plain dict
    of the recorded stubs after the first call (`_Recorder`), so that lookups cost what a real dict's do. Everything
    is put back on exit, and the package's kept direct calls, which the stubs' launchers are kept in, are forgotten
    on entry and on exit."""
    import torch

    direct_calls = _direct_calls(launch_module.__package__.rpartition(".")[0])
    for calls in direct_calls:
        calls.clear()
    saved = (torch.Tensor.__dict__.get("is_cuda"), launch_module._compiled,
             {name: torch._C.__dict__.get(name) for name in _C_STUBS})
    torch.Tensor.is_cuda = property(_stub_is_cuda)
    for name, stub in _C_STUBS.items():
        setattr(torch._C, name, stub)
    launch_module._compiled = _Recorder()
    try:
        yield
    finally:
        if saved[0] is None:
            del torch.Tensor.is_cuda
        else:
            torch.Tensor.is_cuda = saved[0]
        launch_module._compiled = saved[1]
        for name, original in saved[2].items():
            if original is None:
                delattr(torch._C, name)
            else:
                setattr(torch._C, name, original)
        for calls in direct_calls:
            calls.clear()


@dataclass
class Report:
    """A case's figures (µs a call): the path's host time with the stubs' time taken out, the stubs' time, the
    launches a call made, and the breakdown [(function, calls a call, own µs a call)], largest first."""

    case: str
    path_us: float
    stub_us: float
    launches: float
    breakdown: list

    def layers(self) -> dict:
        """The breakdown's own time summed by layer (`LAYERS`), as shares of the whole: where a call's time goes."""
        sums = dict.fromkeys([*LAYERS, "torch and the rest"], 0.0)
        for label, _, own in self.breakdown:
            sums[next((layer for layer, test in LAYERS.items() if test(label)), "torch and the rest")] += own
        whole = sum(sums.values()) or 1.0
        return {layer: own / whole for layer, own in sums.items()}


# The layers of a call, by the breakdown's function labels (a kernel's file, or a torch builtin), first match wins.
LAYERS = {
    "op.py (checks, the direct-call decision)": lambda label: label.startswith("op.py:"),
    "dispatch.py (the entry point)": lambda label: label.startswith("dispatch.py:"),
    "stage modules (planning, outputs)": lambda label: label.startswith(("portable/", "hopper/")),
    "common/ (launch, direct calls, devices)": lambda label: label.startswith("common/"),
    "allocations": lambda label: label.startswith(("<built-in method torch.empty", "<built-in method torch.zeros")),
    "stubs and the timing loop": lambda label: label.startswith("host_time.py:"),
}


def _per_call_us(fn, calls: int, repeats: int) -> float:
    """The least over `repeats` runs of `calls` back-to-back calls of fn, in µs a call. Python's cyclic garbage
    collector is off while they run, as timeit has it: a collection's cost is the whole process's heap (torch,
    triton), not the call's, and where one lands in a run swung the figures by several µs."""
    best = float("inf")
    gc.collect()
    gc.disable()
    try:
        for _ in range(repeats):
            start = time.perf_counter_ns()
            for _ in range(calls):
                fn()
            best = min(best, (time.perf_counter_ns() - start) / calls / 1e3)
    finally:
        gc.enable()
    return best


def _repeat(fn, calls: int) -> None:
    """fn called `calls` times, its results dropped at once (as a serving loop's are)."""
    for _ in range(calls):
        fn()


def _label(filename: str, line: int, name: str) -> str:
    if filename == "~":
        return name  # a builtin: "<built-in method torch.empty_like>"
    parts = Path(filename).parts
    for anchor in ("torch-cpu", "torch-cuda", "tools"):  # a kernel's build, or this tool
        if anchor in parts:
            return f"{'/'.join(parts[parts.index(anchor) + 1:])}:{name}"
    return f"{Path(filename).name}:{name}"


_STUBS = {_stub_launcher.__name__, _stub_stream.__name__, _stub_get_device.__name__, _stub_capturing.__name__,
          _stub_is_cuda.__name__}


def _stub_costs(launch_module) -> dict:
    """Each stub's time a call, measured alone (µs): the is_cuda property read, the current-device and capture
    queries, and one kept launch's stream lookup and launcher call with the arguments of the first recorded
    launch."""
    import torch

    x = torch.empty(0)
    run, _, head, stream_of, trailing = next(iter(launch_module._compiled.values()))
    args = (1, 1, 1, None, None, *head, *([x] * 8), *trailing)
    n = 20000
    return {
        _stub_is_cuda.__name__: _per_call_us(lambda: x.is_cuda, n, 3),
        _stub_get_device.__name__: _per_call_us(_stub_get_device, n, 3),
        _stub_capturing.__name__: _per_call_us(_stub_capturing, n, 3),
        _stub_stream.__name__: _per_call_us(lambda: stream_of(None), n, 3),
        _stub_launcher.__name__: _per_call_us(lambda: run(*args), n, 3),
    }


def _keep_freed_memory() -> None:
    """Make glibc's malloc (under torch's CPU allocator) keep freed memory, as CUDA's caching allocator does: no
    allocation of the cases' outputs (up to a few MB) then maps fresh pages, whose faults would swing the figures
    by microseconds from run to run. Elsewhere than glibc nothing changes."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
    mallopt(M_TRIM_THRESHOLD, 1 << 30)
    mallopt(M_MMAP_THRESHOLD, 1 << 25)  # glibc's largest


def measure(name: str, calls: int = 1000, repeats: int = 11, profile_calls: int = 500) -> Report:
    """Host time of case `name` of CASES (see the module docstring)."""
    import importlib

    import torch
    from kernels import get_kernel

    _keep_freed_memory()
    case = CASES[name]
    kernel = get_kernel(f"{HUB_ORG}/{case.kernel}", version=1, trust_remote_code=True)
    launch_module = importlib.import_module(f"{kernel.__name__}.common.launch")
    call = case.make(kernel)
    grad = torch.no_grad() if case.no_grad else contextlib.nullcontext()
    with cuda_stubs(launch_module), grad:
        call()  # plans the launches and records their keys
        if len(launch_module._compiled) != case.launches:
            raise RuntimeError(f"{name}: {len(launch_module._compiled)} launches recorded, expected {case.launches}")
        launch_module._compiled = dict(launch_module._compiled)
        total = _per_call_us(call, calls, repeats)
        profile = cProfile.Profile()
        profile.runcall(_repeat, call, profile_calls)
        stub_cost = _stub_costs(launch_module)
    stats = pstats.Stats(profile).stats
    rows, stub_us, launches = [], 0.0, 0.0
    for (filename, line, fname), (_, ncalls, tottime, _, _) in stats.items():
        per_call = ncalls / profile_calls
        if fname in _STUBS and filename == __file__:
            stub_us += per_call * stub_cost[fname]
            launches += per_call if fname == _stub_launcher.__name__ else 0
        if filename == __file__ and fname == _repeat.__name__:
            continue  # the profiling loop itself
        rows.append((_label(filename, line, fname), per_call, tottime / profile_calls * 1e6))
    rows.sort(key=lambda r: -r[2])
    return Report(name, total - stub_us, stub_us, launches, rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.host_time", description=__doc__.split("\n\n")[0])
    parser.add_argument("cases", nargs="*", help=f"cases (default: all of {', '.join(CASES)})")
    parser.add_argument("--calls", type=int, default=1000, help="back-to-back calls a timed run (default 1000)")
    parser.add_argument("--repeats", type=int, default=11, help="timed runs; the fastest counts (default 11)")
    parser.add_argument("--top", type=int, default=15, help="functions of the breakdown shown (default 15)")
    args = parser.parse_args(argv)
    unknown = set(args.cases) - set(CASES)
    if unknown:
        parser.error(f"unknown cases {sorted(unknown)}; the cases are {', '.join(CASES)}")
    os.environ.setdefault("HF_HUB_CACHE", str(HUB_CACHE))
    os.environ["HF_HUB_OFFLINE"] = "1"
    for name in args.cases or CASES:
        report = measure(name, args.calls, args.repeats)
        print(f"{name} ({CASES[name].description}): {report.path_us:.1f} us a call on the host path "
              f"(stubs {report.stub_us:.1f} us taken out; {report.launches:g} launch a call)")
        print("  by layer: " + ", ".join(f"{layer} {share:.0%}" for layer, share in report.layers().items()))
        if args.top:
            print(f"  {'own us':>7}  {'calls':>5}  function")
        for label, ncalls, own in report.breakdown[: args.top]:
            print(f"  {own:7.2f}  {ncalls:5.3g}  {label}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
