"""`python -m tools.lint`: the house rules beyond the build's checks, each catching what it names, and the repo
following them."""

import subprocess
import sys

from tools import lint
from tools.common import REPO_ROOT, all_kernels


def test_shipped_code_carries_no_run_history(tmp_path, monkeypatch):
    """Lines naming a results file, a probe, a sha, a timing or a branch are flagged, a budget is not; the
    packages and their Hub benchmarks carry none."""
    monkeypatch.setattr(lint, "REPO_ROOT", tmp_path)
    sample = tmp_path / "kernel.py"
    sample.write_text("\n".join([
        "# 0.25 ms against 0.31 (bench/results/2026-11-30-abc1234-ldsa.md)",
        "# see the probe log",
        "# measured at 3.4 TB/s",
        "# branch tried/comba-transform",
        "# one warpgroup a CTA, 115 KB of shared memory, 2^18 frames",  # a budget, not a run figure
        "x = 0x7f",
        "y = torch.log(x)",
    ]))
    assert [v.split(": ")[1].removesuffix(" in shipped code") for v in lint.history_violations(sample)] == [
        "a results file or probe", "a results file or probe", "a timing or throughput", "a branch"]
    monkeypatch.setattr(lint, "REPO_ROOT", REPO_ROOT)
    for kernel in all_kernels():
        files = lint.shipped_files(kernel)
        assert kernel.path / "benchmarks" / "benchmark.py" in files
        assert [v for f in files for v in lint.history_violations(f)] == [], kernel.name


def test_tools_and_the_harness_import_no_test_helper(tmp_path, monkeypatch):
    monkeypatch.setattr(lint, "REPO_ROOT", tmp_path)
    sample = tmp_path / "tool.py"
    sample.write_text("import os\nimport testkit\nfrom tests.helpers import x\nfrom .specs import rel_err\n")
    assert [v.split(": ", 1)[0] for v in lint.test_import_violations(sample)] == ["tool.py:2", "tool.py:3"]


def test_two_test_modules_of_one_name_are_flagged(tmp_path, monkeypatch):
    monkeypatch.setattr(lint, "REPO_ROOT", tmp_path)
    for folder, name in (("kernels/a/tests", "test_same.py"), ("kernels/b/tests", "test_same.py"),
                         ("kernels/b/tests", "test_other.py"), ("tests", "test_top.py")):
        (tmp_path / folder).mkdir(parents=True, exist_ok=True)
        (tmp_path / folder / name).write_text("")
    assert [v.split(": ", 1)[0] for v in lint.test_name_violations()] == ["kernels/b/tests/test_same.py"]


def test_the_repo_passes_the_lint():
    out = subprocess.run([sys.executable, "-m", "tools.lint"], cwd=REPO_ROOT, capture_output=True, text=True)
    assert out.returncode == 0 and "lint: 0 violations" in out.stdout, out.stdout + out.stderr
