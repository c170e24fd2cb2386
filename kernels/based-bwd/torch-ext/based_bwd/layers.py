"""Layers for `kernels.kernelize`: stateless, forward-compatible with the host modules that model code
decorates with `@use_kernel_forward_from_hub("BasedAttention")`."""

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
