"""Argument checks at the public boundary: a bad call raises here, naming the argument."""

import torch

from .common.checks import as_scale, check_tensor

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# The fused CUDA kernel is written for these Taylor feature sizes (the CPU reference takes any K >= 1).
FUSED_FEATURE_SIZES = (8, 16)


def check_based_args(q, k, v, scale, do=None) -> None:
    """Validate q, k (B, T, H, K), v (and do, when given) (B, T, H, V) and scale (float or None)."""
    named = [("q", q), ("k", k), ("v", v)] + ([("do", do)] if do is not None else [])
    for name, x in named:
        check_tensor(name, x, 4, SUPPORTED_DTYPES)
    for name, x in named[1:]:
        if x.dtype != q.dtype:
            raise TypeError(f"{name} must have the dtype of q ({q.dtype}), got {x.dtype}")
        if x.device != q.device:
            raise ValueError(f"q and {name} must be on one device, got {q.device} and {x.device}")
    B, T, H, K = q.shape
    if k.shape != q.shape:
        raise ValueError(f"k must have the shape of q (B, T, H, K) = {tuple(q.shape)}, got {tuple(k.shape)}")
    if v.shape[:3] != q.shape[:3]:
        raise ValueError(f"v must be (B, T, H, V) = ({B}, {T}, {H}, V) to match q {tuple(q.shape)}, got {tuple(v.shape)}")
    if do is not None and do.shape != v.shape:
        raise ValueError(f"do must have the shape of v {tuple(v.shape)}, got {tuple(do.shape)}")
    if min(B, T, H, K, v.shape[3]) < 1:
        raise ValueError(f"every size must be >= 1, got q {tuple(q.shape)} and v {tuple(v.shape)}")
    if q.is_cuda and K not in FUSED_FEATURE_SIZES:
        raise ValueError(f"the CUDA kernel supports a feature size K (q.shape[-1]) in {FUSED_FEATURE_SIZES}, got K={K}")
    as_scale("scale", scale)
