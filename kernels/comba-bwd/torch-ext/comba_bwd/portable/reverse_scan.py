"""The reverse scan in Triton: per (b, h, V block), chunks reversed, dS in fp32 registers, dS'_n and dVn of its V
block (bf16) -> HBM, from which the chunk-parallel stages after it make the rest (`adjoint`: X = A^T dVn, dv and
dbeta's v part; `grads`). The chunk-local terms come from the chunk-parallel stage before it (`scan_terms`):
dVlocal = (scale lower(Q K^T) * E)^T dO and -W = -A (beta gam P), so that the loop is three products a chunk,
dVn = dVlocal + (K Gam / gam) dS' and dS = Gam dS' + scale (gam Q)^T dO - W^T dVn. Where `dispatch.Plan.local_terms`
says so (LOCAL_TERMS: a plain call at K = 64, one program holding all of V), the loop forms dVlocal and -W^T (apart
from dS', so that dS waits on one product after dVn) from the chunk's q, k, p and A with `scan_terms`' helpers, and
stores X = A^T dVn in place of dVn, with dv and dbeta's v part where the gradient kernel does not make them
(V_ADJOINT; `adjoint.chunk_adjoint`): neither chunk-parallel stage runs. A model's call seeds dS with the
gradient of the final state (HAS_DFINAL) and stores the gradient of the initial state, dS after the first chunk, in
fp32 (STORE_DS0); sequences packed in a batch of one (PACKED) take a program per sequence, value head and V block,
over that sequence's chunks (`chunk.scan_range`), each chunk reading its rows of the packed inputs
(`chunk.chunk_rows`); fla's read order is W's (`scan_terms`)."""

import triton
import triton.language as tl

from .adjoint import chunk_adjoint
from .chunk import (BT, SCAN_WARPS, call_rows, chunk_a, chunk_rows, group, key_head, load_rows, part_rows, row_ptrs,
                    row_ptrs_t, rows_args, scan_block, scan_chunk, scan_offset, scan_range, scan_stages, state_ptrs)
from .scan_terms import local_scores_t, neg_w_term

@triton.jit
def _reverse_step(q, k, v, p, beta, g, do, A, W, dv_local, dS_out, dVn_out, X_out, dv, dbeta_v, dS, n, bh, scal_base,
                  kb, scale, N, T, H, HK, cv, layout, K: tl.constexpr, V: tl.constexpr, LOCAL_TERMS: tl.constexpr,
                  V_ADJOINT: tl.constexpr, PACKED: tl.constexpr, MASKED: tl.constexpr):
    """Chunk n of the reverse scan: store dS'_n and dVn, return the gradient of the state before the chunk. Where
    LOCAL_TERMS, dVlocal and -W^T are formed from the chunk's q, k, p and A (`scan_terms.local_scores_t`,
    `scan_terms.neg_w_term`) rather than loaded, and X = A^T dVn is stored in place of dVn, with dv and dbeta's v part
    where V_ADJOINT (`adjoint.chunk_adjoint`: the program holds all of V)."""
    r = tl.arange(0, BT)
    t0, t_end = chunk_rows(layout, n, call_rows(T, N, MASKED), PACKED)
    if not MASKED:
        t_end = None
    gc, glast, bk, gam, chunk = scan_chunk(g, beta, dS_out, dS, n, bh, scal_base, t0, t_end, N, H, cv, K, V)
    rows = chunk * BT + r
    kk = load_rows(row_ptrs(k, kb * K, t0, HK * K, K), t0, t_end)
    qt = load_rows(row_ptrs_t(q, kb * K, t0, HK * K, K), t0, t_end, TRANSPOSED=True)
    dok = load_rows(do + scal_base * V + (t0 + r)[:, None] * (H * V) + cv[None, :], t0, t_end).to(tl.bfloat16)
    if not LOCAL_TERMS:
        dvl = tl.load(dv_local + rows[:, None] * V + cv[None, :])
    # Ordered so that few tiles are live at once: dS' in bf16 for dVn, then dS updated in place (fp32).
    dS_b = dS.to(tl.bfloat16)
    if LOCAL_TERMS:
        scores_t = local_scores_t(tl.dot(kk.to(tl.bfloat16), qt.to(tl.bfloat16)), gc, scale)
    dS = tl.dot((qt * (gam * scale)[None, :]).to(tl.bfloat16), dok, acc=tl.exp(glast) * dS)
    if LOCAL_TERMS:
        dVn = tl.dot(scores_t, dok, acc=tl.dot((kk * tl.exp(glast - gc)[:, None]).to(tl.bfloat16), dS_b))
        # -W^T formed apart from dS', so that dS waits on one product after dVn.
        a_t = chunk_a(A, chunk, TRANSPOSED=True)
        w_t = neg_w_term(a_t, p, bk, gam, kb * K, t0, t_end, HK * K, K, TRANSPOSED=True).to(tl.bfloat16)
        dVn = dVn.to(tl.bfloat16)  # after -W^T: this order compiles to the faster schedule
    else:
        dVn = tl.dot((kk * tl.exp(glast - gc)[:, None]).to(tl.bfloat16), dS_b, acc=dvl.to(tl.float32)).to(tl.bfloat16)
        tl.store(dVn_out + rows[:, None] * V + cv[None, :], dVn.to(dVn_out.dtype.element_ty))
        w_t = tl.load(W + rows[None, :] * K + tl.arange(0, K)[:, None])                 # -W^T
    dS = tl.dot(w_t, dVn, acc=dS)
    if LOCAL_TERMS:
        v_x = chunk_adjoint(a_t, dVn, bk, v, X_out, dv, scal_base, t0, t_end, rows, cv, H, V, V_ADJOINT)
        if V_ADJOINT:
            tl.store(dbeta_v + part_rows(scal_base + (t0 + r) * H, rows, MASKED), v_x)
    return dS


