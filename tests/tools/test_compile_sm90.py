"""`python -m tools.compile_sm90`: kernels compiled for sm_90a without a GPU, and the occupancy it reports."""

import os
import subprocess
import sys

import pytest

import testkit
from tools.common import REPO_ROOT, all_kernels
from tools.compile_sm90 import ctas_per_sm
from tools.gpu_bench import load_harness, load_kernel


def test_ctas_per_sm_limits():
    # Registers: 255 a thread of 4 warps fit twice in 64K (allocated per warp in units of 256), 168 three times.
    assert ctas_per_sm(255, 4, 30720) == 2
    assert ctas_per_sm(168, 4, 30720) == 3
    # Shared memory: 164 KiB a CTA fits once in 228 KiB; warps: 16-warp CTAs at most four.
    assert ctas_per_sm(64, 8, 164096) == 1
    assert ctas_per_sm(32, 16, 0) == 4


@pytest.mark.skipif(not testkit.has_spec("audio_mel_spectrogram_fused"), reason="the log-mel spec is absent")
def test_one_log_mel_case_compiles():
    """One shape and config of log-mel through the tool (its cases come from the spec's shapes): its main
    kernel's row carries registers and CTAs."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    case = "(208, 3000, 201, 128) 64x8x32 w4 s1 tf32x3 flat"
    out = subprocess.run([sys.executable, "-m", "tools.compile_sm90", "log-mel", "--match", case], cwd=REPO_ROOT,
                         env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in out.stdout.splitlines() if "| _stft_kernel |" in line]
    assert len(rows) == 1
    registers, ctas = int(rows[0][6]), int(rows[0][9])
    assert 0 < registers <= 255 and ctas >= 1


@pytest.mark.parametrize("name", [k.name for k in all_kernels()])
def test_every_harness_has_cases_to_compile(name):
    """tools.compile_sm90 compiles each harness's compile_cases (bench/<package>.py): labelled calls, none run
    here."""
    cases = list(load_harness(name).compile_cases(load_kernel(name), testkit.spec))
    assert cases and all(isinstance(label, str) and callable(call) for label, call in cases)
    assert len({label for label, _ in cases}) == len(cases)
