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


def check_cu_seqlens(q, cu_seqlens) -> int:
    """cu_seqlens: the N + 1 offsets (int32/int64, on q's device) of N sequences packed along T of a B = 1 batch,
    from 0 to T, non-decreasing. Returns N. The offsets' values are checked where they are on the CPU; on a GPU they
    are not read on the host, which would wait for the GPU once a call (the calls take
    `common.checks.bounded_offsets`)."""
    check_tensor("cu_seqlens", cu_seqlens, 1, (torch.int32, torch.int64), "(N + 1,)")
    if cu_seqlens.device != q.device:
        raise ValueError(f"cu_seqlens must be on the device of q ({q.device}), got {cu_seqlens.device}")
    B, T = q.shape[:2]
    if B != 1:
        raise ValueError(f"cu_seqlens packs sequences along T of a batch of one: q must have B = 1, got B={B}")
    if cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens must hold N + 1 >= 2 offsets, got {cu_seqlens.numel()}")
    if cu_seqlens.device.type == "cpu":
        bounds = cu_seqlens.tolist()
        if bounds[0] != 0 or bounds[-1] != T:
            raise ValueError(f"cu_seqlens must start at 0 and end at T={T}, got {bounds[0]} ... {bounds[-1]}")
        if any(b < a for a, b in zip(bounds[:-1], bounds[1:])):
            raise ValueError(f"cu_seqlens must be non-decreasing, got {bounds}")
    return cu_seqlens.numel() - 1


def check_state(name: str, q, v, state, N: int) -> None:
    """state: the pair (S (N, H, P, V), z (N, H, P)), float32, on q's device, P = 1 + K + K^2."""
    if not isinstance(state, (tuple, list)) or len(state) != 2:
        raise TypeError(f"{name} must be the pair (S, z), got {type(state).__name__}")
    _, _, H, K = q.shape
    P = 1 + K + K * K
    parts = [(f"{name}[0] (S)", state[0], (N, H, P, v.shape[-1]), "(N, H, 1 + K + K^2, V)"),
             (f"{name}[1] (z)", state[1], (N, H, P), "(N, H, 1 + K + K^2)")]
    for part, x, shape, layout in parts:
        check_tensor(part, x, len(shape), (torch.float32,), layout)
        if tuple(x.shape) != shape:
            raise ValueError(f"{part} must have the shape {shape} {layout}, got {tuple(x.shape)}")
        if x.device != q.device:
            raise ValueError(f"{part} must be on the device of q ({q.device}), got {x.device}")


def check_state_args(q, v, initial_state, output_final_state, cu_seqlens) -> None:
    """The state and packing arguments of based_attention (q and v already checked)."""
    if not isinstance(output_final_state, bool):
        raise TypeError(f"output_final_state must be a bool, got {type(output_final_state).__name__}")
    N = q.shape[0] if cu_seqlens is None else check_cu_seqlens(q, cu_seqlens)
    if initial_state is not None:
        check_state("initial_state", q, v, initial_state, N)


def check_decode_args(q, k, v, state, scale, max_tokens: int, out=None) -> None:
    """q, k (B, T, H, K), v (B, T, H, V) with 1 <= T <= max_tokens, the state (S, z) of the B sequences, and out:
    None, or a pair of contiguous tensors like the state's (shapes, dtypes, devices and strides only: whether out
    shares memory with the state is `check_decode_memory`'s question)."""
    check_based_args(q, k, v, scale)
    if q.shape[1] > max_tokens:
        raise ValueError(f"based_decode takes 1 to {max_tokens} new tokens (q.shape[1]), got {q.shape[1]}: "
                         "run a longer prompt through based_attention with output_final_state=True")
    check_state("state", q, v, state, q.shape[0])
    if out is None:
        return
    check_state("out", q, v, out, q.shape[0])
    for name, x in (("out[0] (S)", out[0]), ("out[1] (z)", out[1])):
        if not x.is_contiguous():
            raise ValueError(f"{name} must be contiguous")


# The pairs of (state[0], state[1], out[0], out[1]) that must not share memory, in the order they are checked.
_DISJOINT = ((0, 2), (0, 3), (1, 2), (1, 3), (2, 3))
_DECODE_NAMES = ("state[0] (S)", "state[1] (z)", "out[0] (S)", "out[1] (z)")


def check_decode_memory(state, out) -> None:
    """The new state's buffers `out` share no memory with the state or with each other (their memory spans, from
    the lowest to the highest element, do not meet). For a call `check_decode_args` passed (every tensor non-empty,
    on one device); it reads the data pointers, so it runs every call. Tensors without memory of their own (meta and
    fake tensors, a call torch.compile traces) are not checked."""
    tensors = (*state, *out)
    if torch.compiler.is_compiling() or any(type(x) is not torch.Tensor or x.is_meta for x in tensors):
        return
    spans = [_span(x) for x in tensors]
    for a, b in _DISJOINT:
        if spans[a][0] < spans[b][1] and spans[b][0] < spans[a][1]:
            raise ValueError(f"{_DECODE_NAMES[b]} must not share memory with {_DECODE_NAMES[a]}: the new state goes "
                             "to other buffers")


def _span(x: torch.Tensor) -> tuple[int, int]:
    """The first byte of x's memory and the byte after its last element."""
    start = x.data_ptr()
    if x.is_contiguous():
        return start, start + x.numel() * x.element_size()
    last = sum((n - 1) * st for n, st in zip(x.shape, x.stride()) if st > 0) * x.element_size()
    return start, start + last + x.element_size()
