"""Each call's path, in one place: bf16 and fp16 CUDA tensors take the fused Triton kernels (`triton/`), fp32
tensors and the CPU the eager reference, and a backward with a value size V above its kernels' bound the
reference as well. The package has no Hopper-only fast paths."""

import torch

from .reference import based_backward_reference, based_forward_reference


def kernel_path(x: torch.Tensor) -> str:
    """Which implementation a call on `x` takes by device and dtype: "triton" for bf16/fp16 CUDA tensors,
    "reference" otherwise. A backward with a value size V above triton.backward.MAX_V takes the reference
    whatever this names (`cuda_backward`)."""
    # The backward's fp32 mode (IEEE fp32 matmuls) fails its float64 check at K=8 on the H200, and the
    # forward's spills, so fp32 inputs take the eager reference on CUDA too.
    return "triton" if x.is_cuda and x.dtype != torch.float32 else "reference"


def cuda_backward(q, k, v, do, scale: float):
    """(dq, dk, dv) on the path `kernel_path` names for CUDA tensors."""
    if kernel_path(q) == "reference":
        return based_backward_reference(q, k, v, do, scale)
    from .triton.backward import MAX_V, based_backward_triton  # triton is imported only on the CUDA path

    if v.shape[-1] > MAX_V:
        return based_backward_reference(q, k, v, do, scale)
    return based_backward_triton(q, k, v, do, scale)


def cuda_forward(q, k, v, scale: float):
    """o on the path `kernel_path` names for CUDA tensors (the Triton forward takes any V)."""
    if kernel_path(q) == "reference":
        return based_forward_reference(q, k, v, scale)
    from .triton.forward import based_forward_triton  # triton is imported only on the CUDA path

    return based_forward_triton(q, k, v, scale)
