"""Nsight Compute profiles of each kernel's `kernels benchmark` case, on the GPU machine: where the time of
our kernels goes (throughput against the DRAM and SM ceilings, occupancy and what limits it, warp stalls).

For each named kernel this runs, under `ncu --profile-from-start off`, the `Benchmark` subclass of
`kernels/<name>/benchmarks/benchmark.py`: `setup()`, every `benchmark_*` method once to compile and warm
up, then every method once more between cudaProfilerStart and cudaProfilerStop, so that ncu sees exactly
the launches of one call. The report goes to `bench/runs/<date>-<sha>-ncu-<name>.txt` (under `$OUT`
when set; bench/runs/ is not committed). Clocks are left as they are (`--clock-control none`, as the machine's notes ask).
"""

import argparse
import inspect
import shutil
import subprocess
import sys

from .common import REPO_ROOT, resolve
from .gpu_bench import load_kernel, prepare_run

# SourceCounters names the instructions where warps stall most and the shared-memory and branch counts:
# where a latency-bound loop (the ldsa TMA forward's) spends its cycles.
SECTIONS = ("SpeedOfLight", "Occupancy", "LaunchStats", "WarpStateStats", "MemoryWorkloadAnalysis", "SourceCounters",
            "InstructionStats")


def benchmark_case(module) -> type:
    """The one `kernels.benchmark.Benchmark` subclass a kernel's benchmark module defines."""
    from kernels.benchmark import Benchmark

    cases = [c for _, c in inspect.getmembers(module, inspect.isclass) if issubclass(c, Benchmark) and c is not Benchmark]
    if len(cases) != 1:
        raise ValueError(f"{module.__file__} defines {len(cases)} Benchmark subclasses, expected one")
    return cases[0]


def profiled_call(name: str) -> None:
    """The process ncu watches: one kernel's benchmark case, warmed up, then one call profiled."""
    import torch

    from bench.harness import hub_benchmark

    bench = benchmark_case(hub_benchmark(name))()
    bench.kernel, bench.device = load_kernel(name), "cuda"
    if bench.seed is not None:
        torch.manual_seed(bench.seed)
    # Each workload as `kernels benchmark` runs it (its own setup_<workload> where it has one, else setup()),
    # warmed up, then one call inside the profiled range.
    for workload in [m.removeprefix("benchmark_") for m in dir(bench) if m.startswith("benchmark_")]:
        getattr(bench, f"setup_{workload}", bench.setup)()
        call = getattr(bench, f"benchmark_{workload}")
        call()
        torch.cuda.synchronize()
        torch.cuda.profiler.start()
        call()
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.gpu_profile", description=__doc__.split("\n\n")[0])
    parser.add_argument("kernels", nargs="*", help="kernel names (default: all)")
    parser.add_argument("--case", metavar="NAME", help=argparse.SUPPRESS)  # the profiled process itself
    args = parser.parse_args(argv)
    if args.case:
        profiled_call(args.case)
        return 0
    if shutil.which("ncu") is None:
        print("gpu_profile needs Nsight Compute (ncu) on the PATH", file=sys.stderr)
        return 2
    names = [k.name for k in resolve(args.kernels)]
    _, base = prepare_run(names)
    failed = 0
    for name in names:
        report = base.with_name(f"{base.name}-ncu-{name}.txt")
        command = ["ncu", "--clock-control", "none", "--profile-from-start", "off",
                   *(arg for section in SECTIONS for arg in ("--section", section)),
                   sys.executable, "-m", "tools.gpu_profile", "--case", name]  # fmt: skip
        with report.open("w") as out:
            rc = subprocess.run(command, cwd=REPO_ROOT, stdout=out, stderr=subprocess.STDOUT).returncode
        failed += rc != 0
        print(f"{name}: {report} (ncu exit {rc})", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
