"""The gradients in Triton, chunk-parallel: dq, dk, dp and dbeta by three parts (`_q_part`, `_k_part`, `_pb_part`)
that run side by side as three programs a chunk, each with its terms of d gc (fp32 scratch), from which the next stage
(`dg`) makes dg. The parts loop over V in blocks, accumulating their products over V in fp32, so that no whole (K, V)
state or [64, V] tile is live at once."""

import triton
import triton.language as tl

from .chunk import (BT, call_rows, chunk_offsets, decay, gates, group, key_head, load_rows, part_rows, part_stride, read_log_decay,
                    row_ptrs, rows_args, store_rows)

# The gradient parts run GRADS_WARPS[K] warps a program and loop over V in blocks of V_BLOCK[K]. At K = 64 and 128,
# 4 warps, faster than 8 capped at 128 registers for 2 CTAs an SM, and blocks of 64. At K = 256 the parts' [64, K]
# fp32 accumulators (dO S^T, Vn dS'^T, X S^T) take 8 warps not to spill, and blocks of 32 keep the pipelined V loop
# within the 99 KB a CTA has on sm_86, sm_89 and sm_120 (blocks of 64 take 112 KB).
GRADS_WARPS = {64: 4, 128: 4, 256: 8}
V_BLOCK = {64: 64, 128: 64, 256: 32}

# The gradient kernel's register cap by K. At K = 64 its shared memory (64 KB) lets 3 CTAs share an SM if each
# takes at most 168 registers, which is faster though it spills more (a cap of 200, still 2 CTAs an SM, is
# slower than none). At K = 128 its 80 KB allow 2 CTAs whatever the cap, and a cap of 168 spills heavily; K = 256
# (8 warps) is uncapped.
GRADS_MAXNREG = {64: 168, 128: None, 256: None}

@triton.jit
def _state_t(state, chunk, cv, K: tl.constexpr, V: tl.constexpr):
    """The [BV, K] block (columns cv of the chunk's (K, V) state, transposed) of S_n or dS'_n."""
    return tl.load(state + (chunk * K + tl.arange(0, K)[None, :]) * V + cv[:, None])


# The V loops of the gradient parts are pipelined GRADS_V_STAGES deep (the next V block's tiles copied while
# one is multiplied).
GRADS_V_STAGES = tl.constexpr(2)


@triton.jit
def _q_part(q, k, do, S_in, Vn_in, dq, gc, scal_base, kb, t0, t_end, chunk, rows, scale, H, HK, K: tl.constexpr,
            V: tl.constexpr, BV: tl.constexpr):
    """dq = scale [gam (dO S^T) + (lower(dO Vn^T) * E) K] (stored) and its term of d gc, q . dq."""
    do_s = tl.zeros([BT, K], dtype=tl.float32)
    do_vn = tl.zeros([BT, BT], dtype=tl.float32)
    for v0 in tl.range(0, V, BV, num_stages=GRADS_V_STAGES):
        cv = v0 + tl.arange(0, BV)
        dok = load_rows(do + scal_base * V + (t0 + tl.arange(0, BT))[:, None] * (H * V) + cv[None, :], t0,
                        t_end).to(tl.bfloat16)
        do_s += tl.dot(dok, _state_t(S_in, chunk, cv, K, V))
        do_vn += tl.dot(dok, tl.load(Vn_in + rows[None, :] * V + cv[:, None]))
    qk = load_rows(row_ptrs(q, kb * K, t0, HK * K, K), t0, t_end)
    kk = load_rows(row_ptrs(k, kb * K, t0, HK * K, K), t0, t_end).to(tl.bfloat16)
    dq_c = tl.dot((do_vn * decay(gc, False, False) * scale).to(tl.bfloat16), kk,
                  acc=(scale * tl.exp(gc))[:, None] * do_s)
    store_rows(row_ptrs(dq, scal_base * K, t0, H * K, K), dq_c.to(dq.dtype.element_ty), t0, t_end)
    return tl.sum(qk.to(tl.float32) * dq_c, 1)