@triton.jit(do_not_specialize=["N", "T"])
def _reverse_scan_kernel(q, k, beta, g, do, W, dv_local, dS_out, dVn_out, scale, N, H, K: tl.constexpr,
                         V: tl.constexpr, BV: tl.constexpr, STAGES: tl.constexpr, d_final=None, d_initial=None,
                         cu_chunks=None, T=None, layout=None, GROUP: tl.constexpr = 1,
                         HAS_DFINAL: tl.constexpr = False, STORE_DS0: tl.constexpr = False,
                         PACKED: tl.constexpr = False, MASKED: tl.constexpr = False, v=None, p=None, A=None, X_out=None,
                         dv=None, dbeta_v=None, LOCAL_TERMS: tl.constexpr = False, V_ADJOINT: tl.constexpr = False):
    iv = tl.program_id(0)
    bh, first, end = scan_range(cu_chunks, N, H, PACKED)
    scal_base = scan_offset(bh, N, T, H, MASKED)
    kb, HK = key_head(scal_base, bh, call_rows(T, N, MASKED), H, GROUP)
    cv = iv * BV + tl.arange(0, BV)
    if HAS_DFINAL:
        dS = tl.load(state_ptrs(d_final, tl.program_id(1), cv, K, V))
    else:
        dS = tl.zeros([K, BV], dtype=tl.float32)
    for i in tl.range(0, end - first, num_stages=STAGES):  # chunks end - 1 down to first
        dS = _reverse_step(q, k, v, p, beta, g, do, A, W, dv_local, dS_out, dVn_out, X_out, dv, dbeta_v, dS,
                           end - 1 - i, bh, scal_base, kb, scale, N, T, H, HK, cv, layout, K, V, LOCAL_TERMS,
                           V_ADJOINT, PACKED, MASKED)
    if STORE_DS0:
        tl.store(state_ptrs(d_initial, tl.program_id(1), cv, K, V), dS)


def launch(q, k, v, p, beta, g, do, A, W, dv_local, dS, dVn, X, dv, dbeta_v, scale: float, v_adjoint: bool,
           d_final=None, d_initial=None, packing=None):
    """dS (B * HV, N, K, V) on the N chunks of dS, of inputs q, k, p (B, T, H, K), v, do (B, T, HV, V), beta and g
    (B, T, HV) with HV a multiple of H (T = N * 64, or fewer rows: `transform.launch`), and either dVn
    (B * HV, N * 64, V) from the chunks' terms -W (B * HV, N * 64, K) and dv_local (B * HV, N * 64, V)
    (`scan_terms`; the `adjoint` stage makes the rest), or, where W is None (`dispatch.Plan.local_terms`: one program
    holds all of V), what the adjoint stage would make from the terms the loop forms from A (B * HV, N, 64, 64): X
    (like dVn) and, where v_adjoint, dv like v and dbeta's v part dbeta_v (1, B, N * 64, HV) (`chunk.part_rows`). The
    scan starts from d_final, the gradient of the final state (B, HV, K, V) fp32 (None: zeros), and, where d_initial
    is given, writes the gradient of the initial state there (fp32, same shape). With `packing` (packed sequences,
    `forward_scan.launch`) the states are (N', HV, K, V), one per sequence, each scanned over its chunks."""
    B, T, HV, V = do.shape
    K = q.shape[-1]
    N = dS.shape[1]
    BV = scan_block(K, V)
    terms = {}
    if W is None:
        assert BV == V, "the local terms' adjoint takes all of V in one program"
        terms.update(v=v, p=p, A=A, X_out=X, LOCAL_TERMS=True)
        if v_adjoint:
            terms.update(dv=dv, dbeta_v=dbeta_v, V_ADJOINT=True)
    state = {}
    if d_final is not None:
        state.update(d_final=d_final, HAS_DFINAL=True)
    if d_initial is not None:
        state.update(d_initial=d_initial, STORE_DS0=True)
    if packing is not None:
        state.update(cu_chunks=packing.cu_chunks)
    grid = (V // BV, B * HV) if packing is None else (V // BV, packing.sequences * HV)
    _reverse_scan_kernel[grid](q, k, beta, g, do, W, dv_local, dS, dVn, scale, N, HV, K=K, V=V, BV=BV,
                               STAGES=scan_stages(q.device, K), **rows_args(T, N, packing), **group(q, do), **state,
                               **terms, num_warps=SCAN_WARPS, num_stages=1)
