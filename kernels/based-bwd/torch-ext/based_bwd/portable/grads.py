"""The backward's gradients: two per-chunk kernels around the reverse state scan.

Notation as in reference.py: q~ = scale q, s_ij = q~_i . k_j, A_ij = 1 + s_ij + s_ij^2 / 2 (j <= i),
r_i = 1 / (den_i + 1e-6), delta_i = do_i . o_i, g_i = r_i do_i, h_i = -r_i delta_i. With the feature maps
phi_k(k) = [1, k, k (x) k] and phi_q(q~) = [1, q~, q~ (x) q~ / 2] (the Taylor term's 1/2 on the query side),
A_ij = phi_q(q~_i) . phi_k(k_j); the states keep one row per unordered pair of a product, in the packed layout
of `states` (P rows).

The sequence is cut in chunks of C positions. Per (b, h) and chunk n the backward's four launches exchange,
through one HBM buffer of N x P x V states (bf16 for 16-bit inputs) and an fp32 N x P normaliser buffer:

1. `states._state_scan_kernel` (forward): S_n = sum over earlier chunks of phi_k(K)^T V and z_n = sum of
   phi_k(k).
2. `_dq_kernel`, one program per chunk, all of V: recomputes num and den from S_n, z_n and the chunk's
   quadratic form, hence r and delta, and then the complete dq; it writes g = r do (in the matmul operand
   type, which every later use rounds it to) and h (one float a position) for the launches after it:
       dq~_i = sum_{j <= i in chunk} ds_ij k_j + S1 g_i + z1 h_i + M_i q~_i,
       M_i[a, b] = S2[ab] . g_i + Z2[ab] h_i,   ds_ij = (g_i . v_j + h_i)(1 + s_ij).
3. `states._state_scan_kernel` (reverse) overwrites the state buffer with dS_n = sum over later chunks of
   phi_q(Q~)^T G and dz_n = sum of phi_q(q~) h: the forward scan's loop with q, g and the weights h.
4. `_dkdv_kernel`, one program per chunk: dv_j = sum_{i >= j in chunk} A_ij g_i + phi_k(k_j)^T dS_n and
       dk_j = sum_{i >= j in chunk} ds_ij q~_i + dS1 v_j + dz1 + 2 M'_j k_j,   M'_j[a, b] = dS2[ab] . v_j + dZ2[ab].

The quadratic features are never stored: num and dv are sum_a (x_a X) S2[a .], one product per a over the
chunk's rows X, with the K rows S2[a .] gathered from the packed state (`_quad_readout`); the M x terms of dq
and dk are sum_b x_b (G S2[. b]^T), one product per b (`_quad_grad`). Matmuls take bf16 operands with fp32
accumulation (IEEE fp32 for fp32 inputs); the scans' running sums, the normaliser (den and its states), r,
delta and the squares s^2 are fp32; a product x_a x_b is formed in fp32 and rounded to the matmul operand
type. Where a product wants the other orientation of an operand, it takes tl.trans of the loaded tile, never
of a dot result (the wgmma miscompile of fla #640).

Non-finite values keep to the steps that read them (`reference.py` states the rule). The causal chunk products
A v and ds k (dq) take their operand's finite part (`common.finite`) and are NaN from the chunk's first row
holding a non-finite entry on, as A^T g and ds^T q~ (dk, dv) are in reverse, up to its last. v's and g's finite
parts also feed g v^T and v g^T, whose rows that read a non-finite entry are NaN through num, delta and h anyway;
s and s^T take q and k as they are, since their masked entries are selected away, not multiplied.
"""

import triton
import triton.language as tl

from ..common.finite import finite_part, reached
from .states import _chunk_at, _pair_row
from .tiles import _EPS, _dot, _load_rows, _store_rows, operand_type

# V is held whole by a chunk program (delta_i = do_i . o_i needs all of it); wider V takes the reference.
MAX_V = 256


@triton.jit
def _load_vec(base, t0, T, R: tl.constexpr):
    rows = t0 + tl.arange(0, R)
    return tl.load(base + rows, mask=rows < T, other=0.0)


@triton.jit
def _load_col(x, t0, T, row_stride, col, C: tl.constexpr):
    """[C] fp32: column `col` of rows t0 .. t0 + C; zero past T."""
    rows = t0 + tl.arange(0, C)
    return tl.load(x + rows.to(tl.int64) * row_stride + col, mask=rows < T, other=0.0).to(tl.float32)


