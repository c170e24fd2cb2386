"""The forward scan in Triton, the forward's second stage and the backward's recompute of it: per (b, h, V block),
serial over the chunks, S_n (bf16, the state before chunk n) and Vn = A (beta V) - A (beta gam P) S (bf16) -> HBM, so
that the chunk-parallel output and gradient kernels read their chunk's state without a scan of their own. A model's
call starts from a carried state (HAS_S0) and stores the state after the last chunk in fp32 (STORE_FINAL); sequences
packed in a batch of one (PACKED) take a program per sequence, value head and V block, over that sequence's chunks
(`chunk.scan_range`), each chunk reading its rows of the packed inputs (`chunk.chunk_rows`); fla's read order
(READ_FIRST) takes the read's decay in W.

A non-finite input at step t reaches no row of Vn before t: A's rows from the chunk's first non-finite k, p, beta or
g on are NaN (`transform`), which carries those to Vn's rows; A's products take the finite part of their operands
beta V and beta gam P (`common.finite.finite_part`), and Vn is NaN from beta V's first row holding a non-finite entry
on (`common.finite.reached`: v, the one input A does not see). The state after the chunk, which sums all of Vn's
rows, is then NaN as well (in the program's V block)."""

import triton
import triton.language as tl

from ..common.finite import finite_part, reached
from .chunk import (BT, SCAN_WARPS, call_rows, chunk_rows, group, key_head, load_rows, read_log_decay, row_ptrs,
                    row_ptrs_t, rows_args, scan_block, scan_chunk, scan_offset, scan_range, scan_stages, state_ptrs)

@triton.jit
def _forward_step(k, v, p, beta, g, A, S_out, Vn_out, S, n, bh, scal_base, kb, N, T, H, HK, cv, layout,
                  K: tl.constexpr, V: tl.constexpr, READ_FIRST: tl.constexpr, PACKED: tl.constexpr,
                  MASKED: tl.constexpr):
    """Chunk n of the forward scan: store S_n and Vn, return S_{n+1}. W = A (beta gam P) takes the read's decay:
    exp(gr) in fla's order (READ_FIRST)."""
    r = tl.arange(0, BT)
    t0, t_end = chunk_rows(layout, n, call_rows(T, N, MASKED), PACKED)
    if not MASKED:
        t_end = None
    gc, glast, bk, gam, chunk = scan_chunk(g, beta, S_out, S, n, bh, scal_base, t0, t_end, N, H, cv, K, V)
    if READ_FIRST:
        gam = tl.exp(read_log_decay(g, scal_base, t0, H, gc, READ_FIRST, t_end=t_end))
    a = tl.load(A + chunk * BT * BT + r[:, None] * BT + r[None, :])
    vk = load_rows(v + scal_base * V + (t0 + r)[:, None] * (H * V) + cv[None, :], t0, t_end)
    pk = load_rows(row_ptrs(p, kb * K, t0, HK * K, K), t0, t_end)
    # Both products accumulate into the other term in place, so that no second [BT | K, BV] fp32 tile is live (the
    # scan does not spill at K = 64).
    bv, v_edge = finite_part((vk * bk[:, None]).to(tl.bfloat16), BT, False)
    bp, _ = finite_part((pk * -(bk * gam)[:, None]).to(tl.bfloat16), BT, False)  # rows holding one: NaN in A
    U = tl.dot(a, bv)                                                     # A (beta V)
    W_neg = tl.dot(a, bp)                                                 # -A (beta gam P)
    Vn = tl.dot(W_neg.to(tl.bfloat16), S.to(tl.bfloat16), acc=U)
    Vn = reached(Vn, v_edge, BT, False).to(tl.bfloat16)
    tl.store(Vn_out + (bh.to(tl.int64) * (N * BT) + n * BT + r)[:, None] * V + cv[None, :],
             Vn.to(Vn_out.dtype.element_ty))
    kt = load_rows(row_ptrs_t(k, kb * K, t0, HK * K, K), t0, t_end, TRANSPOSED=True)
    kt_to_end = (kt * tl.exp(glast - gc)[None, :]).to(tl.bfloat16)       # (K * Gam / gam)^T
    return tl.dot(kt_to_end, Vn, acc=tl.exp(glast) * S)


