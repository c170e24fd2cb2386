"""comba-bwd: the Comba backward (gated delta rule with a decoupled read key p and write key k, decay before
the read) as one fused Triton op, plus a differentiable `comba_attention` that trains through it."""

from . import layers
from .op import comba_attention, comba_backward, kernel_path
from .reference import comba_backward_reference, comba_forward_reference

__all__ = [
    "layers",
    "comba_backward",
    "comba_attention",
    "comba_backward_reference",
    "comba_forward_reference",
    "kernel_path",
]
