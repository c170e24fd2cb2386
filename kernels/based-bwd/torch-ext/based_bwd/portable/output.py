"""The forward's output: one program per (chunk, V tile, b h), after the forward state scan (`states`).

Notation as in reference.py: q~ = scale q, s_ij = q~_i . k_j, A_ij = 1 + s_ij + s_ij^2 / 2 (j <= i). The scan
stores each chunk's start state S_n = sum over earlier chunks of phi_k(K)^T V and its normaliser z_n, in the
packed layout of `states`. A chunk's rows i read it out through the query side of the feature map,
[1, q~_i, q~_i (x) q~_i / 2], and the C x C quadratic form A gives the rest:

    num_i = S0 + q~_i S1 + (q~_i (x) q~_i / 2) S2 + sum_{j <= i in chunk} A_ij v_j,
    den_i = z0 + q~_i . z1 + q~_i^T Z2 q~_i / 2 + sum_{j <= i in chunk} A_ij,
    o_i   = num_i / (den_i + 1e-6),

with S2 the quadratic rows of S_n expanded to all K^2 ordered pairs (both orders of a pair read one packed
row) and Z2 the quadratic rows of z_n as a K x K matrix. The quadratic read-out is one K^2-deep tensor-core
product: q~ (x) q~ is formed in registers as an outer product reshaped to K^2 columns, and S2's K^2 rows are
gathered from the packed state by the load.

A non-finite value at step t reaches no row before t: the C x C product A v takes v's finite part and the rows
from the chunk's first non-finite v on are NaN (`common.finite`); a non-finite k or q reaches the rows that
read it through s, whose masked entries are selected away, not multiplied.

Precision: matmuls take bf16 operands (the inputs', the state's and the features' rounding) with fp32
accumulation, IEEE fp32 for fp32 inputs; s^2 and the normaliser are fp32: den's read-out takes Z2 as a bf16
head plus a bf16 tail against q (exact for bf16 inputs).
"""

import triton
import triton.language as tl

from ..common.finite import finite_part, reached
from .states import _chunk_at, _pair_row
from .tiles import _EPS, _dot, _load_rows, _store_rows, operand_type


@triton.jit
def _outer_rows(x, coef, KK: tl.constexpr, C: tl.constexpr, DOT: tl.constexpr):
    """[C, K^2] in DOT: row i holds coef x_ia x_ib at column a K + b (an fp32 product, rounded), for x [C, K]."""
    x = x.to(tl.float32)
    return tl.reshape((coef * x[:, :, None] * x[:, None, :]).to(DOT), [C, KK])


@triton.jit
def _split_dot(DOT: tl.constexpr, x, Z):
    """x @ Z for x exact in DOT and an fp32 Z, to about 16 bits: Z split into a DOT head and a DOT tail (for
    DOT = fp32 one exact product)."""
    if DOT == tl.float32:
        return _dot(DOT, x, Z)
    head = Z.to(DOT)
    return _dot(DOT, x, head) + _dot(DOT, x, (Z - head.to(tl.float32)).to(DOT))


@triton.jit
def _output_kernel(
    q, k, v, states, norms, o, chunk_index, cu_seqlens,
    T, H, V, scale, N,
    K: tl.constexpr, P: tl.constexpr, BK: tl.constexpr, KK: tl.constexpr, BV: tl.constexpr, C: tl.constexpr,
    DOT: tl.constexpr, VARLEN: tl.constexpr,
):
    """VARLEN: packed sequences (B = 1), program n the chunk `chunk_index[n]` (`states.Packing`)."""
    n = tl.program_id(0)
    pid_v = tl.program_id(1)
    pid_bh = tl.program_id(2)
    row, T, _, state, t0 = _chunk_at(n, pid_bh, T, H, N, chunk_index, cu_seqlens, C, P, VARLEN)
    if VARLEN:
        if t0 < 0:
            return
    q += row * K
    k += row * K
    v += row * V + pid_v * BV
    o += row * V + pid_v * BV
    S = states + state * V + pid_v * BV
    Z = norms + state
    nv = V - pid_v * BV  # columns of this tile inside V

    i_idx = tl.arange(0, C)
    causal = i_idx[:, None] >= i_idx[None, :]
    vc = tl.arange(0, BV)
    kc = tl.arange(0, BK)
    # q, k padded to BK >= 16 features for the scores and the linear block; the quadratic features from the
    # K real ones
    q_c = _load_rows(q, t0, T, H * K, K, C, BK)
    k_c = _load_rows(k, t0, T, H * K, K, C, BK)
    v_c, v_edge = finite_part(_load_rows(v, t0, T, H * V, nv, C, BV), C, False)
    if BK == K:
        q_k = q_c
    else:
        q_k = _load_rows(q, t0, T, H * K, K, C, K)

    # the state: the constant and linear rows, the quadratic rows for every ordered pair (a, b) at a K + b
    S0 = tl.load(S + vc, mask=vc < nv, other=0.0).to(tl.float32)
    S1 = tl.load(S + (1 + kc)[:, None] * V + vc[None, :], mask=(kc < K)[:, None] & (vc < nv)[None, :], other=0.0)
    r2 = tl.arange(0, KK)
    S2 = tl.load(S + _pair_row(r2 // K, r2 % K, K)[:, None] * V + vc[None, :], mask=(vc < nv)[None, :], other=0.0)
    z0 = tl.load(Z)
    z1 = tl.load(Z + 1 + kc, mask=kc < K, other=0.0)
    Z2 = tl.load(Z + _pair_row(kc[:, None], kc[None, :], K), mask=(kc < K)[:, None] & (kc < K)[None, :], other=0.0)

    s = scale * _dot(DOT, q_c, tl.trans(k_c))
    A = tl.where(causal, 1.0 + s + 0.5 * s * s, 0.0)
    q2 = _outer_rows(q_k, 0.5 * scale * scale, KK, C, DOT)
    num = S0[None, :] + scale * _dot(DOT, q_c, S1) + _dot(DOT, q2, S2) + _dot(DOT, A, v_c)
    num = reached(num, v_edge, C, False)
    q32 = q_c.to(tl.float32)
    den = z0 + tl.sum(q32 * (scale * z1[None, :] + (0.5 * scale * scale) * _split_dot(DOT, q_c, Z2)), 1)
    den += tl.sum(A, 1)
    _store_rows(o, num / (den + _EPS)[:, None], t0, T, H * V, nv, C, BV)


def launch(q, k, v, states, norms, o, scale: float, *, chunk: int, bv: int, warps: int, packing=None) -> None:
    """o (B, T, H, V) for q, k (B, T, H, K) and v from the forward scan's states and norms (`states.launch`,
    chunks of `chunk` positions): a program takes up to `bv` V columns of one chunk, on `warps` warps.
    packing: the `states.Packing` of packed sequences (B = 1), or None."""
    B, T, H, K = q.shape
    BH, N, P, V = states.shape
    BV = min(bv, max(16, triton.next_power_of_2(V)))
    index, cu = (packing.chunk_index, packing.cu_seqlens) if packing is not None else (None, None)
    _output_kernel[(N, triton.cdiv(V, BV), BH)](
        q, k, v, states, norms, o, index, cu, T, H, V, scale, N,
        K=K, P=P, BK=max(16, K), KK=K * K, BV=BV, C=chunk, DOT=operand_type(q.dtype), VARLEN=packing is not None,
        num_warps=warps, num_stages=1)
