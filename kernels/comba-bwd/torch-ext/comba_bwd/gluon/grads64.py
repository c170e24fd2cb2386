"""Every gradient in one Gluon kernel on Hopper at K = 64 (V = 128, bf16 inputs): `gluon.grads`' work for a chunk, and
dv = beta X and dbeta's v part v . X, which the reverse scan leaves out here, in persistent CTAs of one warpgroup,
two an SM, so that each runs while the other waits on a copy or a product. The kernel is bound by the bytes it moves
more than by its products, so each state-group tile is copied for the next chunk, on a barrier of its own, as soon as
this chunk is done with it. The kernel fits in 106 KB of shared memory: dq's and dp's [64, 64] A operands stay in
registers; dk's two, dq's operand and diag(beta) dLE taken transposed (so that neither Vn dO^T, Vn X^T nor E^T is
formed), go to dS'_n's buffer once dk's state part has read it; dq leaves by TMA from dLE's half of that buffer before
dLE is made there, dk and dp from q's and p's buffers, and v comes into dS'_n's buffer for v . X. A chunk's products
go in three groups, dq's, dk's and dp's, so that few accumulators are live at once. The gates are loaded with the
chunk: the other CTA hides their latency, and held a chunk ahead they spill. The decays are powers of 2, exponents
scaled by log2(e) once a row with log2(scale) in the scaled E's rows. Each chunk total of d gc (the state part's
k . dk and Gam <S_n, dS'_n>) goes to every row of dg in the final masked row sum: added to the last row through a
mask on the accumulator's row slice, it comes out wrong in this layout. dv and dbeta's v part are made from X in
bf16, one rounding more than the Triton path's.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from ..common import gluon_compat as compat
from .chunk import BT, chunk_rows, gates, sms
from .grads import (
    chunk_coords,
    issue_first_state,
    issue_keys,
    state_product,
    tile_buffers,
    views,
)
from ..reference import CHUNK

WARPS = 4
CTAS_PER_SM = 2
LOG2E = gl.constexpr(1.4426950408889634)
# dv and v . X go through X's tile 16 rows at a time (few registers live), 16 bytes a thread a load and a store.
SLICE = gl.constexpr(16)
SLICE_ROWS = gl.constexpr(gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0]))


@gluon.jit
def _copy_tile(desc, row, col, bar, buf, pred):
    """Start the copy of one tile into buf, on a barrier of its own (where pred)."""
    mbarrier.expect(bar, desc.block_type.nbytes, pred=pred)
    compat.tma_load(desc, [row, col], bar, buf, pred)


@gluon.jit
def _store_dv(x_s, beta_s, dv, trow, hv, H, V: gl.constexpr):
    """dv = beta X of the chunk from X's tile and beta (fp32 [BT] in shared memory), by slices of rows."""
    c = gl.arange(0, V, layout=gl.SliceLayout(0, SLICE_ROWS))
    for r0 in gl.static_range(0, BT, SLICE):
        r = r0 + gl.arange(0, SLICE, layout=gl.SliceLayout(1, SLICE_ROWS))
        b = beta_s.slice(r0, SLICE).load(gl.SliceLayout(1, SLICE_ROWS))
        x = x_s.slice(r0, SLICE).load(SLICE_ROWS).to(gl.float32)
        gl.store(dv + (trow + r).to(gl.int64)[:, None] * (H * V) + hv + c[None, :],
                 (b[:, None] * x).to(dv.dtype.element_ty))


@gluon.jit
def _v_dot_x(x_s, v_s, vx_s, V: gl.constexpr):
    """dbeta's v part, v . X by row, from v's and X's tiles to vx_s (fp32 [BT]), by slices of rows."""
    for r0 in gl.static_range(0, BT, SLICE):
        x = x_s.slice(r0, SLICE).load(SLICE_ROWS).to(gl.float32)
        vx_s.slice(r0, SLICE).store(gl.sum(v_s.slice(r0, SLICE).load(SLICE_ROWS).to(gl.float32) * x, 1))


