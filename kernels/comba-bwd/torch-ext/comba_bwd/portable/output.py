"""The forward's output in Triton, chunk-parallel: per (b, h, chunk), O = scale [(gam Q) S_n + (lower(Q K^T) * E) Vn],
from the chunk-start states S_n and the corrected values Vn that the forward scan (`forward_scan`) leaves in HBM. Both
products accumulate into one fp32 [64, V] tile; Q K^T's scale and decay are applied in fp32 ahead of its rounding to
bf16.

A non-finite input at step t reaches no row of O before t: Q K^T takes K's finite part and the product with Vn Vn's
(`common.finite.finite_part`: a masked weight of 0 times a non-finite k_j or Vn_j would reach the rows before j),
and O is NaN from Vn's first row holding a non-finite entry on (`common.finite.reached`), which the forward scan
makes NaN from the chunk's first non-finite k, v, p, beta or g on; a non-finite q reaches its own row.
"""

import triton
import triton.language as tl

from ..common.finite import finite_part, reached
from .chunk import (BT, call_rows, chunk_offsets, decay, gates, group, key_head, load_rows, row_ptrs, row_ptrs_t,
                    rows_args, store_rows)

# Four warps a program, V in blocks of OUTPUT_BLOCK[K] columns: all of V = 64 or 128 in one program at K = 64 and
# 128, so that Q K^T is formed once a chunk: 255 registers (no spill) and 48 KB of shared memory at K = V = 128
# (sm_90a), two CTAs an SM; V blocks of 64 (three CTAs an SM) are slower. Larger V (256, 512) takes V / OUTPUT_BLOCK
# programs a chunk, each forming Q K^T again, with the registers and shared memory of the V = 128 program. At
# K = 256 blocks of 64 keep the (K, block) state tile within the registers (252, no spill, sm_90a), where blocks of
# 128 spill at four warps.
OUTPUT_WARPS = 4
OUTPUT_BLOCK = {64: 128, 128: 128, 256: 64}


@triton.jit
def _output_kernel(q, k, beta, g, S_in, Vn_in, o, scale, N, H, K: tl.constexpr, V: tl.constexpr,
                   BV: tl.constexpr, T=None, layout=None, GROUP: tl.constexpr = 1, PACKED: tl.constexpr = False,
                   MASKED: tl.constexpr = False):
    """O of one chunk's block of BV columns (V // BV programs a chunk, next to each other in the grid), on the
    chunk's rows as `chunk.chunk_rows` finds them (PACKED, MASKED)."""
    scal_base, t0, t_end, chunk, rows = chunk_offsets(N, T, H, layout, V // BV, PACKED, MASKED)
    if not MASKED:
        t_end = None
    kb, HK = key_head(scal_base, tl.program_id(1), call_rows(T, N, MASKED), H, GROUP)
    gc, _, _ = gates(g, beta, scal_base, t0, H, t_end=t_end)
    r = tl.arange(0, BT)
    if BV == V:
        cv = tl.arange(0, V)
    else:
        cv = tl.program_id(0) % (V // BV) * BV + tl.arange(0, BV)
    qk = load_rows(row_ptrs(q, kb * K, t0, HK * K, K), t0, t_end)
    kt, _ = finite_part(load_rows(row_ptrs_t(k, kb * K, t0, HK * K, K), t0, t_end, TRANSPOSED=True), BT, False, True)
    scores = tl.dot(qk.to(tl.bfloat16), kt.to(tl.bfloat16)) * (scale * decay(gc, False, False))  # lower(Q K^T) E
    q_gam = (qk * (scale * tl.exp(gc))[:, None]).to(tl.bfloat16)                       # scale gam Q
    s = tl.load(S_in + (chunk * K + tl.arange(0, K)[:, None]) * V + cv[None, :]).to(tl.bfloat16)
    vn, vn_edge = finite_part(tl.load(Vn_in + rows[:, None] * V + cv[None, :]), BT, False)
    out = tl.dot(q_gam, s)
    out = tl.dot(scores.to(tl.bfloat16), vn.to(tl.bfloat16), acc=out)
    out = reached(out, vn_edge, BT, False)
    store_rows(o + scal_base * V + (t0 + r)[:, None] * (H * V) + cv[None, :], out.to(o.dtype.element_ty), t0, t_end)


def launch(q, k, beta, g, S, Vn, o, scale: float, packing=None):
    """o (B, T, HV, V) of inputs q, k (B, T, H, K), beta and g (B, T, HV) with HV a multiple of H, from the forward
    scan's S (B * HV, N, K, V) and Vn (B * HV, N * 64, V) on N chunks (T = N * 64, or fewer rows: `transform.launch`;
    with `packing`, packed sequences)."""
    B, T, HV, V = o.shape
    N = S.shape[1]
    K = q.shape[-1]
    BV = min(V, OUTPUT_BLOCK[K])
    _output_kernel[(N * (V // BV), B * HV)](q, k, beta, g, S, Vn, o, scale, N, HV, K=K, V=V, BV=BV,
                                            **rows_args(T, N, packing), **group(q, o), num_warps=OUTPUT_WARPS,
                                            num_stages=1)
