"""Argument checks of the calls a model's layer makes (`comba_attention` with a carried state, packed sequences,
grouped value heads, q/k/p L2 normalisation or fla's read order, and `comba_decode`): a bad call raises TypeError or
ValueError naming the argument. Types, dtypes, shapes and devices only; cu_seqlens' offsets are read where the call
unpacks them (reference.sequence_bounds)."""

import torch

from .common.checks import as_scale, check_tensor
from .reference import READ_ORDERS
from .validation import SUPPORTED_DTYPES

OFFSET_DTYPES = (torch.int32, torch.int64)


def check_model_args(q, k, v, p, beta, g, scale, initial_state, output_final_state, cu_seqlens, use_qk_l2norm,
                     read_order, state_name="initial_state") -> None:
    """q, k, p (B, T, H, K); v (B, T, HV, V) with HV a multiple of H; beta, g (B, T, HV); initial_state
    (N, HV, K, V) float32 or None, named `state_name` in messages; cu_seqlens (N + 1,) int32 or int64 with B = 1,
    or None."""
    for name, x in (("q", q), ("k", k), ("p", p)):
        check_tensor(name, x, 4, SUPPORTED_DTYPES, "(B, T, H, K)")
    check_tensor("v", v, 4, SUPPORTED_DTYPES, "(B, T, HV, V)")
    check_tensor("beta", beta, 3, SUPPORTED_DTYPES, "(B, T, HV)")
    check_tensor("g", g, 3, (torch.float32,), "(B, T, HV)")
    for name, x in (("k", k), ("v", v), ("p", p)):
        if x.dtype != q.dtype:
            raise TypeError(f"{name} must have q's dtype {q.dtype}, got {x.dtype}")
    for name, x in (("k", k), ("v", v), ("p", p), ("beta", beta), ("g", g), (state_name, initial_state),
                    ("cu_seqlens", cu_seqlens)):
        if isinstance(x, torch.Tensor) and x.device != q.device:
            raise ValueError(f"{name} must be on q's device {q.device}, got {x.device}")
    as_scale("scale", scale)
    for name, flag in (("output_final_state", output_final_state), ("use_qk_l2norm", use_qk_l2norm)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")
    if not isinstance(read_order, str) or read_order not in READ_ORDERS:
        raise ValueError(f"read_order must be one of {READ_ORDERS}, got {read_order!r}")

    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if min(B, T, H, K, HV, V) < 1:
        raise ValueError(f"every size must be >= 1, got q {tuple(q.shape)} and v {tuple(v.shape)}")
    for name, x in (("k", k), ("p", p)):
        if x.shape != q.shape:
            raise ValueError(f"{name} must have q's shape (B, T, H, K) = {tuple(q.shape)}, got {tuple(x.shape)}")
    if v.shape[:2] != (B, T) or HV % H:
        raise ValueError(f"v must be (B, T, HV, V) = ({B}, {T}, HV, V) with HV a multiple of q's H = {H}, "
                         f"got {tuple(v.shape)}")
    for name, x in (("beta", beta), ("g", g)):
        if x.shape != (B, T, HV):
            raise ValueError(f"{name} must be (B, T, HV) = ({B}, {T}, {HV}), got {tuple(x.shape)}")
    N = B
    if cu_seqlens is not None:
        check_tensor("cu_seqlens", cu_seqlens, 1, OFFSET_DTYPES, "(N + 1,)")
        if B != 1:
            raise ValueError(f"cu_seqlens packs sequences along T of a batch of one: q must have B = 1, got B = {B}")
        N = cu_seqlens.shape[0] - 1
        if N < 1:
            raise ValueError(f"cu_seqlens must hold N + 1 >= 2 offsets, got {cu_seqlens.shape[0]}")
    if initial_state is not None:
        check_tensor(state_name, initial_state, 4, (torch.float32,), "(N, HV, K, V)")
        if initial_state.shape != (N, HV, K, V):
            raise ValueError(f"{state_name} must be (N, HV, K, V) = ({N}, {HV}, {K}, {V}) (N: B, or the sequences "
                             f"of cu_seqlens), got {tuple(initial_state.shape)}")
