"""`kernels benchmark` runs each kernel's benchmarks/benchmark.py against a local build, on this machine's device,
and its verification passes (the CLI exits non-zero when a benchmark's output does not match its reference).
comba-bwd's calibration shape takes minutes on a 2-core CPU and is left to the GPU run."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tools.common import REPO_ROOT

pytest.importorskip("tabulate")  # kernels[benchmark]


@pytest.mark.parametrize("name", ["log-mel", "ldsa", "based-bwd"])
def test_kernels_benchmark_runs_and_verifies_on_a_local_build(name):
    cli = Path(sys.executable).parent / "kernels"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([str(cli), "benchmark", f"./kernels/{name}", "--iterations", "2", "--warmup", "1"],
                         cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    text = out.stdout + out.stderr
    assert "faster" in text or "slower" in text
