"""The chunk states of Based's feature maps, in HBM: their layout and the scan that fills them.

With phi_k(k) = [1, k, k (x) k] and phi_q(q~) = [1, q~, q~ (x) q~ / 2] (the Taylor term's 1/2 on the query side),
A_ij = phi_q(q~_i) . phi_k(k_j). Both maps are symmetric in the pair (a, b) of a product x_a x_b, so a state keeps
one row per unordered pair: P = 1 + K + K (K + 1) / 2 rows, row 0 the constant, rows 1 .. K the linear block,
then the pairs a <= b row by row (`_pair_row`); 153 rows at K = 16 instead of 273. A (B H, N, P, V) buffer holds
chunk n's state at rows `_chunk_state(bh, n)`; an fp32 (B H, N, P) buffer its normaliser.

`_state_scan_kernel` forward stores S_n = sum over earlier chunks of phi_k(K)^T V and z_n = sum of phi_k(k) (the
forward's output and dq read them); reverse, dS_n = sum over later chunks of phi_q(Q~)^T G and dz_n = sum of
phi_q(q~) h (dk and dv read them). Each program owns a block of feature rows and of V columns, so the scan is
parallel over (features, V, b h); only the running sum is serial, and it is fp32 in registers.
"""

import torch
import triton
import triton.language as tl

from .tiles import _dot, _sequence_row, operand_type


@triton.jit
def _pair_row(a, b, K: tl.constexpr):
    """The state row of the quadratic feature x_a x_b (either order): after the constant and the K linear
    rows, the pairs a' <= b' row by row (a' = 0 first, with K pairs)."""
    lo = tl.minimum(a, b)
    hi = tl.maximum(a, b)
    return 1 + K + lo * K - lo * (lo - 1) // 2 + (hi - lo)


@triton.jit
def _chunk_state(pid_bh, n, N, P: tl.constexpr):
    """The row of feature 0 of chunk n's state of sequence pid_bh in the (B H, N, P, .) state buffers."""
    return (pid_bh.to(tl.int64) * N + n) * P


@triton.jit
def _scan_loads(x, y, w_in, n, ia, ib, linear, quad, cols, T, H, V, K: tl.constexpr, C: tl.constexpr,
                WEIGHTED: tl.constexpr):
    """The loads of chunk n one scan step consumes: x_a and x_b [R, C], y [C, BV] and the position weights
    [C] (w_in's, or 1); zero past T."""
    t = n * C + tl.arange(0, C)
    inside = t < T
    xrow = x + t.to(tl.int64)[None, :] * (H * K)
    xa = tl.load(xrow + ia[:, None], mask=inside[None, :] & (linear | quad)[:, None], other=0.0)
    xb = tl.load(xrow + ib[:, None], mask=inside[None, :] & quad[:, None], other=0.0)
    yy = tl.load(y + t.to(tl.int64)[:, None] * (H * V) + cols[None, :], mask=inside[:, None] & (cols < V)[None, :],
                 other=0.0)
    if WEIGHTED:
        w = tl.load(w_in + t, mask=inside, other=0.0)
    else:
        w = inside.to(tl.float32)
    return xa, xb, yy, w