@triton.jit
def _k_part(q, k, p, do, dS_in, Vn_in, X_in, dk, gc, gr, glast, bk, scal_base, kb, t0, t_end, chunk, rows, scale, H,
            HK, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, READ_FIRST: tl.constexpr):
    """dk = scale (lower(dO Vn^T) * E)^T Q + (Gam / gam) Vn dS'^T + dR^T (beta P), with dR = dL * E and
    dL = -strict_lower(X Vn^T) (the chunk transform's K side; in fla's order, READ_FIRST, dR = dL * exp(gr_i - gc_j),
    gr the read's log-decay), stored; returns its terms of d gc."""
    vn_do = tl.zeros([BT, BT], dtype=tl.float32)                                # (dO Vn^T)^T
    vn_x = tl.zeros([BT, BT], dtype=tl.float32)                                 # (X Vn^T)^T
    vn_ds = tl.zeros([BT, K], dtype=tl.float32)
    for v0 in tl.range(0, V, BV, num_stages=GRADS_V_STAGES):
        cv = v0 + tl.arange(0, BV)
        vn = tl.load(Vn_in + rows[:, None] * V + cv[None, :])
        do_t = load_rows(do + scal_base * V + (t0 + tl.arange(0, BT))[None, :] * (H * V) + cv[:, None], t0, t_end,
                         TRANSPOSED=True)
        vn_do += tl.dot(vn, do_t.to(tl.bfloat16))
        vn_x += tl.dot(vn, tl.load(X_in + rows[None, :] * V + cv[:, None]))
        vn_ds += tl.dot(vn, _state_t(dS_in, chunk, cv, K, V))
    # The [BT, BT] products weighted by the decay and rounded to bf16 first, so that the fp32 ones die before
    # the [BT, K] work. The read part's is scaled before the rounding, as in _q_part: then (dO Vn^T * E * scale)
    # is rounded to the same bf16 values on both sides, and their terms of d gc (q . dq against k . dk, which
    # nearly cancel) keep cancelling; scaled on one side only, dg's error is about three times larger. Scaled
    # before the rounding, the read part accumulates into dk in place, which with _pb_part's dL * L from dLE keeps
    # the gradient kernel's spill small.
    r = tl.arange(0, BT)
    E_t = decay(gc, True, False)
    read = (vn_do * E_t * scale).to(tl.bfloat16)
    if READ_FIRST:  # L's decay, exp(gr_b - gc_a) for b > a
        E_t = decay(gc, True, True, gr)
    dR_t = tl.where(r[:, None] < r[None, :], -vn_x * E_t, 0.0).to(tl.bfloat16)
    qk = load_rows(row_ptrs(q, kb * K, t0, HK * K, K), t0, t_end).to(tl.bfloat16)
    kk = load_rows(row_ptrs(k, kb * K, t0, HK * K, K), t0, t_end).to(tl.bfloat16)
    # The gate terms of d gc take k . dk of the state part and of the read part; the read part's as
    # sum_i read_ji (k_j . q_i), from a [BT, BT] product, so that no fp32 copy of k stays live.
    k_read = tl.sum(read.to(tl.float32) * tl.dot(kk, tl.trans(qk)), 1)
    # One [BT, K] tile, accumulated in place: the state part, the read part, the transform's K side.
    dk_c = tl.exp(glast - gc)[:, None] * vn_ds
    k_state = tl.sum(kk.to(tl.float32) * dk_c, 1)
    dk_c = tl.dot(read, qk, acc=dk_c)
    pk = load_rows(row_ptrs(p, kb * K, t0, HK * K, K), t0, t_end)
    dk_c = tl.dot(dR_t, (pk * bk[:, None]).to(tl.bfloat16), acc=dk_c)
    store_rows(row_ptrs(dk, scal_base * K, t0, H * K, K), dk_c.to(dk.dtype.element_ty), t0, t_end)
    # The chunk's total of k_state is summed as a [1, BT] row into a [1] tensor: a reduction to a scalar of a value
    # read from tensor memory fails Triton 3.6's TMEM layout pass for sm_100a ("parent layout must have at least
    # rank >= 2"), while for sm_90a both forms compile to the same code.
    return tl.where(r == BT - 1, tl.sum(tl.reshape(k_state, [1, BT]), 1), 0.0) - k_read - k_state


@triton.jit
def _store_dp_dbeta(x_s, dLE, kk, pk, pk_kt, gr, bk, dbeta_v, dp_rows, dbeta, rows_h, t0, t_end, parts, n_pos,
                    NV: tl.constexpr):
    """The transform's P side: dp = beta (gam Y + dLE K) with Y = A^T dW = -X S^T (x_s = X S^T, fp32) and
    dLE = dL * E (bf16), and dbeta = p . (gam Y + dLE K) plus dbeta's v parts (dbeta_v, NV of them,
    n_pos apart, the chunk's at `parts`, `chunk.part_rows`); stores both on the chunk's rows from t0 (dbeta's at
    rows_h, `chunk.store_rows`) and returns dbeta's gate term of the read's log-decay, beta gam (p . Y). gam is exp(gr),
    the read's decay (gc in the spec's order). p . (dLE K) is taken as sum_j dLE_ij (p_i . k_j) from pk_kt = P K^T
    (fp32), so that no fp32 copy of P stays live."""
    z = -tl.exp(gr)[:, None] * x_s
    p_y = tl.sum(pk.to(tl.float32) * z, 1)
    db = p_y + tl.sum(dLE.to(tl.float32) * pk_kt, 1)
    for iv in range(NV):
        db += tl.load(dbeta_v + iv * n_pos + parts)
    store_rows(dbeta + rows_h, db.to(dbeta.dtype.element_ty), t0, t_end)
    z = tl.dot(dLE, kk, acc=z)
    store_rows(dp_rows, (bk[:, None] * z).to(dp_rows.dtype.element_ty), t0, t_end)
    return bk * p_y


