"""bench/results.jsonl, the one results table: its schema, and the rows a gpu_bench report gives."""

import pytest

from tools import results

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


def test_rows_of_another_shape_are_refused(tmp_path):
    with pytest.raises(ValueError, match="fields"):
        results.append([{"run": "x", "value": 1}], tmp_path / "t.jsonl")
