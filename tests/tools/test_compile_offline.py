"""`python -m tools.compile_offline`: kernels compiled for each GPU architecture without a GPU, and the occupancy it
reports."""

import importlib
import os
import subprocess
import sys

import pytest

import testkit
from tools.common import REPO_ROOT, all_kernels
from tools.compile_offline import ARCHS, ctas_per_sm, spills_by_design
from tools.gpu_bench import load_harness, load_kernel


def compile_offline(*args: str) -> str:
    """The tool's stdout for `args`, on the kernels as `make hub` laid them (--no-build), asserting it exits 0."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-m", "tools.compile_offline", "--no-build", *args], cwd=REPO_ROOT, env=env,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout


def table_rows(text: str) -> list[list[str]]:
    """The cells of the report table's rows in `text`, its header excepted."""
    return [[c.strip() for c in line.split("|")[1:-1]] for line in text.splitlines()
            if line.startswith("| ") and not line.startswith("| case ")]


def test_ctas_per_sm_limits():
    # Registers: 255 a thread of 4 warps fit twice in 64K (allocated per warp in units of 256), 168 three times.
    assert ctas_per_sm(255, 4, 30720) == 2
    assert ctas_per_sm(168, 4, 30720) == 3
    # Shared memory: 164 KiB a CTA fits once in 228 KiB; warps: 16-warp CTAs at most four.
    assert ctas_per_sm(64, 8, 164096) == 1
    assert ctas_per_sm(32, 16, 0) == 4


def test_ctas_per_sm_by_arch():
    sm80, sm89, sm120 = ARCHS["sm_80"], ARCHS["sm_89"], ARCHS["sm_120a"]
    # 48 KiB and the driver's 1 KiB: three CTAs in sm_80's 164 KiB, two in the 100 KiB of sm_89 and sm_120.
    assert ctas_per_sm(64, 4, 48 * 1024, sm80) == 3
    assert ctas_per_sm(64, 4, 48 * 1024, sm89) == ctas_per_sm(64, 4, 48 * 1024, sm120) == 2
    # The opt-in maximum a CTA may use: 99 KiB launches on sm_89, 100 KiB never does; 163 KiB on sm_80, not 164.
    assert ctas_per_sm(64, 4, 99 * 1024, sm89) == 1 and ctas_per_sm(64, 4, 100 * 1024, sm89) == 0
    assert ctas_per_sm(64, 4, 163 * 1024, sm80) == 1 and ctas_per_sm(64, 4, 164 * 1024, sm80) == 0
    # Ada and consumer Blackwell hold 48 warps and 24 CTAs an SM; A100 64 and 32.
    assert ctas_per_sm(32, 16, 0, sm89) == 3 and ctas_per_sm(32, 16, 0, sm80) == 4
    assert ctas_per_sm(16, 1, 0, sm120) == 24 and ctas_per_sm(16, 1, 0, sm80) == 32


@pytest.mark.skipif(not testkit.has_spec("audio_mel_spectrogram_fused"), reason="the log-mel spec is absent")
def test_spills_by_design_by_kernel_and_by_case():
    """An entry keyed by a kernel's name bounds its spills at every case; one keyed by (name, label text) only at
    the cases whose label holds the text; the largest entry that covers a case counts."""
    by_design = {"_scan": 240, ("_scan", ", 256, "): 2048, ("_other", "packed"): 64}
    assert spills_by_design({"kernel": "_scan", "case": "(4, 2048, 8, 128, 128)"}, by_design) == 240
    assert spills_by_design({"kernel": "_scan", "case": "(4, 2048, 8, 256, 128)"}, by_design) == 2048
    assert spills_by_design({"kernel": "_other", "case": "(4, 2048, 8, 256, 128)"}, by_design) == 0
    assert spills_by_design({"kernel": "_other", "case": "model (packed)"}, by_design) == 64
    assert spills_by_design({"kernel": "_grads", "case": "model (packed)"}, by_design) == 0


def test_one_log_mel_case_compiles():
    """One shape and config of log-mel through the tool (its cases come from the spec's shapes): its main
    kernel's row carries registers and CTAs."""
    out = compile_offline("log-mel", "--match", "(208, 3000, 201, 128) 64x8x32 w4 s1 tf32x3")
    rows = [row for row in table_rows(out) if row[1] == "_stft_kernel"]
    assert len(rows) == 1
    registers, ctas = int(rows[0][6]), int(rows[0][9])
    assert 0 < registers <= 255 and ctas >= 1


@pytest.mark.parametrize("name", [k.name for k in all_kernels()])
def test_every_harness_has_cases_to_compile(name):
    """tools.compile_offline compiles each harness's compile_cases (bench/<package>.py): labelled calls, none run
    here."""
    cases = list(load_harness(name).compile_cases(load_kernel(name), testkit.spec))
    assert cases and all(isinstance(label, str) and callable(call) for label, call in cases)
    assert len({label for label, _ in cases}) == len(cases)


def test_other_archs_launch_the_portable_kernels_only():
    """The cases of every package, listed for sm_80 and sm_90a (`--list`: nothing compiled): off Hopper, where no
    FAST_PATHS row claims the GPU, no kernel of a `hopper/` module launches and every package still launches
    kernels; on sm_90a the fast paths that compile under this Triton launch theirs."""
    out = compile_offline("--list", "--arch", "sm_80", "--arch", "sm_90a")
    sections = dict(section.split("\n", 1) for section in out.split("## ")[1:])
    rows = {arch: table_rows(text) for arch, text in sections.items()}
    assert {row[0].split()[0] for row in rows["sm_80"]} == {k.name for k in all_kernels()}
    assert not [row for row in rows["sm_80"] if ".hopper." in row[-1]]
    ldsa = load_kernel("ldsa")
    if importlib.import_module(f"{ldsa.__name__}.dispatch").FAST_PATHS.compiles("band-tma forward"):
        assert "_band_forward_tma_kernel" in {row[1] for row in rows["sm_90a"] if ".hopper." in row[-1]}


def test_each_kernel_once_lists_every_kernel_of_the_configurations_once():
    """`--each-kernel-once` (CI's cheaper cells) lists each kernel of comba-bwd's sm_80 cases once, and the same
    kernels as the listing of every configuration."""
    def listed(*flags):
        out = compile_offline("--list", "--arch", "sm_80", "comba-bwd", *flags)
        return [(row[-1], row[1]) for row in table_rows(out)]

    once, configurations = listed("--each-kernel-once"), listed()
    assert len(once) == len(set(once)) < len(configurations)
    assert set(once) == set(configurations)
