"""Which implementation a call takes, in one place: CUDA tensors run the Triton kernels (`triton/`), every other
device the eager reference (`reference.py`). The package has no fast paths beyond the portable Triton ones, so
the choice is the device alone."""

import torch


def kernel_path(x: torch.Tensor) -> str:
    """Which implementation a call on `x`'s device takes: "triton" or "reference"."""
    return "triton" if x.is_cuda else "reference"
