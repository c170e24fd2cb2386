"""bench/results.jsonl, the one results table: its schema, and the rows a gpu_bench report gives."""

import subprocess
import sys

import pytest

from tools import results
from tools.common import REPO_ROOT

REPORT = {
    "date": "2026-12-02T00:06:04+00:00", "git_sha": "47b7fe4abc", "device": "NVIDIA H200", "torch": "2.11.0",
    "triton": "3.8.0", "test_kernels": ["ldsa", "comba-bwd"],
    "tests": {"tests": 3, "failures": 1, "errors": 0, "skipped": 0,
              "failed": ["kernels.ldsa.tests.test_ldsa::test_a[1]"]},
    "benchmarks": {"ldsa": {"rows": [{"case": "fwd [B,T]=[64,3000] H=8 bfloat16", "impl": "ldsa triton", "ms": 0.137,
                                      "metric": "GB/s", "value": 3200.0}]}},
}


def test_the_committed_table_follows_the_schema():
    rows = results.load()
    assert rows and all(tuple(r) == results.FIELDS for r in rows)


def test_a_report_gives_a_row_per_figure():
    rows = results.from_report("run-x", REPORT)
    assert all(tuple(r) == results.FIELDS and r["run"] == "run-x" and r["sha"] == "47b7fe4" for r in rows)
    failed = {r["kernel"]: r["value"] for r in rows if r["metric"] == "failed"}
    assert failed == {"ldsa": 1, "comba-bwd": 0}
    bench = [r for r in rows if r["kernel"] == "ldsa" and r["case"].startswith("fwd")]
    assert {(r["metric"], r["value"]) for r in bench} == {("ms", 0.137), ("GB/s", 3200.0)}
    assert {(r["shape"], r["dtype"]) for r in bench} == {("[64,3000]", "bfloat16")}


def test_a_selected_test_run_is_labelled_as_a_part():
    """A run of the tests `gpu_bench --tests EXPR` selected gives rows whose case names the selection, so that no
    table reads it as a run of every GPU test."""
    part = dict(REPORT, tests=dict(REPORT["tests"], selection="gluon"))
    cases = {r["case"] for r in results.from_report("run-x", part) if r["metric"] in ("tests", "failed")}
    assert cases == {"GPU tests -k gluon"}
    assert {r["case"] for r in results.from_report("run-x", REPORT) if r["metric"] == "failed"} == {"GPU tests"}


def test_rows_of_another_shape_are_refused(tmp_path):
    with pytest.raises(ValueError, match="fields"):
        results.append([{"run": "x", "value": 1}], tmp_path / "t.jsonl")


def test_list_gives_each_run_once_with_its_rows(tmp_path):
    rows = results.from_report("run-a", REPORT) + results.from_report("run-b", dict(REPORT, triton="3.9.0"))
    lines = results.list_runs(rows).splitlines()
    assert lines[0].split() == list(results.LIST_FIELDS)
    per_run = len(results.from_report("run-a", REPORT))
    assert [line.split()[0] for line in lines[2:]] == ["run-a", "run-b"]
    assert [line.split()[-1] for line in lines[2:]] == [str(per_run)] * 2
    assert "3.8.0" in lines[2] and "3.9.0" in lines[3]


def test_show_prints_one_run_under_a_header():
    rows = results.from_report("run-a", REPORT) + results.from_report("run-b", dict(REPORT, git_sha="1234567abc"))
    text = results.show_run(rows, "run-b")
    title, _, header, rule, *body = text.splitlines()
    assert title.startswith("run run-b: ") and "sha 1234567" in title and "47b7fe4" not in text
    assert header.split() == ["kernel", "case", "shape", "dtype", "impl", "metric", "value"]
    assert set(rule) == {"-", " "} and len(body) == len(results.from_report("run-b", REPORT))
    assert any(line.split()[0] == "ldsa" and line.split()[-2:] == ["GB/s", "3200"] for line in body)


def test_show_refuses_an_unknown_run():
    rows = results.from_report("run-a", REPORT)
    with pytest.raises(SystemExit, match=r"no run 'run-z'.* 1 runs: `python -m tools.results list`"):
        results.show_run(rows, "run-z")
    out = subprocess.run([sys.executable, "-m", "tools.results", "show", "--run", "no such run"], cwd=REPO_ROOT,
                         capture_output=True, text=True)
    assert out.returncode != 0 and "tools.results list" in out.stderr
