"""common/fast_paths.py: where a fast path runs, and its switch-off after a failed first launch."""

import importlib
import sys
import types
import warnings

import pytest
import torch

from tools.common import REPO_ROOT


@pytest.fixture
def fast_paths():
    """common/fast_paths.py, loaded fresh inside a bare package of common/ (it imports its sibling devices.py)."""
    package = types.ModuleType("tessera_common")
    package.__path__ = [str(REPO_ROOT / "common")]
    sys.modules["tessera_common"] = package
    try:
        yield importlib.import_module("tessera_common.fast_paths")
    finally:
        for name in [m for m in sys.modules if m == "tessera_common" or m.startswith("tessera_common.")]:
            del sys.modules[name]


def on_gpu(fast_paths, monkeypatch, capability):
    """Make CUDA devices report `capability` to the table."""
    devices = sys.modules["tessera_common.devices"]
    monkeypatch.setattr(fast_paths, "gpu", lambda device: devices.Gpu(capability, 227 * 1024))


def table(fast_paths):
    return fast_paths.FastPaths("pkg", (
        fast_paths.FastPath("gluon", "a Hopper kernel", ((9, 0),), verified=("3.6", "3.7"), compiles=("3.6", "3.7", "3.9")),
    ))


def test_verified_needs_both_the_gpu_and_the_triton_release(fast_paths):
    paths = table(fast_paths)
    assert paths.verified("gluon", (9, 0), "3.6") and paths.verified("gluon", (9, 0), "3.7")
    assert not paths.verified("gluon", (9, 0), "3.9")  # compiles there, not verified
    assert not paths.verified("gluon", (10, 0), "3.6") and not paths.verified("gluon", (8, 0), "3.6")
    assert not paths.verified("gluon", (9, 0), "2.3")


def test_try_unverified_runs_every_release_the_path_compiles_under(fast_paths, monkeypatch):
    monkeypatch.setattr(fast_paths, "TRY_UNVERIFIED", True)
    paths = table(fast_paths)
    assert paths.verified("gluon", (9, 0), "3.9") and not paths.verified("gluon", (9, 0), "3.8")
    assert not paths.verified("gluon", (12, 0), "3.9")


def test_meta_tensors_take_the_paths_that_compile_and_cpu_tensors_none(fast_paths, monkeypatch):
    paths = table(fast_paths)
    monkeypatch.setattr(fast_paths, "TRITON_RELEASE", "3.9")
    assert paths.runs("gluon", torch.device("meta"))
    monkeypatch.setattr(fast_paths, "TRITON_RELEASE", "3.8")
    assert not paths.runs("gluon", torch.device("meta"))
    assert not paths.runs("gluon", torch.device("cpu"))


def test_meta_tensors_take_the_paths_of_the_gpu_they_stand_for(fast_paths, monkeypatch):
    """An offline compile for another architecture points meta tensors at its GPU (`devices.meta_gpu`): a path runs
    on them only where its row claims that GPU's capability."""
    paths, devices = table(fast_paths), sys.modules["tessera_common.devices"]
    monkeypatch.setattr(fast_paths, "TRITON_RELEASE", "3.6")
    assert devices.meta_gpu.capability == (9, 0) and paths.runs("gluon", torch.device("meta"))
    for capability in ((8, 0), (8, 9), (10, 0), (12, 0)):
        monkeypatch.setattr(devices, "meta_gpu", devices.Gpu(capability, 99 * 1024))
        assert not paths.runs("gluon", torch.device("meta")), capability


def test_cuda_devices_are_checked_against_the_table(fast_paths, monkeypatch):
    paths = table(fast_paths)
    monkeypatch.setattr(fast_paths, "TRITON_RELEASE", "3.6")
    for capability, runs in (((9, 0), True), ((8, 0), False), ((10, 0), False), ((12, 0), False)):
        on_gpu(fast_paths, monkeypatch, capability)
        assert paths.runs("gluon", torch.device("cuda", 0)) == runs


def test_compiles_for_takes_the_gpu_and_the_releases_it_compiles_under_verified_or_not(fast_paths, monkeypatch):
    paths = table(fast_paths)
    monkeypatch.setattr(fast_paths, "TRITON_RELEASE", "3.9")  # compiles there, not verified
    for capability, takes in (((9, 0), True), ((8, 0), False), ((10, 0), False)):
        on_gpu(fast_paths, monkeypatch, capability)
        assert paths.compiles_for("gluon", torch.device("cuda", 0)) == takes
    monkeypatch.setattr(fast_paths, "TRITON_RELEASE", "3.8")
    assert not paths.compiles_for("gluon", torch.device("cuda", 0))
    assert not paths.compiles_for("gluon", torch.device("cpu"))


def test_a_failure_switches_the_path_off_with_one_warning(fast_paths, monkeypatch):
    paths = table(fast_paths)
    monkeypatch.setattr(fast_paths, "TRITON_RELEASE", "3.6")
    on_gpu(fast_paths, monkeypatch, (9, 0))
    with pytest.warns(fast_paths.FastPathFallback, match=r"pkg: the gluon path failed to compile under Triton 3\.6 "
                                                         r"\(RuntimeError: boom\)"):
        paths.failed("gluon", RuntimeError("boom"))
    assert not paths.runs("gluon", torch.device("cuda", 0)) and not paths.runs("gluon", torch.device("meta"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        paths.failed("gluon", RuntimeError("again"))  # remembered: no second warning
    assert "boom" in paths.switched_off["gluon"]


def test_out_of_memory_does_not_switch_a_path_off(fast_paths):
    assert fast_paths.falls_back(RuntimeError("PassManager::run failed"))
    assert not fast_paths.falls_back(torch.OutOfMemoryError("CUDA out of memory"))


def test_the_card_table_names_every_path_with_its_gpus_and_releases(fast_paths):
    text = table(fast_paths).markdown()
    assert "| `gluon` | a Hopper kernel | 9.0 | 3.6, 3.7 | 3.6, 3.7, 3.9 |" in text
