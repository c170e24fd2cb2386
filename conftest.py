"""Test session setup: the local Hub cache, offline mode, and Triton's interpreter where there is no GPU.

These variables are read when `huggingface_hub`, `kernels` and `triton` are imported, so they are set
here, before any test module imports them.
"""

import os

import torch

from testkit import REPO_ROOT

os.environ.setdefault("HF_HUB_CACHE", str(REPO_ROOT / ".hub"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_configure(config):
    import importlib.util

    if os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton"):
        from testkit import patch_interpreter_bf16_dot

        patch_interpreter_bf16_dot()
