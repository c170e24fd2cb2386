"""`python -m tools.host_time`: each case runs the package's own eager CUDA path on CPU tensors, and the stubs go
away afterwards."""

import pytest
import torch

from testkit import load
from tools.host_time import _C_STUBS, CASES, _direct_calls, measure

# What each case's public function must reach, once a call: the CUDA entry point called directly, or the kept direct
# call of its signature, not the registered op; and the launch function that runs its launches.
ENTRY_POINTS = {
    "based_decode": ("dispatch.py:based_decode_kept", "common/launch.py:launch_kept"),
    "comba_decode": ("dispatch.py:comba_decode_kept", "common/launch.py:launch_kept"),
    "ldsa_local_attention": ("dispatch.py:ldsa_forward_kept", "common/launch.py:launch_kept"),
    "whisper_log_mel": ("dispatch.py:whisper_log_mel_kept", "common/launch.py:launch_kept"),
    "whisper_log_mel_16": ("dispatch.py:whisper_log_mel_kept", "common/launch.py:launch_kept"),
    "log_mel_spectrogram": ("portable/stft.py:log_mel_spectrogram_kept", "common/launch.py:launch_kept"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_case_runs_the_eager_cuda_path(name):
    c_functions = {name: torch._C.__dict__.get(name) for name in _C_STUBS}
    report = measure(name, calls=20, repeats=1, profile_calls=10)
    functions = {label: calls for label, calls, _ in report.breakdown}
    entry, launch = ENTRY_POINTS[name]
    assert functions.get(entry) == 1, sorted(functions)
    assert functions.get(launch) == CASES[name].launches
    assert report.launches == CASES[name].launches
    assert not any("custom_op" in label or "_ops.py" in label for label in functions)  # no registered op ran
    assert report.path_us > 0 and report.stub_us > 0
    # the stubs are gone
    assert torch.empty(1).is_cuda is False
    assert all(torch._C.__dict__.get(name) is function for name, function in c_functions.items())
    assert not any(_direct_calls(load(CASES[name].kernel).__name__))  # no kept call holds a stub launcher


def test_every_case_is_tested():
    assert set(ENTRY_POINTS) == set(CASES)


def test_a_slower_path_shows_in_the_figures(monkeypatch):
    """The tool times the package's own functions: 20 us more in the direct-call test is 20 us more a call."""
    import importlib
    import time

    op = importlib.import_module(f"{load('ldsa').__name__}.op")
    entry = op.launches_directly

    def slower(*args, **kwargs):
        start = time.perf_counter()
        while time.perf_counter() - start < 20e-6:
            pass
        return entry(*args, **kwargs)

    before = measure("ldsa_local_attention", calls=50, repeats=3, profile_calls=5).path_us
    monkeypatch.setattr(op, "launches_directly", slower)
    after = measure("ldsa_local_attention", calls=50, repeats=3, profile_calls=5).path_us
    assert after - before > 15