@gluon.jit
def _grads64_gluon_kernel(q_desc, k_desc, p_desc, do_desc, v_desc, s_desc, ds_desc, vn_desc, x_desc, dq_desc,
                          dk_desc, dp_desc, dv, beta, g, dbeta, dg, scale, N, H, n_pos, K: gl.constexpr,
                          V: gl.constexpr):
    dtype: gl.constexpr = q_desc.dtype
    # One layout for every [64, 64] accumulator (K = 64 = the chunk), and the A operands taken from it in registers.
    acc: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, K, 16])
    a_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc, k_width=2)
    row: gl.constexpr = gl.SliceLayout(1, acc)
    col: gl.constexpr = gl.SliceLayout(0, acc)
    sq: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])

    s_b, ds_b, vn_b, x_b, do_b, q_b, k_b, p_b, state_bar, keys_bar = tile_buffers(
        q_desc, k_desc, p_desc, do_desc, s_desc, ds_desc, vn_desc, x_desc, K, V)
    tt_layout: gl.constexpr = q_desc.layout
    tt_b = compat.reinterpret(ds_b, dtype, [2, BT, BT], tt_layout)  # dS'_n's bytes, once dk's state part has read it
    # dO, Vn, dS'_n and X are copied for the next chunk as soon as this one is done with them, each on a barrier of its
    # own, and v into dS'_n's buffer on one more; the state_bar of `tile_buffers` then covers S_n alone (all five
    # state tiles for a CTA's first chunk).
    early_bars = gl.allocate_shared_memory(gl.int64, [5, 1], mbarrier.MBarrierLayout())
    do_bar = early_bars.index(0)
    vn_bar = early_bars.index(1)
    x_bar = early_bars.index(2)
    ds_bar = early_bars.index(3)
    v_bar = early_bars.index(4)
    mbarrier.init(do_bar, count=1)
    mbarrier.init(vn_bar, count=1)
    mbarrier.init(x_bar, count=1)
    mbarrier.init(ds_bar, count=1)
    mbarrier.init(v_bar, count=1)
    vx_s = gl.allocate_shared_memory(gl.float32, [BT], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    beta_s = gl.allocate_shared_memory(gl.float32, [BT], gl.SwizzledSharedLayout(1, 1, 1, [0]))  # for dv
    zero_acc = gl.zeros([BT, K], gl.float32, acc)
    log2_scale = gl.log2(scale)

    C = n_pos // BT  # chunks in all: B H N (n_pos = B T H)
    step = gl.num_programs(0)
    issue_first_state(s_desc, ds_desc, vn_desc, x_desc, do_desc, s_b, ds_b, vn_b, x_b, do_b, state_bar, N, H, K, V)
    mbarrier.arrive(do_bar)  # the first chunk's dO, Vn, X and dS'_n come with its state group
    mbarrier.arrive(vn_bar)
    mbarrier.arrive(x_bar)
    mbarrier.arrive(ds_bar)

    phase = 0
    for c in range(gl.program_id(0), C, step):
        b, t0, trow, hk, scal_base, n_state_row, n_pos_row, n_row, n_hv = chunk_coords(c, step, N, H, K, V)
        zero = c // C
        s_s, ds_s, vn_s, x_s, do_s, q_s, k_s, p_s = views(zero, s_b, ds_b, vn_b, x_b, do_b, q_b, k_b, p_b)
        op_s = tt_b.index(zero)
        dl_s = tt_b.index(zero + 1)
        i_tt = gl.arange(0, BT, layout=row)[:, None] + zero
        j_tt = gl.arange(0, BT, layout=col)[None, :]
        ri = gl.arange(0, BT, layout=gl.SliceLayout(1, sq)) + zero
        rj = gl.arange(0, BT, layout=gl.SliceLayout(0, sq))
        gc, glast, bk = gates(g, beta, scal_base, t0, H)
        beta_s.store(bk)
        rows_h = scal_base + (t0 + gl.arange(0, BT, layout=row)) * H
        tma.store_wait(0)
        compat.barrier()  # the previous chunk's dk and dp have left q_s and p_s
        issue_keys(q_desc, k_desc, p_desc, q_s, k_s, p_s, keys_bar, trow, hk, True)
        # The decay's exponents in base 2, and scale's folded into the rows of the scaled E.
        gc2 = gc * LOG2E
        gs2 = gc2 + log2_scale
        gc_r = gl.convert_layout(gc, row)
        g2_r = gl.convert_layout(gc2, row)
        g2_c = gl.convert_layout(gc2, col)
        gs_r = gl.convert_layout(gs2, row)
        bk_r = gl.convert_layout(bk, row)

        mbarrier.wait(state_bar, phase)
        mbarrier.wait(ds_bar, phase)
        mbarrier.wait(do_bar, phase)
        mbarrier.wait(vn_bar, phase)
        s_ds = state_product(s_s, ds_s, sq, K)

        # The products over V that dq needs, and dk's state part, which frees dS'_n's buffer for the two [64, 64]
        # operands that dk takes transposed from shared memory.
        a0 = warpgroup_mma(do_s, vn_s.permute((1, 0)), zero_acc, is_async=True)
        dq_acc = warpgroup_mma(do_s, s_s.permute((1, 0)), zero_acc, is_async=True)
        dk = warpgroup_mma(vn_s, ds_s.permute((1, 0)), zero_acc, is_async=True)
        e_low = gl.exp2(gl.where(i_tt >= j_tt, gs_r[:, None] - g2_c[None, :], float("-inf")))    # scale E
        a0, dq_acc, dk = warpgroup_mma_wait(0, deps=[a0, dq_acc, dk])
        op = (a0 * e_low).to(dtype)
        compat.barrier()  # no warp reads dS'_n any more: the operands go there
        nxt = c + step < C
        _copy_tile(do_desc, n_row, n_hv, do_bar, do_s, nxt)
        op_s.store(op)

        # dq = scale [gam (dO S^T) + bf16(dO Vn^T * E) K]                                      q . dq -> d gc
        dq_acc = dq_acc * (scale * gl.exp(gc_r))[:, None]
        mbarrier.wait(keys_bar, phase)
        dq_acc = warpgroup_mma(gl.convert_layout(op, a_op), k_s, dq_acc)
        dgc = gl.sum(q_s.load(acc).to(gl.float32) * dq_acc, 1)
        dl_s.store(dq_acc.to(dtype))  # dq leaves by TMA from dLE's buffer before dLE is made there
        fence_async_shared()
        compat.barrier()
        compat.tma_store(dq_desc, [trow, hk], dl_s)

        # dLE = -(X Vn^T * E) strictly lower. dk = (Gam/gam) Vn dS'^T + read Q + bf16(dR^T diag(beta)) P, with
        # read = bf16(Vn dO^T * E^T * scale), dq's operand transposed, and dR^T diag(beta) = (diag(beta) dLE)^T, both
        # from shared memory;                                                                         k . dk -> d gc
        mbarrier.wait(x_bar, phase)
        a3 = warpgroup_mma(x_s, vn_s.permute((1, 0)), zero_acc, is_async=True)
        dk = dk * gl.exp(glast - gc_r)[:, None]
        k_state = gl.sum(k_s.load(acc).to(gl.float32) * dk, 1)        # its chunk total goes to every row of dg
        a3 = warpgroup_mma_wait(0, deps=[a3])
        dle = -a3 * gl.exp2(gl.where(i_tt > j_tt, g2_r[:, None] - g2_c[None, :], float("-inf")))  # strictly lower
        tma.store_wait(0)
        compat.barrier()  # dq has left dl_s
        dl_s.store((bk_r[:, None] * dle).to(dtype))
        fence_async_shared()
        compat.barrier()
        _copy_tile(vn_desc, n_pos_row, 0, vn_bar, vn_s, nxt)
        dk = warpgroup_mma(op_s.permute((1, 0)), q_s, dk)
        dgc -= gl.sum(k_s.load(acc).to(gl.float32) * dk, 1)
        dk = warpgroup_mma(dl_s.permute((1, 0)), p_s, dk)
        compat.barrier()  # no warp reads q_s any more: dk goes there
        _copy_tile(v_desc, trow, hk // K * V, v_bar, ds_s, True)  # v into dS'_n's bytes, for v . X
        q_s.store(dk.to(dtype))
        fence_async_shared()
        compat.barrier()
        compat.tma_store(dk_desc, [trow, hk], q_s)

        # dp = beta (Y + bf16(dLE) K), Y = -gam (X S^T);
        # dbeta = p . Y + sum_j bf16(dLE)_ij (p_i . k_j) + the reverse scan's v parts
        y = warpgroup_mma(x_s, s_s.permute((1, 0)), zero_acc)
        compat.barrier()  # no warp reads S_n or dS'_n any more: the next chunk's may come
        _copy_tile(s_desc, n_state_row, 0, state_bar, s_s, nxt)
        y = y * -gl.exp(gc_r)[:, None]
        pk = warpgroup_mma(p_s, k_s.permute((1, 0)), zero_acc, is_async=True)                  # P K^T
        p_y = gl.sum(p_s.load(acc).to(gl.float32) * y, 1)
        y = warpgroup_mma(gl.convert_layout(dle.to(dtype), a_op), k_s, y, is_async=True)
        pk, y = warpgroup_mma_wait(0, deps=[pk, y])
        compat.barrier()  # no warp reads p_s any more: dp goes there
        p_s.store((bk_r[:, None] * y).to(dtype))
        fence_async_shared()
        compat.barrier()
        compat.tma_store(dp_desc, [trow, hk], p_s)
        mbarrier.wait(v_bar, phase)
        _v_dot_x(x_s, ds_s, vx_s, V)
        compat.barrier()  # v has left dS'_n's bytes: the next chunk's dS'_n may come
        _copy_tile(ds_desc, n_state_row, 0, ds_bar, ds_s, nxt)
        db = vx_s.load(row)

        db += p_y + gl.sum(dle.to(dtype).to(gl.float32) * pk, 1)
        gl.store(dbeta + rows_h, db.to(dbeta.dtype.element_ty))
        dl_l = dle * pk * bk_r[:, None]
        dgc += gl.sum(dl_l, 1) - gl.convert_layout(gl.sum(dl_l, 0), row) + bk_r * p_y
        # dg: the sum of d gc over the chunk's rows from each row on, plus the chunk totals.
        dgc_j = gl.convert_layout(dgc, gl.SliceLayout(0, sq))
        k_state_j = gl.convert_layout(k_state, gl.SliceLayout(0, sq))
        dg_i = gl.sum(gl.where(rj[None, :] >= ri[:, None], dgc_j[None, :], 0.0) + k_state_j[None, :], 1)
        gl.store(dg + scal_base + (t0 + ri) * H, dg_i + gl.exp(glast) * s_ds)
        _store_dv(x_s, beta_s, dv, trow, hk // K * V, H, V)
        compat.barrier()  # no warp reads X any more: the next chunk's may come
        _copy_tile(x_desc, n_pos_row, 0, x_bar, x_s, nxt)
        phase ^= 1
    tma.store_wait(0)
    mbarrier.invalidate(state_bar)
    mbarrier.invalidate(keys_bar)
    mbarrier.invalidate(do_bar)
    mbarrier.invalidate(vn_bar)
    mbarrier.invalidate(x_bar)
    mbarrier.invalidate(ds_bar)
    mbarrier.invalidate(v_bar)


def launch(t, q, beta, g, dq, dk, dv, dp, dbeta, dg, scale: float):
    """As `grads.launch`, at K = 64, with dv (= beta X) and dbeta's v part (v . X) made here, where the reverse
    scan leaves them out: dq, dk, dv, dp, dbeta and dg written in place."""
    B, T, H, K = q.shape
    V = dv.shape[-1]
    _grads64_gluon_kernel[(min(B * H * (T // CHUNK), CTAS_PER_SM * sms(q.device)),)](
        t.q, t.k, t.p, t.do, t.v, t.S, t.dS, t.Vn, t.X, chunk_rows(dq), chunk_rows(dk), chunk_rows(dp), dv, beta, g,
        dbeta, dg, scale, T // CHUNK, H, B * T * H, K, V, num_warps=WARPS)