@triton.jit
def _pair_block(x, t0, T, row_stride, S, Z, a, V, K: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                C: tl.constexpr):
    """(S2[a .] [BK, BV], Z2[a .] [BK], x_a [C]): the state and normaliser rows of the pairs (a, b), b < K
    (zero for b >= K), and column a of rows t0 .. t0 + C of the (., K) tensor x."""
    vc = tl.arange(0, BV)
    kc = tl.arange(0, BK)
    rows = _pair_row(a, kc, K)
    S2a = tl.load(S + rows[:, None] * V + vc[None, :], mask=(kc < K)[:, None] & (vc < V)[None, :], other=0.0)
    Z2a = tl.load(Z + rows, mask=kc < K, other=0.0)
    return S2a, Z2a, _load_col(x, t0, T, row_stride, a, C)


@triton.jit
def _quad_readout(y, yz, coef, x_c, x, t0, T, row_stride, S, Z, V, K: tl.constexpr, BK: tl.constexpr,
                  BV: tl.constexpr, C: tl.constexpr, DOT: tl.constexpr):
    """(y + coef sum_{a, b} x_a x_b S2[ab], yz + coef sum_{a, b} x_a x_b Z2[ab]) for rows t0 .. t0 + C of a
    (., K) tensor x (x_c: those rows, [C, BK]); y [C, BV] and yz [C] the accumulators to add to (one live
    [C, BV] accumulator, not two), S2 and Z2 the quadratic rows of the state at S and of the normaliser at Z.

    One product per a, (coef x_a x_c) S2[a .], accumulating in place (coef x_a x_b is an fp32 product rounded
    to the operand type, like every matmul operand); each packed row is read for both orders of its pair,
    the next a's rows loaded before the current product. The normaliser's sum stays fp32."""
    x32 = x_c.to(tl.float32)
    S2n, Z2n, xn = _pair_block(x, t0, T, row_stride, S, Z, 0, V, K, BK, BV, C)
    for a in range(0, K):
        S2a, Z2a, xa = S2n, Z2n, xn
        S2n, Z2n, xn = _pair_block(x, t0, T, row_stride, S, Z, tl.minimum(a + 1, K - 1), V, K, BK, BV, C)
        xa = coef * xa
        y += _dot(DOT, xa[:, None] * x32, S2a)
        yz += xa * tl.sum(x32 * Z2a[None, :], 1)
    return y, yz


@triton.jit
def _quad_grad(x, t0, T, row_stride, G, S, Z, w, V, K: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
               C: tl.constexpr, DOT: tl.constexpr):
    """[C, BK]: y[i, a] = sum_b x_ib (S2[ab] . G_i + Z2[ab] w_i), S2 and Z2 the quadratic rows of the state
    at S and of the normaliser at Z (symmetric in a, b), x = rows t0 .. t0 + C of a (., K) tensor.

    One product per b, G [C, V] times the [V, K] slice S2[. b]^T, scaled by x_b afterwards: no K^2-wide
    tile and no K x K reshape of one (a reshape-and-sum of such a product gives wrong gradients on the H200
    and faults)."""
    G = G.to(DOT)
    y = tl.zeros([C, BK], dtype=tl.float32)
    S2n, Z2n, xn = _pair_block(x, t0, T, row_stride, S, Z, 0, V, K, BK, BV, C)
    for b in range(0, K):
        S2b, Z2b, xb = S2n, Z2n, xn  # S2[b .] = S2[. b]; the next b's rows loaded before this product
        S2n, Z2n, xn = _pair_block(x, t0, T, row_stride, S, Z, tl.minimum(b + 1, K - 1), V, K, BK, BV, C)
        y += xb[:, None] * (_dot(DOT, G, tl.trans(S2b)) + w[:, None] * Z2b[None, :])
    return y


@triton.jit
def _chunk_program(T, H, N, chunk_index, cu_seqlens, P: tl.constexpr, C: tl.constexpr, VARLEN: tl.constexpr):
    """A chunk kernel's program (grid: chunk n, b H + h): b H + h and `states._chunk_at`'s row of its sequence's
    position 0, the sequence's length, the offset of its position 0 in a (B H, T) tensor, the row of its chunk's
    state and its first position."""
    n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    row, T_seq, w_row, state, t0 = _chunk_at(n, pid_bh, T, H, N, chunk_index, cu_seqlens, C, P, VARLEN)
    return pid_bh, row, T_seq, w_row, state, t0


