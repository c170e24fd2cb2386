"""`python -m tools.host_time`: each case runs the package's own eager CUDA path on CPU tensors, and the stubs go
away afterwards."""

import pytest
import torch

from tools.host_time import CASES, measure

# The CUDA entry point each case's public function must reach: the direct call, not the registered op.
ENTRY_POINTS = {
    "based_decode": "dispatch.py:based_decode_cuda",
    "comba_decode": "dispatch.py:comba_decode_cuda",
    "ldsa_local_attention": "dispatch.py:ldsa_forward_cuda",
    "whisper_log_mel": "dispatch.py:whisper_log_mel_cuda",
}


@pytest.mark.parametrize("name", list(CASES))
def test_case_runs_the_eager_cuda_path(name):
    cuda_device = torch.cuda.current_device
    report = measure(name, calls=20, repeats=1, profile_calls=10)
    functions = {label: calls for label, calls, _ in report.breakdown}
    assert functions.get(ENTRY_POINTS[name]) == 1, sorted(functions)
    assert functions.get("common/launch.py:launch") == CASES[name].launches
    assert report.launches == CASES[name].launches
    assert not any("custom_op" in label or "_ops.py" in label for label in functions)  # no registered op ran
    assert report.path_us > 0 and report.stub_us > 0
    # the stubs are gone
    assert torch.empty(1).is_cuda is False
    assert torch.cuda.current_device is cuda_device


def test_every_case_is_tested():
    assert set(ENTRY_POINTS) == set(CASES)


def test_a_slower_path_shows_in_the_figures(monkeypatch):
    """The tool times the package's own functions: 20 us more in the entry point is 20 us more a call."""
    import importlib
    import time

    from testkit import load

    op = importlib.import_module(f"{load('ldsa').__name__}.op")
    entry = op.ldsa_forward_cuda

    def slower(*args, **kwargs):
        start = time.perf_counter()
        while time.perf_counter() - start < 20e-6:
            pass
        return entry(*args, **kwargs)

    before = measure("ldsa_local_attention", calls=50, repeats=3, profile_calls=5).path_us
    monkeypatch.setattr(op, "ldsa_forward_cuda", slower)
    after = measure("ldsa_local_attention", calls=50, repeats=3, profile_calls=5).path_us
    assert after - before > 15
