"""The one results table, `bench/results.jsonl`: a row per measured figure, with its schema (FIELDS).

    .venv/bin/python -m tools.results add RUN REPORT.json ...   # append a gpu_bench report's rows under run RUN
    .venv/bin/python -m tools.results show [--run RUN]           # print the rows as a table

A gpu_bench report (`bench/runs/<date>-<sha>.json`, or the copy the device tool brings back) gives a row per
benchmark row and metric (`ms`, the row's own metric such as GB/s or TFLOP/s, `err` and `pct_copy` where it has them)
and one per test count. `run`
names the set of rows that belong together (one GPU session's comparison, say), which the cards select by.
"""

import argparse
import json
import re
import sys
from pathlib import Path

from .common import REPO_ROOT

TABLE = REPO_ROOT / "bench" / "results.jsonl"
FIELDS = ("run", "date", "sha", "device", "torch", "triton", "kernel", "case", "shape", "dtype", "impl", "metric",
          "value")
DTYPES = ("bfloat16", "float16", "float32", "bf16", "fp16", "fp32", "int16")


def _shape_and_dtype(case: str) -> tuple[str, str]:
    """The shape (the first bracketed or parenthesised run of numbers) and dtype named in a case label."""
    shape = re.search(r"[\[(][\d, ]+[\])]", case)
    dtype = next((d for d in DTYPES if re.search(rf"\b{d}\b", case)), "")
    return (shape.group(0) if shape else ""), dtype


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
        for metric in ("tests", "failures", "errors", "skipped"):
            rows.append(row(run, report, "all", "GPU tests", "pytest -m gpu", metric, tests[metric]))
        for kernel in report.get("test_kernels", ()):  # each tested kernel's failures and errors
            failed = sum(f"kernels.{kernel}.tests." in name for name in tests["failed"])
            rows.append(row(run, report, kernel, "GPU tests", "pytest -m gpu", "failed", failed))
    for kernel, result in report.get("benchmarks", {}).items():
        for bench_row in result["rows"]:
            if "ms" in bench_row:
                rows.append(row(run, report, kernel, bench_row["case"], bench_row["impl"], "ms", bench_row["ms"]))
            if "metric" in bench_row and "value" in bench_row:
                rows.append(row(run, report, kernel, bench_row["case"], bench_row["impl"], bench_row["metric"],
                                bench_row["value"]))
            for metric in ("err", "pct_copy"):  # the max relative error against the spec; % of the copy rate
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.results", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    add = sub.add_parser("add", help="append gpu_bench reports' rows")
    add.add_argument("run")
    add.add_argument("reports", nargs="+", type=Path)
    show = sub.add_parser("show", help="print the rows")
    show.add_argument("--run")
    args = parser.parse_args(argv)
    if args.command == "add":
        for report in args.reports:
            rows = from_report(args.run, json.loads(report.read_text()))
            append(rows)
            print(f"{report}: {len(rows)} rows")
        return 0
    for r in load():
        if args.run is None or r["run"] == args.run:
            print(" | ".join(str(r[f]) for f in FIELDS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
