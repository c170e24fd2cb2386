"""`kernels benchmark` runs each kernel's benchmarks/benchmark.py against a local build, on this machine's device,
and its verification passes (the CLI exits non-zero when a benchmark's output does not match its reference).
comba-bwd's calibration shape takes minutes on a 2-core CPU and is left to the GPU run."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tools.common import HUB_CACHE, HUB_ORG, REPO_ROOT

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


def test_kernels_benchmark_runs_from_the_laid_hub_cache():
    """`kernels benchmark <org>/<name>@v1` offline: the snapshot `make hub` lays carries `benchmarks/` as the
    version branch does (what `make bench-cpu` runs)."""
    cli = Path(sys.executable).parent / "kernels"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(HUB_CACHE))
    out = subprocess.run([str(cli), "benchmark", f"{HUB_ORG}/ldsa@v1", "--iterations", "2", "--warmup", "1"],
                         cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    text = out.stdout + out.stderr
    assert f"{HUB_ORG}/ldsa@v1" in text and "LDSAForward" in text and "faster" in text
