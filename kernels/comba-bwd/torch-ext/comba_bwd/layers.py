"""Layers for `kernels.kernelize`: stateless, forward-compatible with the host modules that model code
decorates with `@use_kernel_forward_from_hub("CombaAttention")`."""

import torch
from torch import nn

from .op import comba_attention


class CombaAttention(nn.Module):
    """The Comba token mixer after the projections: o = Comba(q, k, v, p, beta, g) with scale K ** -0.5."""

    has_backward = True
    can_torch_compile = True

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: torch.Tensor, beta: torch.Tensor,
        g: torch.Tensor,
    ) -> torch.Tensor:
        return comba_attention(q, k, v, p, beta, g)