@triton.jit
def _pb_part(k, p, S_in, dS_in, Vn_in, X_in, dbeta_v, dp, dbeta, gc, gr, glast, bk, scal_base, kb, t0, t_end, chunk,
             rows, N, H, HK, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, NV: tl.constexpr, d_read=None,
             READ_FIRST: tl.constexpr = False, MASKED: tl.constexpr = False):
    """dp and dbeta (A^T dW = -X S^T; the chunk transform's P side), stored; returns their terms of d gc and the
    decay of the carried state's, Gam <S_n, dS'_n>, on the chunk's last row. In fla's order (READ_FIRST) L and W take
    the read's log-decay gr = gc - g: the terms of d gr are returned with d gc's as if gr were gc, and also stored
    at d_read (the chunk's rows), which dg takes off again (`dg._dg_kernel`)."""
    x_s = tl.zeros([BT, K], dtype=tl.float32)
    x_vn = tl.zeros([BT, BT], dtype=tl.float32)
    s_ds = tl.zeros([K], dtype=tl.float32)                                       # <S_n, dS'_n> by column
    for v0 in tl.range(0, V, BV, num_stages=GRADS_V_STAGES):
        cv = v0 + tl.arange(0, BV)
        xk = tl.load(X_in + rows[:, None] * V + cv[None, :])
        s_t = _state_t(S_in, chunk, cv, K, V)
        x_s += tl.dot(xk, s_t)
        x_vn += tl.dot(xk, tl.load(Vn_in + rows[None, :] * V + cv[:, None]))
        s_ds += tl.sum(s_t.to(tl.float32) * _state_t(dS_in, chunk, cv, K, V).to(tl.float32), 0)
    r = tl.arange(0, BT)
    E = decay(gc, False, READ_FIRST, gr)                                        # L's decay
    pk = load_rows(row_ptrs(p, kb * K, t0, HK * K, K), t0, t_end).to(tl.bfloat16)
    kk = load_rows(row_ptrs(k, kb * K, t0, HK * K, K), t0, t_end).to(tl.bfloat16)
    dLE = tl.where(r[:, None] > r[None, :], -x_vn * E, 0.0)                      # dL * E
    pk_kt = tl.dot(pk, tl.trans(kk))
    dL_L = dLE * pk_kt * bk[:, None]                                             # dL * L
    rows_h = scal_base + (t0 + r) * H
    parts = part_rows(rows_h, rows, MASKED)
    if READ_FIRST:  # the terms of d gr, stored apart and counted with d gc's
        d_gr = tl.sum(dL_L, 1) + _store_dp_dbeta(
            x_s, dLE.to(tl.bfloat16), kk, pk, pk_kt, gr, bk, dbeta_v, row_ptrs(dp, scal_base * K, t0, H * K, K),
            dbeta, rows_h, t0, t_end, parts, part_stride(N * BT, H), NV)
        tl.store(d_read + rows, d_gr)
        dgc = d_gr - tl.sum(dL_L, 0)
    else:
        dgc = tl.sum(dL_L, 1) - tl.sum(dL_L, 0) + _store_dp_dbeta(
            x_s, dLE.to(tl.bfloat16), kk, pk, pk_kt, gc, bk, dbeta_v, row_ptrs(dp, scal_base * K, t0, H * K, K),
            dbeta, rows_h, t0, t_end, parts, part_stride(N * BT, H), NV)
    return dgc + tl.where(r == BT - 1, tl.exp(glast) * tl.sum(s_ds, 0), 0.0)


