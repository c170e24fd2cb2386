"""The one results table, `bench/results.jsonl`: a row per measured figure, with its schema (FIELDS).

    .venv/bin/python -m tools.results add RUN REPORT.json ...   # append a gpu_bench report's rows under run RUN
    .venv/bin/python -m tools.results list                      # the runs: date, sha, device, triton, rows
    .venv/bin/python -m tools.results show --run RUN            # one run's rows as a table

A gpu_bench report (`bench/runs/<date>-<sha>.json`, or the copy the device tool brings back) gives a row per
benchmark row and metric (`ms`, the row's own metric such as GB/s, TFLOP/s or us/call, `err`, `pct_copy` and
`gpu_us` where it has them) and one per test count. `run` names the set of rows that belong together (one GPU
session's comparison, say), which the cards select by.
"""

import argparse
import json
import re
import sys
from pathlib import Path

from .common import REPO_ROOT
from .gpu_bench import fmt

TABLE = REPO_ROOT / "bench" / "results.jsonl"
FIELDS = ("run", "date", "sha", "device", "torch", "triton", "kernel", "case", "shape", "dtype", "impl", "metric",
          "value")
DTYPES = ("bfloat16", "float16", "float32", "bf16", "fp16", "fp32", "int16")


def _shape_and_dtype(case: str) -> tuple[str, str]:
    """The shape (the first bracketed or parenthesised run of numbers) and dtype named in a case label."""
    shape = re.search(r"[\[(][\d, ]+[\])]", case)
    dtype = next((d for d in DTYPES if re.search(rf"\b{d}\b", case)), "")
    return (shape.group(0) if shape else ""), dtype


# The case of a GPU test run's rows: every GPU test of the tested kernels
TESTS_CASE = "GPU tests"


def row(run: str, report: dict, kernel: str, case: str, impl: str, metric: str, value) -> dict:
    shape, dtype = _shape_and_dtype(case)
    return dict(run=run, date=report["date"][:10], sha=report["git_sha"][:7], device=report["device"],
                torch=report["torch"], triton=report["triton"], kernel=kernel, case=case, shape=shape, dtype=dtype,
                impl=impl, metric=metric, value=value)


def from_report(run: str, report: dict) -> list[dict]:
    """The rows of a gpu_bench report."""
    rows = []
    if "tests" in report and "tests" in report["tests"]:
        tests = report["tests"]
        # A run of the tests `-k` selected is not a run of every GPU test: its rows say which (the cards' platform
        # tables read the complete runs, case TESTS_CASE).
        case = TESTS_CASE + (f" -k {tests['selection']}" if tests.get("selection") else "")
        for metric in ("tests", "failures", "errors", "skipped"):
            rows.append(row(run, report, "all", case, "pytest -m gpu", metric, tests[metric]))
        for kernel in report.get("test_kernels", ()):  # each tested kernel's failures and errors
            failed = sum(f"kernels.{kernel}.tests." in name for name in tests["failed"])
            rows.append(row(run, report, kernel, case, "pytest -m gpu", "failed", failed))
    for kernel, result in report.get("benchmarks", {}).items():
        for bench_row in result["rows"]:
            if "ms" in bench_row:
                rows.append(row(run, report, kernel, bench_row["case"], bench_row["impl"], "ms", bench_row["ms"]))
            if "metric" in bench_row and "value" in bench_row:
                rows.append(row(run, report, kernel, bench_row["case"], bench_row["impl"], bench_row["metric"],
                                bench_row["value"]))
            # the max relative error against the spec; % of the copy rate; a latency row's GPU time a call
            for metric in ("err", "pct_copy", "gpu_us"):
                if isinstance(bench_row.get(metric), (int, float)):
                    rows.append(row(run, report, kernel, bench_row["case"], bench_row["impl"], metric,
                                    bench_row[metric]))
    return rows


def check(rows: list[dict]) -> None:
    for r in rows:
        if tuple(r) != FIELDS:
            raise ValueError(f"a results row must have the fields {FIELDS}, got {tuple(r)}")


def load(path: Path = TABLE) -> list[dict]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    check(rows)
    return rows


def append(rows: list[dict], path: Path = TABLE) -> None:
    check(rows)
    with path.open("a") as sink:
        for r in rows:
            sink.write(json.dumps(r) + "\n")


# What a run shares across its rows (printed once above its table, or as columns where they differ within it), and
# what `list` shows of each run.
RUN_FIELDS = ("date", "sha", "device", "torch", "triton")
LIST_FIELDS = ("run", "date", "sha", "device", "triton", "rows")


def runs(rows: list[dict]) -> dict[str, list[dict]]:
    """The rows of each run, runs in the order of their first row (the table's order)."""
    by_run = {}
    for r in rows:
        by_run.setdefault(r["run"], []).append(r)
    return by_run


def _values(rows: list[dict], field: str) -> str:
    return ", ".join(str(v) for v in dict.fromkeys(r[field] for r in rows))


def table(header: tuple[str, ...], lines: list[tuple]) -> str:
    """A plain-text table: the header, a rule, one line a row, columns padded to their widest cell."""
    cells = [tuple(header)] + [tuple("" if c is None else str(c) for c in line) for line in lines]
    widths = [max(len(line[i]) for line in cells) for i in range(len(header))]
    text = ["  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in cells]
    return "\n".join([text[0], "  ".join("-" * w for w in widths), *text[1:]])


def list_runs(rows: list[dict]) -> str:
    """One line a run: its date(s), sha(s), device(s), Triton release(s) and its number of rows."""
    lines = [(run, *(_values(of_run, f) for f in LIST_FIELDS[1:-1]), len(of_run)) for run, of_run in runs(rows).items()]
    return table(LIST_FIELDS, lines)


def show_run(rows: list[dict], run: str) -> str:
    """Run `run` as a table under a line of what its rows share; SystemExit naming how to list the runs where the
    table holds no such run."""
    by_run = runs(rows)
    if run not in by_run:
        raise SystemExit(f"no run {run!r} in {TABLE.relative_to(REPO_ROOT)}, which holds {len(by_run)} runs: "
                         "`python -m tools.results list` names them")
    of_run = by_run[run]
    shared = [f for f in RUN_FIELDS if len({r[f] for r in of_run}) == 1]
    columns = tuple(f for f in FIELDS if f != "run" and f not in shared)
    title = f"run {run}: " + ", ".join(f"{f} {of_run[0][f]}" for f in shared) + f"; {len(of_run)} rows"
    return title + "\n\n" + table(columns, [tuple(fmt(r[f]) for f in columns) for r in of_run])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.results", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    add = sub.add_parser("add", help="append gpu_bench reports' rows")
    add.add_argument("run")
    add.add_argument("reports", nargs="+", type=Path)
    sub.add_parser("list", help="the runs, with their date, sha, device, Triton release and number of rows")
    show = sub.add_parser("show", help="one run's rows as a table")
    show.add_argument("--run", required=True, help="the run's name, as `list` prints it")
    args = parser.parse_args(argv)
    if args.command == "add":
        for report in args.reports:
            rows = from_report(args.run, json.loads(report.read_text()))
            append(rows)
            print(f"{report}: {len(rows)} rows")
        return 0
    print(list_runs(load()) if args.command == "list" else show_run(load(), args.run))
    return 0


if __name__ == "__main__":
    sys.exit(main())
