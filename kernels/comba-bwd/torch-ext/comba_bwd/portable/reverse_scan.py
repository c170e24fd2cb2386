"""The reverse scan in Triton: per (b, h, V block), chunks reversed, dS in fp32 registers, dS'_n and dVn of its V
block (bf16) -> HBM, from which the chunk-parallel stages after it make the rest (`adjoint`: X = A^T dVn, dv and
dbeta's v part; `grads`). The chunk-local terms come from the chunk-parallel stage before it (`scan_terms`):
dVlocal = (scale lower(Q K^T) * E)^T dO and -W = -A (beta gam P), so that the loop is three products a chunk,
dVn = dVlocal + (K Gam / gam) dS' and dS = Gam dS' + scale (gam Q)^T dO - W^T dVn. A model's call seeds dS with the
gradient of the final state (HAS_DFINAL) and stores the gradient of the initial state, dS after the first chunk, in
fp32 (STORE_DS0); sequences packed in a batch of one (PACKED) take a program per sequence, value head and V block,
over that sequence's chunks (`chunk.scan_range`), each chunk reading its rows of the packed inputs
(`chunk.chunk_rows`); fla's read order is W's (`scan_terms`)."""

import triton
import triton.language as tl

from .chunk import (BT, SCAN_WARPS, call_rows, chunk_rows, group, key_head, load_rows, row_ptrs, row_ptrs_t,
                    rows_args, scan_block, scan_chunk, scan_offset, scan_range, scan_stages, state_ptrs)

@triton.jit
def _reverse_step(q, k, beta, g, do, W, dv_local, dS_out, dVn_out, dS, n, bh, scal_base, kb, scale, N, T, H, HK, cv,
                  layout, K: tl.constexpr, V: tl.constexpr, PACKED: tl.constexpr, MASKED: tl.constexpr):
    """Chunk n of the reverse scan: store dS'_n and dVn, return the gradient of the state before the chunk."""
    r = tl.arange(0, BT)
    t0, t_end = chunk_rows(layout, n, call_rows(T, N, MASKED), PACKED)
    if not MASKED:
        t_end = None
    gc, glast, _, gam, chunk = scan_chunk(g, beta, dS_out, dS, n, bh, scal_base, t0, t_end, N, H, cv, K, V)
    rows = chunk * BT + r
    kk = load_rows(row_ptrs(k, kb * K, t0, HK * K, K), t0, t_end)
    qt = load_rows(row_ptrs_t(q, kb * K, t0, HK * K, K), t0, t_end, TRANSPOSED=True)
    dok = load_rows(do + scal_base * V + (t0 + r)[:, None] * (H * V) + cv[None, :], t0, t_end).to(tl.bfloat16)
    dvl = tl.load(dv_local + rows[:, None] * V + cv[None, :])
    # Ordered so that few tiles are live at once: dS' in bf16 for dVn, then dS updated in place (fp32).
    dS_b = dS.to(tl.bfloat16)
    dS = tl.dot((qt * (gam * scale)[None, :]).to(tl.bfloat16), dok, acc=tl.exp(glast) * dS)
    dVn = tl.dot((kk * tl.exp(glast - gc)[:, None]).to(tl.bfloat16), dS_b, acc=dvl.to(tl.float32)).to(tl.bfloat16)
    tl.store(dVn_out + rows[:, None] * V + cv[None, :], dVn.to(dVn_out.dtype.element_ty))
    w_t = tl.load(W + rows[None, :] * K + tl.arange(0, K)[:, None])                 # -W^T
    return tl.dot(w_t, dVn, acc=dS)


@triton.jit(do_not_specialize=["N", "T"])
def _reverse_scan_kernel(q, k, beta, g, do, W, dv_local, dS_out, dVn_out, scale, N, H, K: tl.constexpr,
                         V: tl.constexpr, BV: tl.constexpr, STAGES: tl.constexpr, d_final=None, d_initial=None,
                         cu_chunks=None, T=None, layout=None, GROUP: tl.constexpr = 1,
                         HAS_DFINAL: tl.constexpr = False, STORE_DS0: tl.constexpr = False,
                         PACKED: tl.constexpr = False, MASKED: tl.constexpr = False):
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
        dS = _reverse_step(q, k, beta, g, do, W, dv_local, dS_out, dVn_out, dS, end - 1 - i, bh, scal_base, kb,
                           scale, N, T, H, HK, cv, layout, K, V, PACKED, MASKED)
    if STORE_DS0:
        tl.store(state_ptrs(d_initial, tl.program_id(1), cv, K, V), dS)


def launch(q, k, beta, g, do, W, dv_local, dS, dVn, scale: float, d_final=None, d_initial=None, packing=None):
    """dS (B * HV, N, K, V) and dVn (B * HV, N * 64, V) on the N chunks of dS, of inputs q, k (B, T, H, K),
    do (B, T, HV, V), beta and g (B, T, HV) with HV a multiple of H (T = N * 64, or fewer rows: `transform.launch`)
    and the chunks' terms -W (B * HV, N * 64, K) and dv_local (B * HV, N * 64, V) (`scan_terms`). The scan starts
    from d_final, the gradient of the final state (B, HV, K, V) fp32 (None: zeros), and, where d_initial is given,
    writes the gradient of the initial state there (fp32, same shape). With `packing` (packed sequences,
    `forward_scan.launch`) the states are (N', HV, K, V), one per sequence, each scanned over its chunks."""
    B, T, HV, V = do.shape
    K = q.shape[-1]
    N = dS.shape[1]
    BV = scan_block(K, V)
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
                               num_warps=SCAN_WARPS, num_stages=1)
