"""comba-bwd: Comba (gated delta rule with a decoupled read key p and write key k, decay before the read), forward
and backward as fused ops: `comba_attention` (differentiable) and `comba_backward` (the six gradients)."""

from . import layers
from .dispatch import kernel_path
from .op import comba_attention, comba_backward
from .reference import comba_backward_reference, comba_forward_reference

__all__ = [
    "layers",
    "comba_backward",
    "comba_attention",
    "comba_backward_reference",
    "comba_forward_reference",
    "kernel_path",
]
