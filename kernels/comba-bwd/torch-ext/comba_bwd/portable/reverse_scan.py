"""The reverse scan in Triton: per (b, h, V block), chunks reversed, dS in fp32 registers, dS'_n (bf16) -> HBM and
the chunk transform's adjoint X = A^T dVn of its V block (bf16), with dv = beta X and the block's part of sum_v(v X)
(fp32) where the gradient kernel does not make them; dVn never leaves registers. The one solve of the adjoint is this
transposed one: A^T dW = -X S^T, dL = -strict_lower(X Vn^T) and W^T dVn = (beta gam P)^T X follow from X, so no
second solve and no A^T dA A^T product. A model's call seeds dS with the gradient of the final state (HAS_DFINAL)
and stores the gradient of the initial state, dS after the first chunk, in fp32 (STORE_DS0); sequences packed in a
batch of one (PACKED) take a program per sequence, value head and V block, over that sequence's chunks
(`chunk.scan_range`), each chunk reading and writing its rows of the packed tensors (`chunk.chunk_rows`); fla's read
order (READ_FIRST) takes the read's decay in W."""

import triton
import triton.language as tl

from .chunk import (BT, SCAN_WARPS, call_rows, chunk_rows, decay, group, key_head, load_rows, part_rows, part_stride,
                    read_log_decay, row_ptrs, row_ptrs_t, rows_args, scan_block, scan_chunk, scan_offset, scan_range, scan_stages,
                    state_ptrs, store_rows)

@triton.jit
def _reverse_step(q, k, v, p, beta, g, do, A, dS_out, X_out, dv, dbeta_v, dS, n, bh, iv, scal_base, kb, scale, N,
                  T, H, HK, cv, layout, K: tl.constexpr, V: tl.constexpr, W_FIRST: tl.constexpr,
                  V_ADJOINT: tl.constexpr, PACKED: tl.constexpr, MASKED: tl.constexpr, READ_FIRST: tl.constexpr):
    """Chunk n of the reverse scan: store dS'_n, X = A^T dVn and, where V_ADJOINT, dv and this V block's part of
    sum_v(v X) (else the gradient kernel makes them from X); return the gradient of the state before the chunk."""
    r = tl.arange(0, BT)
    t0, t_end = chunk_rows(layout, n, call_rows(T, N, MASKED), PACKED)
    if not MASKED:
        t_end = None
    gc, glast, bk, gam, chunk = scan_chunk(g, beta, dS_out, dS, n, bh, scal_base, t0, t_end, N, H, cv, K, V)
    kk = load_rows(row_ptrs(k, kb * K, t0, HK * K, K), t0, t_end)
    qt = load_rows(row_ptrs_t(q, kb * K, t0, HK * K, K), t0, t_end, TRANSPOSED=True)
    dok = load_rows(do + scal_base * V + (t0 + r)[:, None] * (H * V) + cv[None, :], t0, t_end).to(tl.bfloat16)
    # dVn = (scale lower(Q K^T) * E)^T dO + (K * Gam / gam) dS'
    # Ordered so that few tiles are live at once: dS' in bf16 for dVn, then dS updated in place (fp32).
    dS_b = dS.to(tl.bfloat16)
    scores_t = (tl.dot(kk.to(tl.bfloat16), qt.to(tl.bfloat16)) * scale * decay(gc, True, False)).to(tl.bfloat16)
    dS = tl.dot((qt * (gam * scale)[None, :]).to(tl.bfloat16), dok, acc=tl.exp(glast) * dS)
    dVn = tl.dot(scores_t, dok, acc=tl.dot((kk * tl.exp(glast - gc)[:, None]).to(tl.bfloat16), dS_b))
    # dS = Gam dS' + scale (gam Q)^T dO - W^T dVn, with W = A (beta gam P). Where this program holds all of V
    # (W_FIRST), -W^T is formed apart from dS' as -(beta gam P)^T A^T, and dS waits on one product after dVn;
    # else W^T dVn = (beta gam P)^T X, which spares the V blocks' programs a product each of them would repeat.
    # Each form is the faster one where it is taken.
    a_t = tl.load(A + chunk * BT * BT + r[None, :] * BT + r[:, None])              # A^T
    if READ_FIRST:  # W takes the read's decay
        gam = tl.exp(read_log_decay(g, scal_base, t0, H, gc, READ_FIRST, t_end=t_end))
    if W_FIRST:
        pt = load_rows(row_ptrs_t(p, kb * K, t0, HK * K, K), t0, t_end, TRANSPOSED=True)
        w_t = tl.dot((pt * -(bk * gam)[None, :]).to(tl.bfloat16), a_t).to(tl.bfloat16)   # -W^T
        dVn = dVn.to(tl.bfloat16)  # after -W^T: this order compiles to the faster schedule
        dS = tl.dot(w_t, dVn, acc=dS)
    else:
        dVn = dVn.to(tl.bfloat16)
    # The chunk transform's adjoint on this V block: X = A^T dVn, dv = beta X, dbeta's v part.
    X = tl.dot(a_t, dVn)
    tl.store(X_out + (bh.to(tl.int64) * (N * BT) + n * BT + r)[:, None] * V + cv[None, :],
             X.to(X_out.dtype.element_ty))
    if V_ADJOINT:
        vk = load_rows(v + scal_base * V + (t0 + r)[:, None] * (H * V) + cv[None, :], t0, t_end).to(tl.float32)
        store_rows(dv + scal_base * V + (t0 + r)[:, None] * (H * V) + cv[None, :],
                   (bk[:, None] * X).to(dv.dtype.element_ty), t0, t_end)
        parts = part_rows(scal_base + (t0 + r) * H, bh.to(tl.int64) * (N * BT) + n * BT + r, MASKED)
        tl.store(dbeta_v + iv * part_stride(N * BT, H, PACKED) + parts, tl.sum(vk * X, 1))
    if not W_FIRST:
        pt = load_rows(row_ptrs_t(p, kb * K, t0, HK * K, K), t0, t_end, TRANSPOSED=True)
        dS = tl.dot((pt * -(bk * gam)[None, :]).to(tl.bfloat16), X.to(tl.bfloat16), acc=dS)
    return dS


