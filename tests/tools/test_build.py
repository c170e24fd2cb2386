"""The noarch build reproduces kernel-builder's output, and its checks catch what the Nix hooks catch."""

import json
import shutil
import subprocess
import sys

import pytest

from tools import build
from tools.common import KERNELS_DIR, REPO_ROOT, all_kernels

KERNELS = all_kernels()


def test_all_four_kernels_present():
    assert {k.name for k in KERNELS} == {"ldsa", "log-mel", "based-bwd", "comba-bwd"}


@pytest.mark.kernels_ci
@pytest.mark.parametrize("kernel", KERNELS, ids=lambda k: k.name)
def test_build_output_layout_and_metadata(kernel):
    from kernels._rust import Build, Digest, DigestAlgorithm, Metadata

    Build.open(str(kernel.path))
    assert build.NAME_RULE.match(kernel.name)
    for backend in ("cuda", "cpu"):
        variant = kernel.build_dir / f"torch-{backend}"
        assert {p.name for p in kernel.source.glob("*.py")} <= {p.name for p in variant.glob("*.py")}
        raw = json.loads((variant / "metadata.json").read_text())
        metadata = Metadata.read_from_file(str(variant / "metadata.json"))
        assert raw["backend"]["type"] == backend and raw["version"] == kernel.version
        assert metadata.id == raw["id"] and raw["id"].startswith(f"_{kernel.package}_{backend}_")
        assert f'"{raw["id"]}"' in (variant / "_ops.py").read_text()
        metadata.digest.validate(Digest.hash_variant(DigestAlgorithm.SHA256, str(variant)))


# The GPUs the portable Triton path runs on, as (major, minor) capabilities: Ampere (A100, A10/RTX 30, Orin),
# Ada, Hopper, Blackwell (B200, B300, Thor on CUDA 12), Blackwell RTX and GB10. The loader's check must take
# each against the CUDA variant's archs, and refuse Volta, Turing and Thor on CUDA 13 (sm_110, which triton
# 3.6's ptxas cannot target).
ACCEPTED_CAPABILITIES = [(8, 0), (8, 6), (8, 7), (8, 9), (9, 0), (10, 0), (10, 1), (10, 3), (12, 0), (12, 1)]
REFUSED_CAPABILITIES = [(7, 0), (7, 5), (11, 0)]


def on_cuda_gpu(monkeypatch, capability):
    """Make torch report a CUDA build with one GPU of `capability`: what the loader's arch check reads."""
    import torch

    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)


@pytest.mark.parametrize("kernel", KERNELS, ids=lambda k: k.name)
def test_cuda_archs_pass_the_loaders_arch_check(kernel, monkeypatch):
    """The CUDA variant's metadata.json carries build.toml's cuda_capabilities as its archs, and the check
    `get_kernel` runs on it (`kernels.validate.ArchValidator`) accepts every GPU the Triton path runs on
    and refuses older ones; the CPU variant carries no archs and is checked against no GPU."""
    import tomllib

    from kernels._rust import Metadata
    from kernels.validate import ArchValidator

    declared = tomllib.loads((kernel.path / "build.toml").read_text())["torch-noarch"]["cuda_capabilities"]
    cuda = Metadata.read_from_file(str(kernel.build_dir / "torch-cuda" / "metadata.json"))
    cpu = Metadata.read_from_file(str(kernel.build_dir / "torch-cpu" / "metadata.json"))
    assert cuda.backend.archs == declared
    assert cpu.backend.archs is None
    for capability in ACCEPTED_CAPABILITIES + REFUSED_CAPABILITIES:
        on_cuda_gpu(monkeypatch, capability)
        ArchValidator().validate_metadata(metadata=cpu, variant="torch-cpu")
        if capability in ACCEPTED_CAPABILITIES:
            ArchValidator().validate_metadata(metadata=cuda, variant="torch-cuda")
        else:
            with pytest.raises(RuntimeError, match=f"CUDA capability {capability[0]}.{capability[1]} "):
                ArchValidator().validate_metadata(metadata=cuda, variant="torch-cuda")


@pytest.fixture
def scratch(tmp_path):
    """A private copy of the ldsa kernel repo, to break on purpose."""
    dst = tmp_path / "ldsa"
    shutil.copytree(KERNELS_DIR / "ldsa", dst, ignore=shutil.ignore_patterns("build", "__pycache__"))
    return dst


def run_build(path):
    return subprocess.run([sys.executable, "-m", "tools.build", "--unique-id", "t3st", str(path)],
                          cwd=REPO_ROOT, capture_output=True, text=True)


def test_scratch_copy_builds(scratch):
    out = run_build(scratch)
    assert out.returncode == 0, out.stderr
    assert json.loads((scratch / "build/torch-cpu/metadata.json").read_text())["id"] == "_ldsa_cpu_t3st"


BREAKAGES = [
    ("op.py", 'add_op_namespace_prefix("ldsa_forward"), mutates_args', '"mylib::ldsa_forward", mutates_args',
     "custom_op without add_op_namespace_prefix"),
    ("op.py", "from .reference import", "from reference import", "import of own module 'reference' must be relative"),
    ("layers.py", "import torch\n", "import torch\nimport numpy\n", "only stdlib, torch and triton"),
    ("__init__.py", '"""\n', '"""\nimport triton\n', "does not import without triton"),
]


@pytest.mark.parametrize("file,old,new,message", BREAKAGES, ids=[b[3][:30] for b in BREAKAGES])
def test_build_rejects(scratch, file, old, new, message):
    path = scratch / "torch-ext" / "ldsa" / file
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new, 1))
    out = run_build(scratch)
    assert out.returncode != 0 and message in out.stderr, out.stderr


def test_build_rejects_bad_name(scratch):
    toml = scratch / "build.toml"
    toml.write_text(toml.read_text().replace('name = "ldsa"', 'name = "ld_sa"'))
    out = run_build(scratch)
    assert out.returncode != 0 and "ld_sa" in out.stderr


@pytest.mark.parametrize("capabilities", ['["sm_80"]', "[]"])
def test_build_rejects_capabilities_the_arch_check_cannot_parse(scratch, capabilities):
    """The loader skips its arch check when no declared arch parses, so the build refuses such a list."""
    toml = scratch / "build.toml"
    text = toml.read_text()
    line = next(line for line in text.splitlines() if line.startswith("cuda_capabilities"))
    toml.write_text(text.replace(line, f"cuda_capabilities = {capabilities}"))
    out = run_build(scratch)
    assert out.returncode != 0 and "cuda_capabilities" in out.stderr, out.stderr


def test_build_rejects_committed_ops_file(scratch):
    (scratch / "torch-ext" / "ldsa" / "_ops.py").write_text("")
    out = run_build(scratch)
    assert out.returncode != 0 and "generated by the build" in out.stderr


def test_build_rejects_stray_files(scratch):
    (scratch / "torch-ext" / "ldsa" / "op.py.orig").write_text("")
    out = run_build(scratch)
    assert out.returncode != 0 and "op.py.orig" in out.stderr and "would ship" in out.stderr, out.stderr


def test_build_rejects_a_module_named_after_a_third_party(scratch):
    """A subpackage named `triton/` would shadow the library for its readers: modules are named for what they hold."""
    (scratch / "torch-ext" / "ldsa" / "portable").rename(scratch / "torch-ext" / "ldsa" / "triton")
    out = run_build(scratch)
    assert out.returncode != 0 and "named after the third-party package 'triton'" in out.stderr, out.stderr
