"""Argument checks at the public boundary: a bad call raises here, naming the argument."""

import torch

from .common.checks import as_int, check_tensor

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_ldsa_args(a_logits, v, left, right) -> None:
    """Validate `ldsa_local_attention(a_logits [B,H,W,T], v [B,H,Dh,T], left, right)`; `left` and `right` are any
    integral numbers >= 0 (the op takes them as Python ints)."""
    check_tensor("a_logits", a_logits, 4, SUPPORTED_DTYPES)
    check_tensor("v", v, 4, SUPPORTED_DTYPES)
    left, right = as_int("left", left, 0), as_int("right", right, 0)
    if a_logits.device != v.device:
        raise ValueError(f"a_logits and v must be on one device, got {a_logits.device} and {v.device}")
    B, H, W, T = a_logits.shape
    if (v.shape[0], v.shape[1], v.shape[3]) != (B, H, T):
        raise ValueError(
            f"v must be [B, H, Dh, T] = [{B}, {H}, Dh, {T}] to match a_logits {tuple(a_logits.shape)}, "
            f"got {tuple(v.shape)}"
        )
    if W != left + right + 1:
        raise ValueError(f"a_logits window size W={W} must equal left + right + 1 = {left + right + 1}")
    if min(B, H, T, v.shape[2]) < 1:
        raise ValueError(f"every size must be >= 1, got a_logits {tuple(a_logits.shape)} and v {tuple(v.shape)}")


def check_grad_out(grad_out, v) -> None:
    """Validate the backward's `grad_out` against the saved `v`: a supported dtype, v's shape and device."""
    check_tensor("grad_out", grad_out, 4, SUPPORTED_DTYPES)
    if grad_out.shape != v.shape:
        raise ValueError(f"grad_out must have the shape of v {tuple(v.shape)}, got {tuple(grad_out.shape)}")
    if grad_out.device != v.device:
        raise ValueError(f"grad_out must be on {v.device}, got {grad_out.device}")
