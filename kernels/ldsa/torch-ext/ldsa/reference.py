"""Eager LDSA window op: the numerical specification, in plain torch.

Softmax and accumulation run in float32 whatever the input dtype and whatever autocast is on (`autocast_off`);
results are cast back at the end.
Each of the W window taps is one shifted multiply-add over the zero-padded values, so memory stays
O(input) (no unfold) at the cost of W passes — this is the eager path the fused kernel replaces.
"""

import torch

from .common.autocast import autocast_off


def _shifted(x: torch.Tensor, left: int, right: int) -> torch.Tensor:
    """Pad the time axis so that tap k of frame t reads index t + k."""
    return torch.nn.functional.pad(x, (left, right))


@autocast_off
def ldsa_forward_reference(a_logits: torch.Tensor, v: torch.Tensor, left: int, right: int) -> torch.Tensor:
    """out[b,h,d,t] = sum_k softmax_k(a_logits[b,h,:,t]) * v[b,h,d,t-left+k], zero outside [0, T)."""
    T = v.shape[-1]
    a = torch.softmax(a_logits.float(), dim=2)
    vp = _shifted(v.float(), left, right)
    out = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
    for k in range(left + right + 1):
        out += a[:, :, k : k + 1, :] * vp[..., k : k + T]
    return out.to(v.dtype)


@autocast_off
def ldsa_backward_reference(
    a_logits: torch.Tensor, v: torch.Tensor, grad_out: torch.Tensor, left: int, right: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Analytic gradients (dlogits, dv) of `ldsa_forward_reference`, float32 inside.

    da[k,t]      = sum_d grad_out[d,t] * v[d,t-left+k]
    dlogits[k,t] = a[k,t] * (da[k,t] - sum_k' a[k',t] * da[k',t])      (softmax Jacobian)
    dv[d,s]      = sum_k a[k,s+left-k] * grad_out[d,s+left-k]          (the transposed window)
    """
    T = v.shape[-1]
    W = left + right + 1
    a = torch.softmax(a_logits.float(), dim=2)
    go = grad_out.float()
    vp = _shifted(v.float(), left, right)
    da = torch.stack([(go * vp[..., k : k + T]).sum(dim=2) for k in range(W)], dim=2)
    dlogits = a * (da - (a * da).sum(dim=2, keepdim=True))
    # Tap k of frame t touched v at s = t - left + k: scatter back by padding the other way round.
    dvp = torch.zeros(vp.shape, dtype=torch.float32, device=v.device)
    for k in range(W):
        dvp[..., k : k + T] += a[:, :, k : k + 1, :] * go
    dv = dvp[..., left : left + T].contiguous()
    return dlogits.to(a_logits.dtype), dv.to(v.dtype)