@triton.jit
def _dq_kernel(
    q, k, v, do, states, norms, h_out, g_out, dq, chunk_index, cu_seqlens,
    T, H, V, scale, N,
    K: tl.constexpr, P: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, C: tl.constexpr,
    DOT: tl.constexpr, VARLEN: tl.constexpr,
):
    pid_bh, row, T, w_row, state, t0 = _chunk_program(T, H, N, chunk_index, cu_seqlens, P, C, VARLEN)
    if VARLEN:
        if t0 < 0:
            return
    q, k, dq = q + row * K, k + row * K, dq + row * K
    v, do, g_out = v + row * V, do + row * V, g_out + row * V
    h_out += w_row
    S, Z = states + state * V, norms + state  # S_n

    i_idx = tl.arange(0, C)
    causal = i_idx[:, None] >= i_idx[None, :]  # [i, j]
    vc = tl.arange(0, BV)
    kc = tl.arange(0, BK)
    q_c = _load_rows(q, t0, T, H * K, K, C, BK)
    k_c = _load_rows(k, t0, T, H * K, K, C, BK)
    k_t = tl.trans(k_c)
    k_fin, k_edge = finite_part(k_c, C, False)  # the operand of ds k; s takes k as it is
    v_c, v_edge = finite_part(_load_rows(v, t0, T, H * V, V, C, BV), C, False)
    do_c = _load_rows(do, t0, T, H * V, V, C, BV)
    lin_mask = (kc < K)[:, None] & (vc < V)[None, :]
    S0 = tl.load(S + vc, mask=vc < V, other=0.0).to(tl.float32)
    S1 = tl.load(S + (1 + kc)[:, None] * V + vc[None, :], mask=lin_mask, other=0.0)
    z0 = tl.load(Z)
    z1 = tl.load(Z + 1 + kc, mask=kc < K, other=0.0)

    # num and den of the chunk: read-out of the state before it + the intra-chunk quadratic form
    s = scale * _dot(DOT, q_c, k_t)
    A = tl.where(causal, 1.0 + s + 0.5 * s * s, 0.0)
    num = S0[None, :] + scale * _dot(DOT, q_c, S1) + _dot(DOT, A, v_c)
    den = z0 + scale * tl.sum(q_c.to(tl.float32) * z1[None, :], 1) + tl.sum(A, 1)
    num, den = _quad_readout(num, den, 0.5 * scale * scale, q_c, q, t0, T, H * K, S, Z, V, K, BK, BV, C, DOT)
    num = reached(num, v_edge, C, False)  # through delta and h, every later use of those rows
    r = 1.0 / (den + _EPS)
    delta = r * tl.sum(do_c.to(tl.float32) * num, 1)

    # dq~ = intra-chunk ds k + the state's part S1 g + z1 h + M q~
    g = do_c.to(tl.float32) * r[:, None]
    hn = -r * delta
    # g and h for the reverse scan and dk/dv; g in the matmul operand type, which they would round it to
    tl.store(h_out + t0 + i_idx, hn, mask=t0 + i_idx < T)
    _store_rows(g_out, g, t0, T, H * V, V, C, BV)
    ds = tl.where(causal, (_dot(DOT, g, tl.trans(v_c)) + hn[:, None]) * (1.0 + s), 0.0)
    dqs = _dot(DOT, ds, k_fin) + _dot(DOT, g, tl.trans(S1)) + hn[:, None] * z1[None, :]
    dqs += scale * _quad_grad(q, t0, T, H * K, g, S, Z, hn, V, K, BK, BV, C, DOT)
    dqs = reached(dqs, k_edge, C, False)
    _store_rows(dq, scale * dqs, t0, T, H * K, K, C, BK)


