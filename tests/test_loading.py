"""Loading as model code does: `get_kernel` offline from the local Hub cache, version pinning with a v1
and a v2 side by side, `LOCAL_KERNELS`, and the lock-file flow."""

import json
import shutil
import subprocess
import sys
import textwrap

import pytest

from testkit import BACKEND, load
from tools import hub, lock
from tools.common import HUB_CACHE, KERNELS_DIR, REPO_ROOT, all_kernels, read_kernel

KERNELS = all_kernels()


def run_python(code: str, **env):
    import os

    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO_ROOT, capture_output=True,
                         text=True, env={**os.environ, **env})
    assert out.returncode == 0, out.stderr
    return out.stdout


@pytest.mark.kernels_ci
@pytest.mark.parametrize("kernel", KERNELS, ids=lambda k: k.name)
def test_get_kernel_offline_v1(kernel):
    module = load(kernel.name)
    assert module.__name__.startswith(f"_{kernel.package}_{BACKEND}_")
    assert "layers" in module.__all__ and all(hasattr(module, n) for n in module.__all__)
    ref = (HUB_CACHE / f"kernels--tessera--{kernel.name}" / "refs" / "v1").read_text().strip()
    assert f"snapshots/{ref}/build/torch-{BACKEND}" in module.__file__


@pytest.mark.parametrize("kernel", KERNELS, ids=lambda k: k.name)
def test_missing_version_is_an_error(kernel):
    from kernels import has_kernel

    with pytest.raises(ValueError, match="[Vv]ersion"):
        has_kernel(f"tessera/{kernel.name}", version=7)


def on_cuda_gpu(monkeypatch, capability):
    """Make torch report a CUDA build with one GPU of `capability`: what the loader's backend choice and arch
    check read."""
    import torch

    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)


@pytest.mark.parametrize("kernel", KERNELS, ids=lambda k: k.name)
def test_get_kernel_checks_the_gpu_arch(kernel, monkeypatch):
    """On a CUDA torch, `has_kernel` and `get_kernel` (arch check on by default) take the cached v1's
    torch-cuda variant on the GPUs its archs declare and refuse a Turing GPU; the torch-cpu variant loads there
    all the same."""
    from kernels import get_kernel, has_kernel

    repo = f"tessera/{kernel.name}"
    for capability in [(8, 0), (8, 6), (8, 9), (9, 0), (10, 0), (12, 0)]:
        on_cuda_gpu(monkeypatch, capability)
        assert has_kernel(repo, version=1, trust_remote_code=True), capability
    on_cuda_gpu(monkeypatch, (7, 5))
    assert not has_kernel(repo, version=1, trust_remote_code=True)
    assert has_kernel(repo, version=1, trust_remote_code=True, check_arch=False)
    with pytest.raises(RuntimeError, match="CUDA capability 7.5 of the current device is not supported"):
        get_kernel(repo, version=1, trust_remote_code=True)
    assert get_kernel(repo, version=1, trust_remote_code=True, backend="cpu").__name__.startswith(
        f"_{kernel.package}_cpu_")


@pytest.fixture(scope="module")
def two_versions(tmp_path_factory):
    """A Hub cache holding ldsa v1 (this tree) and a v2 whose code differs, built and laid by our tools."""
    root = tmp_path_factory.mktemp("versions")
    cache = root / "hub"
    v1 = read_kernel(KERNELS_DIR / "ldsa")
    hub.lay(v1, cache)
    src = root / "ldsa"
    shutil.copytree(KERNELS_DIR / "ldsa", src, ignore=shutil.ignore_patterns("build", "__pycache__"))
    toml = src / "build.toml"
    toml.write_text(toml.read_text().replace("version = 1", "version = 2"))
    init = src / "torch-ext" / "ldsa" / "__init__.py"
    init.write_text(init.read_text() + "\nAPI_REVISION = 2\n")
    out = subprocess.run([sys.executable, "-m", "tools.build", "--unique-id", "v2test", str(src)], cwd=REPO_ROOT,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    hub.lay(read_kernel(src), cache)
    return cache


def test_v1_and_v2_resolve_to_different_code_side_by_side(two_versions):
    out = run_python(
        """
        import json, torch
        from kernels import get_kernel
        v1 = get_kernel("tessera/ldsa", version=1, trust_remote_code=True)
        v2 = get_kernel("tessera/ldsa", version=2, trust_remote_code=True)
        a, v = torch.randn(1, 2, 5, 9), torch.randn(1, 2, 4, 9)
        same = torch.equal(v1.ldsa_local_attention(a, v, 2, 2), v2.ldsa_local_attention(a, v, 2, 2))
        print(json.dumps([v1.__name__, v2.__name__, hasattr(v1, "API_REVISION"), getattr(v2, "API_REVISION", 0), same]))
        """,
        HF_HUB_CACHE=str(two_versions), HF_HUB_OFFLINE="1",
    )
    name1, name2, v1_has_marker, v2_marker, same = json.loads(out.strip().splitlines()[-1])
    assert name1 != name2 and name2 == f"_ldsa_{BACKEND}_v2test"
    assert not v1_has_marker and v2_marker == 2
    assert same, "both versions run in one process, each on its own op namespace"


def test_refs_point_at_their_own_snapshots(two_versions):
    refs = two_versions / "kernels--tessera--ldsa" / "refs"
    assert {p.name for p in refs.iterdir()} == {"v1", "v2"}
    assert (refs / "v1").read_text() != (refs / "v2").read_text()


def test_local_kernels_override():
    out = run_python(
        """
        from kernels import get_kernel
        print(get_kernel("tessera/ldsa", version=1).__file__)
        """,
        LOCAL_KERNELS=f"tessera/ldsa={KERNELS_DIR / 'ldsa' / 'build'}", HF_HUB_OFFLINE="0",
        HF_HUB_CACHE=str(REPO_ROOT / "nonexistent-cache"),
    )
    assert f"kernels/ldsa/build/torch-{BACKEND}" in out


def test_lock_file_flow(tmp_path):
    from kernels._rust import KernelLocks

    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text('[tool.kernels.dependencies]\n"tessera/ldsa" = 1\n"tessera/log-mel" = 1\n')
    text = lock.lock(pyproject, HUB_CACHE)
    (tmp_path / "kernels.lock").write_text(text)
    entries = json.loads(text)
    assert [e["dependency"]["repo-id"] for e in entries] == ["tessera/ldsa", "tessera/log-mel"]
    assert len(KernelLocks.from_json(text).keys()) == 2
    out = run_python(
        f"""
        from pathlib import Path
        from kernels import load_kernel
        print(load_kernel("tessera/ldsa", lockfile=Path({str(tmp_path / 'kernels.lock')!r})).__file__)
        """
    )
    assert f"snapshots/{entries[0]['lock']['commit']}/" in out


def test_lock_refuses_unknown_version(tmp_path):
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text('[tool.kernels.dependencies]\n"tessera/ldsa" = 9\n')
    with pytest.raises(SystemExit, match="version 9 is not in the Hub cache"):
        lock.lock(pyproject, HUB_CACHE)
