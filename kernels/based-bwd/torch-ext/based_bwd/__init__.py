"""based-bwd: the backward of causal Based (2nd-order Taylor linear) attention, fused for training, with a
differentiable attention function and layer that train through it, for the Hugging Face kernels hub."""

from . import layers
from .dispatch import kernel_path
from .op import based_attention, based_backward
from .reference import based_backward_reference, based_forward_reference

__all__ = [
    "layers",
    "based_backward",
    "based_attention",
    "based_backward_reference",
    "based_forward_reference",
    "kernel_path",
]
