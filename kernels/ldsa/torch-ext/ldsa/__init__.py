"""ldsa: the Local Dense Synthesizer Attention window op (softmax over a per-frame window, then the
windowed weighted sum of values) for the Hugging Face kernels hub."""

from . import layers
from .dispatch import kernel_path
from .op import ldsa_local_attention
from .reference import ldsa_backward_reference, ldsa_forward_reference

__all__ = [
    "layers",
    "ldsa_local_attention",
    "ldsa_forward_reference",
    "ldsa_backward_reference",
    "kernel_path",
]
