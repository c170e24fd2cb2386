"""comba-bwd: Comba (gated delta rule with a decoupled read key p and write key k, decay before the read), forward
and backward as fused ops: `comba_attention` (differentiable; with a carried state, packed sequences, grouped value
heads, q/k/p L2 normalisation and fla's read order as keyword arguments), `comba_backward` (the six gradients) and
`comba_decode` (a few new tokens after a carried state); `fla` holds fla 0.6.0's `chunk_comba` and
`fused_recurrent_comba` on them."""

from . import fla, layers
from .dispatch import kernel_path
from .op import comba_attention, comba_backward, comba_decode
from .recurrent import comba_decode_reference, comba_recurrent_reference
from .reference import comba_backward_reference, comba_forward_reference

__all__ = [
    "fla",
    "layers",
    "comba_backward",
    "comba_attention",
    "comba_decode",
    "comba_backward_reference",
    "comba_decode_reference",
    "comba_forward_reference",
    "comba_recurrent_reference",
    "kernel_path",
]
