"""The GPU run: every kernel's correctness tests on the device, then each kernel's side-by-side benchmark
against the anchors of ANCHORS.md, all in one process so the ratios hold; results go to
`bench/runs/<date>-<sha>.{json,md}` (to `$OUT` when set, for the device tool to bring back); `python -m tools.results
add RUN <report>.json` appends its rows to the one results table, bench/results.jsonl, which the cards render.

Each kernel's harness, `bench/<package>.py`, provides `side_by_side(kernel, bench) -> list[dict]`; `Bench` below
is what it gets: a timer, the copy bandwidth measured in this run, the specs, and optional packages.
"""

import argparse
import datetime
import importlib
import importlib.util
import json
import os
import re
import subprocess
import sys
import time
import traceback
from pathlib import Path

from . import specs
from .common import HUB_CACHE, HUB_ORG, REPO_ROOT, git, read_kernel, resolve

RUNS = REPO_ROOT / "bench" / "runs"
sys.path.insert(0, str(REPO_ROOT))  # bench/, the harnesses, beside tools/ wherever the tools run from


class Bench:
    """What a kernel's side_by_side() may use; one instance per run."""

    def __init__(self, sweep: bool = True):
        import torch

        # False: only the shipped defaults and the anchors, no candidate-config sweeps (a short run).
        self.sweep = sweep
        self.copy_gbps = self._copy_bandwidth(torch)

    @staticmethod
    def time(fn) -> float:
        """Median milliseconds of `fn()` over repeated runs, warm-up excluded (CUDA events)."""
        import triton.testing

        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")

    def _copy_bandwidth(self, torch) -> float:
        """Device-to-device copy of a 2 GiB buffer; bytes read plus bytes written, in GB/s."""
        src = torch.empty(2**31 // 4, dtype=torch.float32, device="cuda").uniform_()
        dst = torch.empty_like(src)
        ms = self.time(lambda: dst.copy_(src))
        del src, dst
        torch.cuda.empty_cache()
        return 2 * 2**31 / ms / 1e6

    @staticmethod
    def spec(name: str):
        """A shared spec on CUDA (reference, input maker, canonical work), or None where specs are absent."""
        return specs.spec(name) if specs.has_spec(name) else None

    @staticmethod
    def optional(module: str):
        """An optional comparison package (fla, flashmel), or None when it is not installed."""
        if importlib.util.find_spec(module) is None:
            return None
        return importlib.import_module(module)

    rel_err = staticmethod(specs.rel_err)


def run_tests(out_dir: Path, names: list[str], all_tests: bool, timeout: float, keyword: str | None) -> dict:
    """The named kernels' GPU tests (`-m gpu`; CPU CI runs the rest), or with `all_tests` the whole suite."""
    junit = out_dir / "pytest.xml"
    paths = [str(REPO_ROOT / "kernels" / n) for n in names] + ([str(REPO_ROOT / "tests")] if all_tests else [])
    select = ([] if all_tests else ["-m", "gpu"]) + (["-k", keyword] if keyword else [])
    # Compiling the Triton configs is CPU-bound: spread the tests over workers sharing the one GPU.
    # Compiling a Triton specialization per window, dtype and config dominates the test time (the ldsa file
    # alone outran 140 s on 4 file-bound workers in run 86c310e): spread single tests over 8 workers.
    n_workers = 8 if importlib.util.find_spec("xdist") else 0
    # A worker serializes the warnings it captures for the controller, which re-imports each warning's module: a
    # kernel's (FastPathFallback) lives in a Hub-loaded module the controller cannot import, and the run would end
    # in an INTERNALERROR. Without the warnings plugin pytest collects no warnings; pytest.warns and
    # warnings.catch_warnings in the tests work as before.
    workers = ["-n", str(n_workers), "--dist", "load", "-p", "no:warnings"] if n_workers else []
    # Each worker would start one CPU thread a core for the float64 references, eight times the cores in all: two
    # comba-bwd Gluon tests were still in theirs when the 280 s test run ended (f4ff440). A worker's share of them.
    env = None
    if n_workers:
        env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or n_workers) // n_workers))}
    log = out_dir / "pytest.log"
    start = time.time()
    with log.open("w") as sink:
        try:
            proc = subprocess.run(
                [sys.executable, "-m", "pytest", "-v", "-rfE", "--durations=25", "-p", "no:cacheprovider",
                 f"--junitxml={junit}", *workers, *select, *paths],
                cwd=REPO_ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT, timeout=timeout,
            )
        except subprocess.TimeoutExpired:
            return {"timed_out_after_s": timeout, **outcomes_before_cut(log.read_text(errors="replace"))}
    import xml.etree.ElementTree as ET

    suite = ET.parse(junit).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    failed = [
        f"{case.get('classname')}::{case.get('name')}"
        for case in suite.iter("testcase")
        if case.find("failure") is not None or case.find("error") is not None
    ]
    summary = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    selection = {"selection": keyword} if keyword else {}  # a part of the tests (`tools.results` labels it so)
    return {**summary, **selection, "failed": failed, "seconds": round(time.time() - start, 1),
            "exit_code": proc.returncode}


