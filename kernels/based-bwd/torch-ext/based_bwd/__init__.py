"""based-bwd: the backward of causal Based (2nd-order Taylor linear) attention, fused for training, with a
differentiable attention function and layers that train through it, a state in and out, packed sequences and a
decode step for generation, for the Hugging Face kernels hub."""

from . import layers
from .dispatch import kernel_path
from .op import based_attention, based_backward, based_decode
from .reference import (
    based_backward_reference,
    based_decode_reference,
    based_forward_reference,
    based_state_backward_reference,
)

__all__ = [
    "layers",
    "based_backward",
    "based_attention",
    "based_decode",
    "based_backward_reference",
    "based_decode_reference",
    "based_forward_reference",
    "based_state_backward_reference",
    "kernel_path",
]
