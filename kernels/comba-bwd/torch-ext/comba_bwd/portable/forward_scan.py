"""The forward scan in Triton, the forward's second stage and the backward's recompute of it: per (b, h, V block),
serial over the chunks, S_n (bf16, the state before chunk n) and Vn = A (beta V) - A (beta gam P) S (bf16) -> HBM, so
that the chunk-parallel output and gradient kernels read their chunk's state without a scan of their own."""

import triton
import triton.language as tl

from ..reference import CHUNK
from .chunk import BT, SCAN_WARPS, row_ptrs, row_ptrs_t, scan_block, scan_chunk, scan_stages

@triton.jit
def _forward_step(k, v, p, beta, g, A, S_out, Vn_out, S, n, bh, scal_base, N, H, cv, K: tl.constexpr,
                  V: tl.constexpr):
    """Chunk n of the forward scan: store S_n and Vn, return S_{n+1}."""
    T = N * BT
    r = tl.arange(0, BT)
    t0, gc, glast, bk, gam, chunk = scan_chunk(g, beta, S_out, S, n, bh, scal_base, N, H, cv, K, V)
    a = tl.load(A + chunk * BT * BT + r[:, None] * BT + r[None, :])
    vk = tl.load(v + scal_base * V + (t0 + r)[:, None] * (H * V) + cv[None, :])
    pk = tl.load(row_ptrs(p, scal_base * K, t0, H * K, K))
    # Both products accumulate into the other term in place, so that no second [BT | K, BV] fp32 tile is live (the
    # scan does not spill at K = 64).
    U = tl.dot(a, (vk * bk[:, None]).to(tl.bfloat16))                      # A (beta V)
    W_neg = tl.dot(a, (pk * -(bk * gam)[:, None]).to(tl.bfloat16))         # -A (beta gam P)
    Vn = tl.dot(W_neg.to(tl.bfloat16), S.to(tl.bfloat16), acc=U).to(tl.bfloat16)
    tl.store(Vn_out + (bh.to(tl.int64) * T + t0 + r)[:, None] * V + cv[None, :], Vn.to(Vn_out.dtype.element_ty))
    kt = tl.load(row_ptrs_t(k, scal_base * K, t0, H * K, K))
    kt_to_end = (kt * tl.exp(glast - gc)[None, :]).to(tl.bfloat16)       # (K * Gam / gam)^T
    return tl.dot(kt_to_end, Vn, acc=tl.exp(glast) * S)


# The scans' loops are pipelined STAGES deep (`chunk.scan_stages`): the next chunk's tiles are copied into shared
# memory while one is computed, and 2 CTAs an SM still fit (at most 115 KB of shared memory each). N is not
# specialized: one compile for every T. The gates are loaded with the chunk: loaded a chunk ahead by hand, as the
# Gluon forward scan loads them, they make the reverse scan slower.
@triton.jit(do_not_specialize=["N"])
def _forward_scan_kernel(k, v, p, beta, g, A, S_out, Vn_out, N, H, K: tl.constexpr, V: tl.constexpr,
                         BV: tl.constexpr, STAGES: tl.constexpr):
    iv, bh = tl.program_id(0), tl.program_id(1)
    scal_base = (bh // H).to(tl.int64) * N * BT * H + bh % H
    cv = iv * BV + tl.arange(0, BV)
    S = tl.zeros([K, BV], dtype=tl.float32)
    for n in tl.range(0, N, num_stages=STAGES):
        S = _forward_step(k, v, p, beta, g, A, S_out, Vn_out, S, n, bh, scal_base, N, H, cv, K, V)


def launch(k, v, p, beta, g, A, S, Vn):
    """S (BH, N, K, V) and Vn (BH, T, V) of inputs (B, T, H, *) with T a multiple of the chunk and their transform A."""
    B, T, H, K = k.shape
    V = v.shape[-1]
    BV = scan_block(K, V)
    _forward_scan_kernel[(V // BV, B * H)](k, v, p, beta, g, A, S, Vn, T // CHUNK, H, K=K, V=V, BV=BV,
                                           STAGES=scan_stages(k.device), num_warps=SCAN_WARPS, num_stages=1)