@triton.jit
def _dkdv_kernel(
    q, k, v, g_in, states, norms, h_in, dk, dv, chunk_index, cu_seqlens,
    T, H, V, scale, N,
    K: tl.constexpr, P: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, C: tl.constexpr,
    DOT: tl.constexpr, VARLEN: tl.constexpr,
):
    pid_bh, row, T, w_row, state, t0 = _chunk_program(T, H, N, chunk_index, cu_seqlens, P, C, VARLEN)
    if VARLEN:
        if t0 < 0:
            return
    q, k, dk = q + row * K, k + row * K, dk + row * K
    v, g_in, dv = v + row * V, g_in + row * V, dv + row * V
    h_in += w_row
    dS, dZ = states + state * V, norms + state  # dS_n

    i_idx = tl.arange(0, C)
    causal_t = i_idx[None, :] >= i_idx[:, None]  # [j, i]
    vc = tl.arange(0, BV)
    kc = tl.arange(0, BK)
    q_c = _load_rows(q, t0, T, H * K, K, C, BK)
    q_fin, q_edge = finite_part(q_c, C, True)  # the operand of ds^T q~; s^T takes q as it is
    k_c = _load_rows(k, t0, T, H * K, K, C, BK)
    v_c = _load_rows(v, t0, T, H * V, V, C, BV)
    hn = _load_vec(h_in, t0, T, C)
    g, g_edge = finite_part(_load_rows(g_in, t0, T, H * V, V, C, BV), C, True)
    lin_mask = (kc < K)[:, None] & (vc < V)[None, :]
    dS0 = tl.load(dS + vc, mask=vc < V, other=0.0).to(tl.float32)
    dS1 = tl.load(dS + (1 + kc)[:, None] * V + vc[None, :], mask=lin_mask, other=0.0)
    dz1 = tl.load(dZ + 1 + kc, mask=kc < K, other=0.0)

    # as [j, i]: the chunk's A^T and ds^T
    s_t = scale * _dot(DOT, k_c, tl.trans(q_c))
    a_t = tl.where(causal_t, 1.0 + s_t + 0.5 * s_t * s_t, 0.0)
    ds_t = tl.where(causal_t, (_dot(DOT, v_c, tl.trans(g)) + hn[None, :]) * (1.0 + s_t), 0.0)
    dv_c = _dot(DOT, a_t, g) + dS0[None, :] + _dot(DOT, k_c, dS1)
    dk_c = scale * _dot(DOT, ds_t, q_fin) + _dot(DOT, v_c, tl.trans(dS1)) + dz1[None, :]
    dv_c = _quad_readout(dv_c, tl.zeros([C], dtype=tl.float32), 1.0, k_c, k, t0, T, H * K, dS, dZ, V, K, BK, BV,
                         C, DOT)[0]
    ones = tl.full([C], 1.0, tl.float32)
    dk_c += 2.0 * _quad_grad(k, t0, T, H * K, v_c, dS, dZ, ones, V, K, BK, BV, C, DOT)
    dv_c = reached(dv_c, g_edge, C, True)
    dk_c = reached(dk_c, q_edge, C, True)
    _store_rows(dk, dk_c, t0, T, H * K, K, C, BK)
    _store_rows(dv, dv_c, t0, T, H * V, V, C, BV)


def _chunk_meta(q, states, chunk: int, packing) -> dict:
    """The constexpr arguments of both chunk kernels for q (B, T, H, K) and the (B H, N, P, V) states, V at most
    MAX_V, and packed sequences' `states.Packing` (or None)."""
    K = q.shape[-1]
    P, V = states.shape[2:]
    return dict(K=K, P=P, BK=max(16, K), BV=max(16, triton.next_power_of_2(V)), C=chunk, DOT=operand_type(q.dtype),
                VARLEN=packing is not None)


def _packed(packing) -> tuple:
    """The chunk kernels' chunk_index and cu_seqlens arguments: those of the `states.Packing`, or None."""
    return (packing.chunk_index, packing.cu_seqlens) if packing is not None else (None, None)


def launch_dq(q, k, v, do, states, norms, h, g, dq, scale: float, *, chunk: int, warps: int,
              registers: int | None, packing=None) -> None:
    """dq, and g = r do and the fp32 (B H, T) h for the launches after it, from the forward scan's states and
    norms: one program per (chunk of `chunk` positions, b h) on `warps` warps, ptxas capped at `registers` a
    thread (None: as many as it wants). packing: the `states.Packing` of packed sequences (B = 1), or None."""
    B, T, H, K = q.shape
    BH, N, P, V = states.shape
    _dq_kernel[(N, BH)](q, k, v, do, states, norms, h, g, dq, *_packed(packing), T, H, V, scale, N,
                        **_chunk_meta(q, states, chunk, packing), num_warps=warps, num_stages=1, maxnreg=registers)


def launch_dkdv(q, k, v, g, states, norms, h, dk, dv, scale: float, *, chunk: int, warps: int,
                registers: int | None, packing=None) -> None:
    """dk and dv from the reverse scan's states and norms and `launch_dq`'s g and h, launched as `launch_dq`."""
    B, T, H, K = q.shape
    BH, N, P, V = states.shape
    _dkdv_kernel[(N, BH)](q, k, v, g, states, norms, h, dk, dv, *_packed(packing), T, H, V, scale, N,
                          **_chunk_meta(q, states, chunk, packing), num_warps=warps, num_stages=1, maxnreg=registers)