@triton.jit
def _grads_kernel(q, k, p, beta, g, do, S_in, dS_in, Vn_in, X_in, dbeta_v, dq, dk, dp, dbeta, dgc_parts,
                 scale, N, H, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, NV: tl.constexpr, T=None, layout=None,
                 GROUP: tl.constexpr = 1, READ_FIRST: tl.constexpr = False, PACKED: tl.constexpr = False,
                 MASKED: tl.constexpr = False):
    """Every gradient of the chunk but dv: the three parts (_q_part, _k_part, _pb_part) as three programs of one
    launch, next to each other in the grid. They run at the same time, so what two of them read (S, dS', Vn, X,
    dO and the chunk's q, k, p) comes from HBM once and from L2 after, while each program holds the registers of
    one part only: faster than three kernels one after the other, whose inputs come from HBM each time, and than
    the three parts in turn in one program, which spills. Their terms of d gc go to dgc_parts, one row of it a
    part, summed by `dg._dg_kernel`. Each part loads the gates and stores its terms itself: loaded once before the
    branches, the gates would stay live across all three and the kernel would spill more. H value heads, GROUP of
    them a key head: dq, dk and dp are stored per value head (B, T, H, K), the caller sums each group. In fla's read
    order (READ_FIRST) the P part also stores its terms of d gr in a fourth row of dgc_parts. The chunk's rows of the
    inputs and gradients as `chunk.chunk_rows` finds them (PACKED, MASKED)."""
    part = tl.program_id(0) % 3
    scal_base, t0, t_end, chunk, rows = chunk_offsets(N, T, H, layout, 3, PACKED, MASKED)
    if not MASKED:
        t_end = None
    kb, HK = key_head(scal_base, tl.program_id(1), call_rows(T, N, MASKED), H, GROUP)
    n_pos = part_stride(N * BT, H)
    if part == 0:
        gc, _, _ = gates(g, beta, scal_base, t0, H, t_end=t_end)
        dgc = _q_part(q, k, do, S_in, Vn_in, dq, gc, scal_base, kb, t0, t_end, chunk, rows, scale, H, HK, K, V, BV)
        tl.store(dgc_parts + rows, dgc)
    elif part == 1:
        gc, glast, bk = gates(g, beta, scal_base, t0, H, t_end=t_end)
        gr = read_log_decay(g, scal_base, t0, H, gc, READ_FIRST, t_end=t_end)
        dgc = _k_part(q, k, p, do, dS_in, Vn_in, X_in, dk, gc, gr, glast, bk, scal_base, kb, t0, t_end, chunk, rows,
                      scale, H, HK, K, V, BV, READ_FIRST)
        tl.store(dgc_parts + n_pos + rows, dgc)
    else:
        gc, glast, bk = gates(g, beta, scal_base, t0, H, t_end=t_end)
        gr = read_log_decay(g, scal_base, t0, H, gc, READ_FIRST, t_end=t_end)
        dgc = _pb_part(k, p, S_in, dS_in, Vn_in, X_in, dbeta_v, dp, dbeta, gc, gr, glast, bk, scal_base, kb, t0, t_end,
                       chunk, rows, N, H, HK, K, V, BV, NV, dgc_parts + 3 * n_pos, READ_FIRST, MASKED)
        tl.store(dgc_parts + 2 * n_pos + rows, dgc)


def launch(q, k, p, beta, g, do, S, dS, Vn, X, dbeta_v, dq, dk, dp, dbeta, dgc_parts, scale: float, packing=None):
    """dq, dk, dp (B, T, HV, K), one per value head, and dbeta (written in place), and the three parts' terms of d gc
    in dgc_parts (3, B * HV, N * 64), from the inputs q, k, p (B, T, H, K), do (B, T, HV, V), beta and g (B, T, HV)
    with HV a multiple of H, the scans' S, dS' (B * HV, N, K, V), Vn and the adjoint's X (B * HV, N * 64, V) on N
    chunks (T = N * 64, or fewer rows: `transform.launch`; with `packing`, packed sequences), and dbeta's v parts
    dbeta_v (NV, B, N * 64, HV) (`chunk.part_rows`). dgc_parts of four rows (4, B * HV, N * 64) asks for fla's read
    order, the fourth row the terms of d gr (`_pb_part`)."""
    B, T, HV, V = do.shape
    K = q.shape[-1]
    N = S.shape[1]
    order = {"READ_FIRST": True} if dgc_parts.shape[0] == 4 else {}
    _grads_kernel[(3 * N, B * HV)](q, k, p, beta, g, do, S, dS, Vn, X, dbeta_v, dq, dk, dp, dbeta, dgc_parts, scale,
                                   N, HV, K=K, V=V, BV=min(V_BLOCK[K], V), NV=dbeta_v.shape[0],
                                   **rows_args(T, N, packing), **group(q, do), **order, num_warps=GRADS_WARPS[K],
                                   num_stages=1, maxnreg=GRADS_MAXNREG[K])
