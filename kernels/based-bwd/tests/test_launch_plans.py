"""Which launch plan a call takes (`dispatch.forward_config`, `dispatch.backward_config`): the K = 16 plans measured
under Triton 3.6 (pipelined scans, the forward in chunks of 128) only under the releases of TUNED_TRITONS, and the
chunk-128 forward only on GPUs whose CTAs may use the shared memory its output kernel holds; everywhere else the
untuned plans. Meta tensors stand for the GPU of `common.devices.meta_gpu`, as in the offline compiles."""

import pytest
import torch

from testkit import submodule
from tools.compile_offline import ARCHS, stand_for

META = torch.device("meta")


@pytest.fixture
def on(based, dispatch, monkeypatch):
    """on(release, arch): the dispatch under Triton `release`, meta tensors standing for a GPU of `arch` (a name of
    `tools.compile_offline.ARCHS`, whose CTA shared memory it takes), as in the offline compiles."""
    devices = submodule(based, "common.devices")
    monkeypatch.setattr(devices, "meta_gpu", devices.meta_gpu)  # restored after the test

    def under(release, arch):
        monkeypatch.setattr(dispatch, "TRITON_RELEASE", release)
        stand_for(based, ARCHS[arch])

    return under


def test_the_tuned_plans_run_under_the_releases_they_were_measured_on(dispatch, on):
    for release in dispatch.TUNED_TRITONS:
        on(release, "sm_90a")
        assert dispatch.forward_config(16, META) == dispatch.DEFAULT_FORWARD_CONFIG[16]
        assert dispatch.forward_config(16, META).chunk == 128
        assert dispatch.backward_config(16) == dispatch.DEFAULT_BACKWARD_CONFIG[16]
        assert dispatch.backward_config(16).scan_stages == 2


@pytest.mark.parametrize("release", ["3.7", "3.8", "3.9", None])
def test_other_releases_take_the_untuned_plans(dispatch, on, release):
    on(release, "sm_90a")
    assert dispatch.forward_config(16, META) == dispatch.UNTUNED_FORWARD_CONFIG
    assert dispatch.backward_config(16) == dispatch.UNTUNED_BACKWARD_CONFIG
    assert dispatch.UNTUNED_FORWARD_CONFIG.scan_stages == dispatch.UNTUNED_BACKWARD_CONFIG.scan_stages == 1


@pytest.mark.parametrize("arch", ["sm_80", "sm_89", "sm_120a"])
def test_gpus_short_of_shared_memory_take_the_chunk_64_forward(dispatch, on, arch):
    on(dispatch.TUNED_TRITONS[0], arch)
    assert ARCHS[arch].shared_per_cta < dispatch.CHUNK_128_SHARED
    assert dispatch.forward_config(16, META) == dispatch.UNTUNED_FORWARD_CONFIG
    assert dispatch.forward_config(16, META).chunk == 64
    assert dispatch.backward_config(16) == dispatch.DEFAULT_BACKWARD_CONFIG[16]  # its scans fit every GPU


def test_the_k8_plans_are_the_same_everywhere(dispatch, on):
    for release, arch in ((dispatch.TUNED_TRITONS[0], "sm_90a"), ("3.9", "sm_89")):
        on(release, arch)
        assert dispatch.forward_config(8, META) == dispatch.DEFAULT_FORWARD_CONFIG[8]
        assert dispatch.backward_config(8) == dispatch.DEFAULT_BACKWARD_CONFIG[8]


def test_cpu_tensors_in_the_interpreter_take_the_release_plan(dispatch, on):
    """The interpreter's CPU tensors have no shared memory limit: the release alone decides."""
    on(dispatch.TUNED_TRITONS[0], "sm_89")
    assert dispatch.forward_config(16, torch.device("cpu")) == dispatch.DEFAULT_FORWARD_CONFIG[16]
