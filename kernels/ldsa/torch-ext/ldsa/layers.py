"""Layers for `kernels.kernelize`: stateless, forward-compatible with the host modules that model code
decorates with `@use_kernel_forward_from_hub("LDSAWindow")`."""

import torch
from torch import nn

from .op import ldsa_local_attention


class LDSAWindow(nn.Module):
    """The window op of an LDSA block. The host module must carry `left: int` and `right: int`."""

    left: int
    right: int
    has_backward = True
    can_torch_compile = True

    def forward(self, a_logits: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return ldsa_local_attention(a_logits, v, self.left, self.right)