# The scans' loops are pipelined STAGES deep (`chunk.scan_stages`): the next chunk's tiles are copied into shared
# memory while one is computed, and 2 CTAs an SM still fit (at most 115 KB of shared memory each). N and T are not
# specialized: one compile for every T. The gates are loaded with the chunk: loaded a chunk ahead by hand, as the
# Gluon forward scan loads them, they make the reverse scan slower.
@triton.jit(do_not_specialize=["N", "T"])
def _forward_scan_kernel(k, v, p, beta, g, A, S_out, Vn_out, N, H, K: tl.constexpr, V: tl.constexpr,
                         BV: tl.constexpr, STAGES: tl.constexpr, S0=None, S_final=None, cu_chunks=None, T=None,
                         layout=None,
                         GROUP: tl.constexpr = 1, HAS_S0: tl.constexpr = False, STORE_FINAL: tl.constexpr = False,
                         PACKED: tl.constexpr = False, MASKED: tl.constexpr = False, READ_FIRST: tl.constexpr = False):
    iv = tl.program_id(0)
    bh, first, end = scan_range(cu_chunks, N, H, PACKED)
    scal_base = scan_offset(bh, N, T, H, MASKED)
    kb, HK = key_head(scal_base, bh, call_rows(T, N, MASKED), H, GROUP)
    cv = iv * BV + tl.arange(0, BV)
    if HAS_S0:
        S = tl.load(state_ptrs(S0, tl.program_id(1), cv, K, V))
    else:
        S = tl.zeros([K, BV], dtype=tl.float32)
    for n in tl.range(first, end, num_stages=STAGES):
        S = _forward_step(k, v, p, beta, g, A, S_out, Vn_out, S, n, bh, scal_base, kb, N, T, H, HK, cv, layout, K, V,
                          READ_FIRST, PACKED, MASKED)
    if STORE_FINAL:
        tl.store(state_ptrs(S_final, tl.program_id(1), cv, K, V), S)


def launch(k, v, p, beta, g, A, S, Vn, initial_state=None, final_state=None, packing=None, read_first=False):
    """S (B * HV, N, K, V) and Vn (B * HV, N * 64, V) on the N chunks of A, of inputs k, p (B, T, H, K),
    v (B, T, HV, V), beta and g (B, T, HV) with HV a multiple of H (T = N * 64, or fewer rows: `transform.launch`), and
    their transform A; the scan starts from initial_state (B, HV, K, V) fp32 (None: zeros) and, where final_state is
    given, writes the state after the last chunk there (fp32, like initial_state). With `packing`
    (`pipeline.Packing`, B = 1) the states are (N', HV, K, V), one per sequence of the N' packed, each scanned over its
    chunks. read_first: fla's read order."""
    B, T, HV, V = v.shape
    K = k.shape[-1]
    N = A.shape[1]
    BV = scan_block(K, V)
    state = {}
    if initial_state is not None:
        state.update(S0=initial_state, HAS_S0=True)
    if final_state is not None:
        state.update(S_final=final_state, STORE_FINAL=True)
    if packing is not None:
        state.update(cu_chunks=packing.cu_chunks)
    if read_first:
        state.update(READ_FIRST=True)
    grid = (V // BV, B * HV) if packing is None else (V // BV, packing.sequences * HV)
    _forward_scan_kernel[grid](k, v, p, beta, g, A, S, Vn, N, HV, K=K, V=V, BV=BV, STAGES=scan_stages(k.device, K),
                               **rows_args(T, N, packing), **group(k, v),
                               **state, num_warps=SCAN_WARPS, num_stages=1)
