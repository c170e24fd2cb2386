"""Layers for `kernels.kernelize`: stateless, forward-compatible with the host modules that model code
decorates with `@use_kernel_forward_from_hub("BasedAttention")` (q, k, v) or
`@use_kernel_forward_from_hub("BasedVarlenAttention")` (q, k, v and the keyword arguments of packed sequences
and state: kernels checks that a layer's forward has the parameters of the host's, so they are two layers)."""

import torch
from torch import nn

from .op import based_attention


class BasedAttention(nn.Module):
    """Causal Based attention over already-projected q, k (B, T, H, K) and v (B, T, H, V) -> o (B, T, H, V).

    The host module must carry `scale: float | None` (the query scale; None means K ** -0.5). Trains through
    the fused backward on CUDA.
    """

    scale: float | None
    has_backward = True
    can_torch_compile = True

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return based_attention(q, k, v, self.scale)


class BasedVarlenAttention(nn.Module):
    """Causal Based attention over packed sequences and with a state, for host modules whose forward is
    `forward(q, k, v, *, initial_state=None, output_final_state=False, cu_seqlens=None)` -> o, or (o, (S, z))
    with output_final_state: `based_attention` with those keyword arguments (its docstring gives the layouts).

    The host module must carry `scale: float | None`. A call without the keyword arguments takes the path of
    `BasedAttention`; with them, the registered state ops (fused on CUDA for bf16 and fp16).
    """

    scale: float | None
    has_backward = True
    can_torch_compile = True

    def forward(self, q, k, v, *, initial_state=None, output_final_state=False, cu_seqlens=None):
        return based_attention(
            q, k, v, self.scale,
            initial_state=initial_state, output_final_state=output_final_state, cu_seqlens=cu_seqlens,
        )