def outcomes_before_cut(log: str) -> dict:
    """What a test run cut by its timeout had reported in its log (`pytest -v`, each outcome a line such as
    `[gw3] [ 45%] PASSED path::test`): the passed and skipped counts, the failed tests and the share of the run done
    (the largest a line shows: workers report out of order). A cut run has no junit report, and its results are no
    results rows (`tools.results` reads the complete runs)."""
    outcomes = re.findall(r"\[\s*(\d+)%\] (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS) (\S+)", log)
    return {
        "passed_before_cut": sum(o == "PASSED" for _, o, _ in outcomes),
        "skipped_before_cut": sum(o == "SKIPPED" for _, o, _ in outcomes),
        "failed_before_cut": [name for _, o, name in outcomes if o in ("FAILED", "ERROR")],
        "percent_done": max((int(percent) for percent, _, _ in outcomes), default=0),
    }


def use_hub_cache() -> None:
    """Make this process (and its children) load kernels from the offline Hub cache `make hub` lays."""
    os.environ.setdefault("HF_HUB_CACHE", str(HUB_CACHE))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")


def build_into_hub(names: list[str]) -> None:
    """Build the named kernels and lay them into the offline Hub cache this process (and its children) load
    from."""
    use_hub_cache()
    for step in ("build", "hub"):
        subprocess.run([sys.executable, "-m", f"tools.{step}", *names], cwd=REPO_ROOT, check=True)


def prepare_run(names: list[str]) -> tuple[str, Path]:
    """`build_into_hub`, then the sha the run measures and the results path stem `<out>/<date>-<sha>` (out:
    $OUT when set, for the device tool to bring back, else bench/runs, which is not committed)."""
    build_into_hub(names)
    sha = os.environ.get("TESSERA_GIT_SHA") or git("rev-parse", "HEAD") or "unknown"
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    out_dir = Path(os.environ.get("OUT", RUNS))
    out_dir.mkdir(parents=True, exist_ok=True)
    return sha, out_dir / f"{stamp}-{sha[:12]}"


def load_kernel(name: str):
    """The kernel `name`, loaded from the Hub cache as model code loads it."""
    from kernels import get_kernel

    return get_kernel(f"{HUB_ORG}/{name}", version=1, trust_remote_code=True)


def load_harness(name: str):
    """The side-by-side harness of kernel `name`: the module bench/<package>.py."""
    return importlib.import_module(f"bench.{read_kernel(REPO_ROOT / 'kernels' / name).package}")


def side_by_side_kwargs(items: list[str], names: list[str]) -> dict[str, dict]:
    """{kernel: keyword arguments for its side_by_side} from `KERNEL=JSON` items (`--bench-kwargs`), each JSON an
    object, each KERNEL one of `names`."""
    kwargs = {}
    for item in items:
        name, sep, text = item.partition("=")
        if not sep or name not in names:
            raise SystemExit(f"--bench-kwargs {item!r}: expected KERNEL=JSON with KERNEL one of {names}")
        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            raise SystemExit(f"--bench-kwargs {item!r}: {e}") from None
        if not isinstance(value, dict):
            raise SystemExit(f"--bench-kwargs {item!r}: the JSON must be an object of keyword arguments")
        kwargs[name] = value
    return kwargs