@triton.jit(do_not_specialize=["N", "T"])
def _reverse_scan_kernel(q, k, v, p, beta, g, do, A, dS_out, X_out, dv, dbeta_v, scale, N, H, K: tl.constexpr,
                         V: tl.constexpr, BV: tl.constexpr, STAGES: tl.constexpr, V_ADJOINT: tl.constexpr,
                         d_final=None, d_initial=None, cu_chunks=None, T=None, layout=None, GROUP: tl.constexpr = 1,
                         HAS_DFINAL: tl.constexpr = False, STORE_DS0: tl.constexpr = False,
                         PACKED: tl.constexpr = False, MASKED: tl.constexpr = False, READ_FIRST: tl.constexpr = False):
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
        dS = _reverse_step(q, k, v, p, beta, g, do, A, dS_out, X_out, dv, dbeta_v, dS, end - 1 - i, bh, iv,
                           scal_base, kb, scale, N, T, H, HK, cv, layout, K, V, BV == V, V_ADJOINT, PACKED, MASKED,
                           READ_FIRST)
    if STORE_DS0:
        tl.store(state_ptrs(d_initial, tl.program_id(1), cv, K, V), dS)


def launch(q, k, v, p, beta, g, do, A, dS, X, dv, dbeta_v, scale: float, v_adjoint: bool, d_final=None,
           d_initial=None, packing=None, read_first=False):
    """dS (B * HV, N, K, V) and X (B * HV, N * 64, V) on the N chunks of A, of inputs q, k, p (B, T, H, K),
    v, do (B, T, HV, V), beta and g (B, T, HV) with HV a multiple of H (T = N * 64, or fewer rows:
    `transform.launch`), their transform A; and, where v_adjoint, dv like v and dbeta's v parts dbeta_v
    (V // scan_block(K, V), B, N * 64, HV) (`chunk.part_rows`). The scan starts from d_final, the gradient of the final state
    (B, HV, K, V) fp32 (None: zeros), and, where d_initial is given, writes the gradient of the initial state there
    (fp32, same shape). With `packing` (packed sequences, `forward_scan.launch`) the states are (N', HV, K, V), one
    per sequence, each scanned over its chunks. read_first: fla's read order."""
    B, T, HV, V = v.shape
    K = q.shape[-1]
    N = A.shape[1]
    BV = scan_block(K, V)
    state = {}
    if d_final is not None:
        state.update(d_final=d_final, HAS_DFINAL=True)
    if d_initial is not None:
        state.update(d_initial=d_initial, STORE_DS0=True)
    if packing is not None:
        state.update(cu_chunks=packing.cu_chunks)
    if read_first:
        state.update(READ_FIRST=True)
    grid = (V // BV, B * HV) if packing is None else (V // BV, packing.sequences * HV)
    _reverse_scan_kernel[grid](q, k, v, p, beta, g, do, A, dS, X, dv, dbeta_v, scale, N, HV, K=K, V=V, BV=BV,
                               STAGES=scan_stages(q.device, K), V_ADJOINT=v_adjoint, **rows_args(T, N, packing),
                               **group(q, v), **state, num_warps=SCAN_WARPS, num_stages=1)
