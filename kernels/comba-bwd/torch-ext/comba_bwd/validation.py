"""Argument checks at the public boundary: a bad call raises here, naming the argument.

Only types, dtypes, shapes, devices and the scalar `scale` are checked: a tensor's values are never
read here (that would synchronise the device and break CUDA-graph capture). A log-decay below the floor,
-inf included, is a hard reset by definition (reference.G_FLOOR), not an error.
"""

import torch

from .common.checks import as_scale, check_tensor
from .common.devices import gpu

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# Sizes the fused CUDA kernels are compiled for; the eager (CPU) reference takes any size >= 1. FUSED_K: the key size
# K of q, k and p; FUSED_V: the value size V of the spec's call; FUSED_MODEL_V: the value sizes a model's call
# (`op.comba_state_forward_op`) takes, the scans and the output cutting V in blocks, so that a larger V takes more
# programs, not larger ones.
FUSED_K = (64, 128, 256)
FUSED_V = (64, 128)
FUSED_MODEL_V = (64, 128, 256, 512)
# The shared memory a block needs for the fused kernels at K, where it is more than every GPU the metadata admits
# gives: at K = 256 the unpipelined reverse scan takes 104 KB under Triton 3.8 (72 KB under 3.6), more than sm_86,
# sm_89 and sm_120 give a block (99 KB); there a K = 256 call takes the eager reference.
FUSED_K_SHARED = {256: 104 * 1024}


def fused_k(device: torch.device, K: int) -> bool:
    """Whether the fused CUDA kernels take key size K on `device` (meta tensors: the GPU they stand for): K in FUSED_K,
    on a GPU whose blocks have the shared memory FUSED_K_SHARED asks."""
    if K not in FUSED_K:
        return False
    if K not in FUSED_K_SHARED or device.type not in ("cuda", "meta"):
        return True
    return gpu(device).shared_per_cta >= FUSED_K_SHARED[K]


def check_comba_args(q, k, v, p, beta, g, scale, do=None) -> None:
    """Validate comba_attention / comba_backward arguments (do=None for the forward)."""
    for name, x in (("q", q), ("k", k), ("p", p), ("v", v)):
        check_tensor(name, x, 4, SUPPORTED_DTYPES)
    check_tensor("beta", beta, 3, SUPPORTED_DTYPES)
    check_tensor("g", g, 3, (torch.float32,))
    named = [("q", q), ("k", k), ("v", v), ("p", p), ("beta", beta), ("g", g)]
    if do is not None:
        check_tensor("do", do, 4, SUPPORTED_DTYPES)
        named.append(("do", do))
    for name, x in named[1:]:
        if x.device != q.device:
            raise ValueError(f"{name} must be on q's device {q.device}, got {x.device}")
    # beta may be any supported float dtype; the other tensors share q's.
    for name, x in (("k", k), ("v", v), ("p", p), ("do", do)):
        if x is not None and x.dtype != q.dtype:
            raise TypeError(f"{name} must have q's dtype {q.dtype}, got {x.dtype}")
    as_scale("scale", scale)

    B, T, H, K = q.shape
    V = v.shape[-1]
    if min(B, T, H, K, V) < 1:
        raise ValueError(f"every size must be >= 1, got q {tuple(q.shape)} and v {tuple(v.shape)}")
    for name, x in (("k", k), ("p", p)):
        if x.shape != q.shape:
            raise ValueError(f"{name} must have q's shape (B, T, H, K) = {tuple(q.shape)}, got {tuple(x.shape)}")
    if v.shape[:3] != (B, T, H):
        raise ValueError(f"v must be (B, T, H, V) = ({B}, {T}, {H}, V), got {tuple(v.shape)}")
    for name, x in (("beta", beta), ("g", g)):
        if x.shape != (B, T, H):
            raise ValueError(f"{name} must be (B, T, H) = ({B}, {T}, {H}), got {tuple(x.shape)}")
    if do is not None and do.shape != v.shape:
        raise ValueError(f"do must have v's shape {tuple(v.shape)}, got {tuple(do.shape)}")
    if q.is_cuda and (not fused_k(q.device, K) or V not in FUSED_V):
        raise ValueError(
            f"the CUDA kernel supports K in {FUSED_K} (K = 256 on GPUs with {FUSED_K_SHARED[256] // 1024} KB of shared "
            f"memory a block) and V in {FUSED_V}, got K={K}, V={V} (the CPU reference accepts any size)"
        )