def run_benchmarks(names: list[str], bench: Bench, results: dict, save, kwargs: dict[str, dict]) -> None:
    """Each kernel's side_by_side rows into `results` (called with `kwargs[name]`, where given), saved after every
    kernel so a cut-off run keeps them."""
    for name in names:
        try:
            harness, kernel = load_harness(name), load_kernel(name)
            start = time.time()
            rows = harness.side_by_side(kernel, bench, **kwargs.get(name, {}))
            results[name] = {"rows": rows, "seconds": round(time.time() - start, 1)}
        except Exception:
            results[name] = {"rows": [], "error": traceback.format_exc()}
            print(results[name]["error"], file=sys.stderr)
        import torch

        torch.cuda.empty_cache()
        save()


def fmt(value) -> str:
    """A table cell: floats to three or four significant digits, anything else as it is."""
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1e-2 or abs(value) >= 1e4 else f"{value:.3f}".rstrip("0").rstrip(".")
    return str(value)


def markdown(report: dict) -> str:
    lines = [
        f"# GPU run {report['date']} at {report['git_sha'][:12]}{' (dirty)' if report['dirty'] else ''}",
        "",
        f"{report['device']}; torch {report['torch']}, triton {report['triton']}; "
        f"copy bandwidth in this run: {report['copy_gbps']:.0f} GB/s",
        "",
        f"Tests: {report['tests']}" if "tests" in report else "Tests: not run",
    ]
    for name, result in report["benchmarks"].items():
        lines += ["", f"## {name}", ""]
        if result.get("error"):
            lines += ["```", result["error"].strip(), "```"]
        rows = result["rows"]
        if not rows:
            continue
        keys = list(dict.fromkeys(k for row in rows for k in row))
        lines += ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
        lines += ["| " + " | ".join(fmt(row.get(k, "")) for k in keys) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.gpu_bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("kernels", nargs="*", help="kernel names (default: all)")
    parser.add_argument("--skip-tests", action="store_true", help="benchmarks only")
    parser.add_argument("--skip-bench", action="store_true", help="tests only")
    parser.add_argument("--all-tests", action="store_true", help="the whole suite, not only the `gpu` tests")
    parser.add_argument("--no-sweep", action="store_true", help="skip the candidate-config sweeps")
    parser.add_argument("--tests", metavar="EXPR", help="only the tests pytest's -k EXPR selects (a run the results "
                        "label as that part, never as every GPU test)")
    parser.add_argument("--test-timeout", type=float, default=300, help="seconds for the test run (default 300)")
    parser.add_argument("--bench-kwargs", action="append", default=[], metavar="KERNEL=JSON",
                        help="keyword arguments for KERNEL's side_by_side, e.g. 'comba-bwd={\"shapes\": "
                             "[[8, 4096, 16, 128, 128]]}' (a run cut to what one device call holds); repeatable")
    parser.add_argument("--specs", type=Path, default=specs.folder())
    args = parser.parse_args(argv)
    names = [k.name for k in resolve(args.kernels)]
    bench_kwargs = side_by_side_kwargs(args.bench_kwargs, names)  # a bad one fails here, on any machine

    import torch
    import triton

    if not torch.cuda.is_available():
        print("gpu_bench needs a CUDA device", file=sys.stderr)
        return 2
    os.environ["TESSERA_SPECS"] = str(args.specs)
    sha, base = prepare_run(names)
    report = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "git_sha": sha,
        # The device copy of the tree may carry no usable git metadata: the caller can say what it sent.
        "dirty": (os.environ["TESSERA_GIT_DIRTY"] == "1" if "TESSERA_GIT_DIRTY" in os.environ
                  else bool(git("status", "--porcelain", "kernels"))),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "test_kernels": names,
    }

    def save():
        base.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
        base.with_suffix(".md").write_text(markdown(report))

    if not args.skip_tests:
        report["tests"] = run_tests(base.parent, names, args.all_tests, args.test_timeout, args.tests)
        print(f"tests: {report['tests']}", flush=True)
    bench = Bench(sweep=not args.no_sweep)
    report["copy_gbps"] = bench.copy_gbps
    report["benchmarks"] = {}
    save()
    if not args.skip_bench:
        run_benchmarks(names, bench, report["benchmarks"], save, bench_kwargs)
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
