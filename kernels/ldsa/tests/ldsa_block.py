"""The LDSA block of Xu et al. (ICASSP 2021, arXiv:2010.12155) as model code would write it.

A synthesis MLP (w1 -> ReLU -> w2) turns each frame into W window logits per head, a value projection
(w3) gives the values, the window op mixes each frame's window, and w_out projects back. The window op is
`LDSAWindow`, a host module decorated with `use_kernel_forward_from_hub("LDSAWindow")`: its own forward is
plain torch (an unfold and a product, as the paper's code does), and `kernels.kernelize` swaps in the
Hub layer `tessera/ldsa` `LDSAWindow`, whose forward takes the same arguments.
"""

import torch
from kernels import use_kernel_forward_from_hub
from torch import nn


@use_kernel_forward_from_hub("LDSAWindow")
class LDSAWindow(nn.Module):
    """Softmax over each frame's window of logits, then the weighted sum of the window's values.

    Frames outside [0, T) hold zero values (they still take part in the softmax), as in the paper's code."""

    def __init__(self, left: int, right: int):
        super().__init__()
        self.left = left
        self.right = right

    def forward(self, a_logits: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        a = torch.softmax(a_logits.float(), dim=2)  # [B, H, W, T]
        windows = nn.functional.pad(v.float(), (self.left, self.right)).unfold(-1, a.shape[2], 1)
        return torch.einsum("bhkt,bhdtk->bhdt", a, windows).to(v.dtype)  # windows: [B, H, Dh, T, W]


class LDSABlock(nn.Module):
    """x [B, T, d_model] -> [B, T, d_model] with n_head heads and the window (left, right)."""

    def __init__(self, d_model: int, n_head: int, left: int, right: int):
        super().__init__()
        self.n_head = n_head
        self.width = left + right + 1
        self.w1 = nn.Linear(d_model, d_model, bias=False)
        self.w2 = nn.Linear(d_model, n_head * self.width, bias=False)
        self.w3 = nn.Linear(d_model, d_model, bias=False)
        self.w_out = nn.Linear(d_model, d_model, bias=False)
        self.window = LDSAWindow(left, right)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, d_model = x.shape
        a_logits = self.w2(torch.relu(self.w1(x))).view(B, T, self.n_head, self.width).permute(0, 2, 3, 1)
        v = self.w3(x).view(B, T, self.n_head, d_model // self.n_head).permute(0, 2, 3, 1)
        out = self.window(a_logits, v)  # [B, H, Dh, T]
        return self.w_out(out.permute(0, 3, 1, 2).reshape(B, T, d_model))