@triton.jit
def _state_scan_kernel(
    x, y, w_in, states, norms,
    T, H, V, scale, N,
    K: tl.constexpr, P: tl.constexpr, R: tl.constexpr, BV: tl.constexpr, C: tl.constexpr, REVERSE: tl.constexpr,
    DOT: tl.constexpr,
):
    """Forward (REVERSE false): x = k, y = v; stores S_n = sum_{m < n} phi_k(K_m)^T V_m and z_n (weights 1).
    Reverse: x = q, y = g; stores dS_n = sum_{m > n} phi_q(Q~_m)^T G_m and dz_n (weights w_in = h)."""
    pid_f = tl.program_id(0)
    pid_v = tl.program_id(1)
    pid_bh = tl.program_id(2)
    row = _sequence_row(pid_bh, T, H)
    x += row * K
    y += row * V
    w_in += pid_bh.to(tl.int64) * T
    f = pid_f * R + tl.arange(0, R)
    linear = (f >= 1) & (f <= K)
    quad = (f > K) & (f < P)
    # Packed pair p = f - 1 - K -> (a, b), a <= b: a counts the rows a' >= 1 whose first pair is at or before p.
    p = f - 1 - K
    pa = tl.zeros([R], dtype=tl.int32)
    for a in tl.static_range(1, K):
        pa += (p >= a * K - a * (a - 1) // 2).to(tl.int32)
    ia = tl.where(linear, f - 1, tl.where(quad, pa, 0))
    ib = tl.where(quad, p - (pa * K - pa * (pa - 1) // 2) + pa, 0)
    if REVERSE:  # phi_q of q~ = scale q
        c1 = scale
        c2 = 0.5 * scale * scale
    else:
        c1 = 1.0
        c2 = 1.0
    cols = pid_v * BV + tl.arange(0, BV)
    state_rows = _chunk_state(pid_bh, 0, N, P) + f
    store_mask = (f < P)[:, None] & (cols < V)[None, :]
    acc = tl.zeros([R, BV], dtype=tl.float32)
    z = tl.zeros([R], dtype=tl.float32)
    for m in range(0, N):
        if REVERSE:
            n = N - 1 - m
        else:
            n = m
        rows = state_rows + n * P
        tl.store(states + rows[:, None] * V + cols[None, :], acc.to(states.dtype.element_ty), mask=store_mask)
        if pid_v == 0:
            tl.store(norms + rows, z, mask=f < P)
        xa, xb, yy, w = _scan_loads(x, y, w_in, n, ia, ib, linear, quad, cols, T, H, V, K, C, REVERSE)
        inside = n * C + tl.arange(0, C) < T
        xa32, xb32 = xa.to(tl.float32), xb.to(tl.float32)
        phi_t = tl.where(linear[:, None], c1 * xa32, c2 * xa32 * xb32)
        phi_t = tl.where((f == 0)[:, None] & inside[None, :], 1.0, phi_t)
        acc += _dot(DOT, phi_t, yy)
        z += tl.sum(phi_t * w[None, :], 1)


def n_features(K: int) -> int:
    """P, the state rows: the constant, K linear features and the K (K + 1) / 2 distinct products x_a x_b
    (a <= b; the state of x_b x_a is the same, so the kernels read one row for both orders)."""
    return 1 + K + K * (K + 1) // 2


def state_buffers(x: torch.Tensor, V: int, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Uninitialised (B H, N, P, V) states for x (B, T, H, K) cut in N = ceil(T / chunk) chunks (fp32 for fp32
    inputs, bf16 otherwise) and fp32 (B H, N, P) normalisers, on x's device."""
    B, T, H, K = x.shape
    BH, N, P = B * H, triton.cdiv(T, chunk), n_features(K)
    dtype = torch.float32 if x.dtype == torch.float32 else torch.bfloat16
    states = torch.empty(BH, N, P, V, device=x.device, dtype=dtype)
    return states, torch.empty(BH, N, P, device=x.device, dtype=torch.float32)


def launch(x, y, weights, states, norms, scale: float, *, chunk: int, reverse: bool, rows: int, bv: int,
           warps: int) -> None:
    """The scan over chunks of `chunk` positions of x (B, T, H, K) and y (B, T, H, V) into the `state_buffers`
    states and norms: forward (reverse False) x = k, y = v, weights not read; reverse x = q, y = g, weights the
    fp32 (B H, T) h. A program takes `rows` feature rows and up to `bv` V columns, on `warps` warps."""
    B, T, H, K = x.shape
    BH, N, P, V = states.shape
    BV = min(bv, max(16, triton.next_power_of_2(V)))
    _state_scan_kernel[(triton.cdiv(P, rows), triton.cdiv(V, BV), BH)](
        x, y, weights, states, norms, T, H, V, scale, N,
        K=K, P=P, R=rows, BV=BV, C=chunk, REVERSE=reverse, DOT=operand_type(x.dtype), num_warps=warps, num_stages=1)
