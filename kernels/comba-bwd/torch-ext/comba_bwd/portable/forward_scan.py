"""The forward scan in Triton, the forward's second stage and the backward's recompute of it: per (b, h, V block),
serial over the chunks, S_n (bf16, the state before chunk n) and Vn = U - W S_n (bf16) -> HBM, so that the
chunk-parallel output and gradient kernels read their chunk's state without a scan of their own. U = A (beta V) and
-W = -A (beta gam P) come from the chunk-parallel stage before it (`scan_terms`, bf16), so that the serial loop is two
products a chunk: Vn = U - W S_n and S_{n+1} = Gam S_n + (K Gam / gam)^T Vn; where `dispatch.Plan.local_terms` says
so (LOCAL_TERMS: a plain call at K = 64, one program holding all of V), the loop forms them from the chunk's A, v and p
with that stage's helpers instead, two products more a chunk in place of U's and W's round trips through HBM. A
model's call starts from a carried
state (HAS_S0) and stores the state after the last chunk in fp32 (STORE_FINAL); sequences packed in a batch of one
(PACKED) take a program per sequence, value head and V block, over that sequence's chunks (`chunk.scan_range`), each
chunk reading its rows of the packed inputs (`chunk.chunk_rows`); fla's read order is W's (`scan_terms`).

A non-finite input at step t reaches no row of Vn before t: U's and W's rows from t on carry it as NaN
(`scan_terms`' helpers, here or in that stage), and Vn's rows with them. The state after the chunk, which sums all of
Vn's rows, is then NaN as well (in the program's V block)."""

import triton
import triton.language as tl

from .chunk import (BT, SCAN_WARPS, call_rows, chunk_a, chunk_rows, group, key_head, load_rows, row_ptrs_t, rows_args,
                    scan_block, scan_chunk, scan_offset, scan_range, scan_stages, state_ptrs)
from .scan_terms import neg_w_term, u_term

@triton.jit
def _forward_step(k, v, p, beta, g, A, W, U, S_out, Vn_out, S, n, bh, scal_base, kb, N, T, H, HK, cv, layout,
                  K: tl.constexpr, V: tl.constexpr, LOCAL_TERMS: tl.constexpr, PACKED: tl.constexpr,
                  MASKED: tl.constexpr):
    """Chunk n of the forward scan: store S_n and Vn = U - W S_n, return S_{n+1}. U and -W are loaded, or formed
    from the chunk's A, v and p where LOCAL_TERMS (`scan_terms.u_term`, `scan_terms.neg_w_term`)."""
    r = tl.arange(0, BT)
    t0, t_end = chunk_rows(layout, n, call_rows(T, N, MASKED), PACKED)
    if not MASKED:
        t_end = None
    gc, glast, bk, gam, chunk = scan_chunk(g, beta, S_out, S, n, bh, scal_base, t0, t_end, N, H, cv, K, V)
    rows = chunk * BT + r
    if LOCAL_TERMS:
        a = chunk_a(A, chunk)
        u = u_term(a, v, bk, scal_base, t0, t_end, cv, H, V)
        w_neg = neg_w_term(a, p, bk, gam, kb * K, t0, t_end, HK * K, K).to(tl.bfloat16)
    else:
        u = tl.load(U + rows[:, None] * V + cv[None, :])
        w_neg = tl.load(W + rows[:, None] * K + tl.arange(0, K)[None, :])
    # The product accumulates into U in place, so that no second [BT, BV] fp32 tile is live.
    Vn = tl.dot(w_neg, S.to(tl.bfloat16), acc=u.to(tl.float32)).to(tl.bfloat16)
    tl.store(Vn_out + rows[:, None] * V + cv[None, :], Vn.to(Vn_out.dtype.element_ty))
    kt = load_rows(row_ptrs_t(k, kb * K, t0, HK * K, K), t0, t_end, TRANSPOSED=True)
    kt_to_end = (kt * tl.exp(glast - gc)[None, :]).to(tl.bfloat16)       # (K * Gam / gam)^T
    return tl.dot(kt_to_end, Vn, acc=tl.exp(glast) * S)


# The scans' loops are pipelined STAGES deep (`chunk.scan_stages`): the next chunk's tiles are copied into shared
# memory while one is computed, and 2 CTAs an SM still fit (at most 115 KB of shared memory each). N and T are not
# specialized: one compile for every T. The gates are loaded with the chunk: loaded a chunk ahead by hand, as the
# Gluon forward scan loads them, they make the reverse scan slower.
@triton.jit(do_not_specialize=["N", "T"])
def _forward_scan_kernel(k, beta, g, W, U, S_out, Vn_out, N, H, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr,
                         STAGES: tl.constexpr, S0=None, S_final=None, cu_chunks=None, T=None, layout=None,
                         GROUP: tl.constexpr = 1, HAS_S0: tl.constexpr = False, STORE_FINAL: tl.constexpr = False,
                         PACKED: tl.constexpr = False, MASKED: tl.constexpr = False, v=None, p=None, A=None,
                         LOCAL_TERMS: tl.constexpr = False):
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
        S = _forward_step(k, v, p, beta, g, A, W, U, S_out, Vn_out, S, n, bh, scal_base, kb, N, T, H, HK, cv, layout,
                          K, V, LOCAL_TERMS, PACKED, MASKED)
    if STORE_FINAL:
        tl.store(state_ptrs(S_final, tl.program_id(1), cv, K, V), S)


def launch(k, v, p, beta, g, A, W, U, S, Vn, initial_state=None, final_state=None, packing=None):
    """S (B * HV, N, K, V) and Vn (B * HV, N * 64, V) on the N chunks of S, of inputs k, p (B, T, H, K),
    v (B, T, HV, V), beta and g (B, T, HV) with HV a multiple of H (T = N * 64, or fewer rows: `transform.launch`),
    from the chunks' terms -W (B * HV, N * 64, K) and U (B * HV, N * 64, V) (`scan_terms`), or, where W and U are
    None (`dispatch.Plan.local_terms`), from their transform A (B * HV, N, 64, 64), v and p, the loop forming the terms
    itself; the scan starts from initial_state (B, HV, K, V) fp32 (None: zeros) and, where final_state is given,
    writes the state after the last chunk there (fp32, like initial_state). With `packing` (`pipeline.Packing`,
    B = 1) the states are (N', HV, K, V), one per sequence of the N' packed, each scanned over its chunks."""
    B, T, HV, V = v.shape
    K = k.shape[-1]
    N = S.shape[1]
    BV = scan_block(K, V)
    terms = {} if W is not None else {"v": v, "p": p, "A": A, "LOCAL_TERMS": True}
    state = {}
    if initial_state is not None:
        state.update(S0=initial_state, HAS_S0=True)
    if final_state is not None:
        state.update(S_final=final_state, STORE_FINAL=True)
    if packing is not None:
        state.update(cu_chunks=packing.cu_chunks)
    grid = (V // BV, B * HV) if packing is None else (V // BV, packing.sequences * HV)
    _forward_scan_kernel[grid](k, beta, g, W, U, S, Vn, N, HV, K=K, V=V, BV=BV, STAGES=scan_stages(k.device, K),
                               **rows_args(T, N, packing), **group(k, beta), **state, **terms, num_warps=SCAN_WARPS,
                               num_stages=1)
