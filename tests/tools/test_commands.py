"""Every tool is a command with --help."""

import subprocess
import sys

import pytest

from tools.common import REPO_ROOT

TOOLS = ("build", "lint", "hub", "lock", "publish", "demo", "gpu_bench", "gpu_profile", "compile_offline", "results",
         "vendor", "cards", "host_time")


@pytest.mark.parametrize("tool", TOOLS)
def test_tool_has_help(tool):
    out = subprocess.run([sys.executable, "-m", f"tools.{tool}", "--help"], cwd=REPO_ROOT, capture_output=True,
                         text=True)
    assert out.returncode == 0 and "usage:" in out.stdout, (tool, out.stderr)
