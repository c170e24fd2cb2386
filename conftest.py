"""Test session setup: the local Hub cache, offline mode, and Triton's interpreter where there is no GPU.

These variables are read when `huggingface_hub`, `kernels`, `triton` and `testkit` are imported, so they
are set here, before anything imports them.
"""

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_CACHE", str(Path(__file__).resolve().parent / ".hub"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_configure(config):
    import testkit

    if testkit.INTERPRETED:
        testkit.patch_interpreter()


def pytest_collection_modifyitems(items):
    """Mark what exercises a GPU as `gpu` (the device run selects these with `-m gpu`): tests that need CUDA
    or Triton, and tests parametrized on the cuda device."""
    for item in items:
        reasons = " ".join(str(m.kwargs.get("reason", "")) for m in item.iter_markers("skipif"))
        if "CUDA" in reasons or "[cuda" in item.name or "-cuda" in item.name:
            item.add_marker("gpu")


@pytest.fixture(autouse=True)
def _release_cached_gpu_memory(request):
    """After a `gpu` test, the memory its process's caching allocator keeps goes back to the driver: the test
    processes of a parallel GPU run (`pytest -n`) share one card, and a process holding its earlier tests' freed
    blocks runs another out of memory."""
    yield
    if request.node.get_closest_marker("gpu") is not None and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
