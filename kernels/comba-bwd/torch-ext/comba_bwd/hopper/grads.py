"""The gradients in Gluon on Hopper, bf16 inputs with V = 128, in two kernels: `_grads_gluon_kernel` at K = 128 (every
gradient but dv, with dg), and `_grads64_gluon_kernel` at K = 64 (every gradient, dv and dbeta's v part included).

K = 128: the three parts of `portable.grads._grads_kernel` (q, k and pb) and `portable.dg._dg_kernel` fused, one
chunk at a time, in persistent CTAs of 8 warps.

The Triton gradient kernel runs the three parts as three programs a chunk; each reads its own inputs, so a chunk's
S_n, dS'_n, Vn, X and dO pass through L2 two or three times, and L2 bounds that kernel. Here each tile is
copied once by TMA into shared memory, and both warpgroups compute every product from it (each takes half of the
product's columns). The tiles come in two groups with a barrier each, so that their copies overlap the products:
the state group (S_n, dS'_n, Vn, X, dO), used by the products over V, and the key group (q, k, p), used by the
products over the chunk. The next chunk's state group is copied once this chunk's products over V are done; a chunk's
key group is copied as the chunk starts, once the previous chunk's dk and dp, stored from the key group's q and p
buffers (shared memory holds no more at K = 128: 222 KB, one CTA an SM), have left. The [64, 64] A operands of the
products over the chunk go through shared memory too: in registers each warpgroup would hold each whole. So does
dLE in fp32, which the chunk's last terms take after the products over the chunk: held in registers across them, it
would make the kernel spill.

The gates and dbeta's v parts, plain loads, come a chunk ahead: with one CTA an SM nothing else runs to hide their
latency, which would sit on the chunk's path (at K = 64, two CTAs an SM, loading them with the chunk is faster).
dq, dk and dp leave by TMA stores, which write whole lines where register stores from the accumulator layout write 4
bytes a thread; so the key group cannot be copied a chunk ahead, as its buffers hold dk and dp until they have left.

Per chunk, with E the decay (lower, with the diagonal), E^T its transpose, r < c strictly upper:
  over V:  dO S^T, dO Vn^T, Vn dS'^T, X S^T, X Vn^T, and <S_n, dS'_n>
  dq = scale [gam (dO S^T) + bf16(dO Vn^T * E) K]                            q . dq  -> d gc
  dk = (Gam/gam) Vn dS'^T + read Q + bf16(dR^T diag(beta)) P,                 read = bf16(dO Vn^T * E * scale)^T,
       dR^T diag(beta) = (diag(beta) dLE)^T                                   k . dk terms -> d gc
  dLE = -(X Vn^T * E) strictly lower, Y = -gam (X S^T)
  dp = beta (Y + bf16(dLE) K), dbeta = p . Y + sum_j bf16(dLE)_ij (p_i . k_j) + the reverse scan's v part
  dg = the reverse cumsum in the chunk of the three parts' terms of d gc (as `_dg_kernel`).
The arithmetic and the roundings to bf16 are the Triton kernel's, but beta scales dR^T's columns here rather than
P's rows (P's tile is used as the TMA copy left it), and k . dk's read part is k . (read Q), from dk's tile, where the
Triton kernel sums read_ij (k_i . q_j) from K Q^T. dq, dk, dp and dbeta agree with the Triton kernels' to their bf16
rounding, dg to 3e-5.

dk's two operands over the chunk are transposes of [64, 64] tiles made for dq and dp, taken transposed from shared
memory by the warpgroup MMA: Vn dO^T and Vn X^T are the transposes of dO Vn^T and X Vn^T (the same sums in the same
order), so the kernel forms neither them nor E^T, every output bitwise what forming them gives.

The products over V are issued asynchronously, the two [64, 64] ones together and then the three [64, K] ones: issued
all at once, they spill. The products over the chunk are issued synchronously: asynchronously, they gain nothing.

At K = 64 this kernel (one CTA an SM) is no faster than the Triton kernels: K = 64 runs `_grads64_gluon_kernel`, one
warpgroup a CTA and two CTAs an SM.

K = 64: the K = 128 kernel's work for a chunk, and dv = beta X and dbeta's v part v . X, which the reverse scan leaves
out here, in persistent CTAs of one warpgroup, two an SM, so that each runs while the other waits on a copy or a
product. The kernel is bound by the bytes it moves more than by its products, so each state-group tile is copied for the
next chunk, on a barrier of its own, as soon as this chunk is done with it. The kernel fits in 106 KB of shared memory:
dq's and dp's [64, 64] A operands stay in registers; dk's two, dq's operand and diag(beta) dLE taken transposed (so that
neither Vn dO^T, Vn X^T nor E^T is formed), go to dS'_n's buffer once dk's state part has read it; dq leaves by TMA from
dLE's half of that buffer before dLE is made there, dk and dp from q's and p's buffers, and v comes into dS'_n's buffer
for v . X. A chunk's products go in three groups, dq's, dk's and dp's, so that few accumulators are live at once. The
gates are loaded with the chunk: the other CTA hides their latency, and held a chunk ahead they spill. The decays are
powers of 2, exponents scaled by log2(e) once a row with log2(scale) in the scaled E's rows. Each chunk total of d gc
(the state part's k . dk and Gam <S_n, dS'_n>) goes to every row of dg in the final masked row sum: added to the last
row through a mask on the accumulator's row slice, it comes out wrong in this layout. dv and dbeta's v part are made
from X in bf16, one rounding more than the Triton path's.
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
from .chunk import BT, WARPS, chunk_gates, chunk_rows, gate_columns, gate_layout, gates, scal_base, shared_layout, sms
from ..reference import CHUNK


@gluon.jit
def issue_state(s_desc, ds_desc, vn_desc, x_desc, do_desc, s_s, ds_s, vn_s, x_s, do_s, bar, state_row, pos_row,
                 row, hv, pred):
    """Start the copies of one chunk's S_n, dS'_n, Vn, X and dO tiles (where pred)."""
    nbytes: gl.constexpr = (2 * s_desc.block_type.nbytes + 2 * vn_desc.block_type.nbytes
                            + do_desc.block_type.nbytes)
    mbarrier.expect(bar, nbytes, pred=pred)
    compat.tma_load(s_desc, [state_row, 0], bar, s_s, pred)
    compat.tma_load(ds_desc, [state_row, 0], bar, ds_s, pred)
    compat.tma_load(vn_desc, [pos_row, 0], bar, vn_s, pred)
    compat.tma_load(x_desc, [pos_row, 0], bar, x_s, pred)
    compat.tma_load(do_desc, [row, hv], bar, do_s, pred)


@gluon.jit
def issue_keys(q_desc, k_desc, p_desc, q_s, k_s, p_s, bar, row, hk, pred):
    """Start the copies of one chunk's q, k and p tiles (where pred)."""
    mbarrier.expect(bar, 3 * q_desc.block_type.nbytes, pred=pred)
    compat.tma_load(q_desc, [row, hk], bar, q_s, pred)
    compat.tma_load(k_desc, [row, hk], bar, k_s, pred)
    compat.tma_load(p_desc, [row, hk], bar, p_s, pred)


@gluon.jit
def issue_first_state(s_desc, ds_desc, vn_desc, x_desc, do_desc, s_b, ds_b, vn_b, x_b, do_b, bar, N, H,
                       K: gl.constexpr, V: gl.constexpr):
    """Start the copies of this CTA's first chunk's state group (its chunk loop copies the next ones)."""
    _, _, _, state_row, pos_row, row, _, hv = _chunk_rows(gl.program_id(0), N, H, K, V)
    issue_state(s_desc, ds_desc, vn_desc, x_desc, do_desc, s_b.index(0), ds_b.index(0), vn_b.index(0),
                 x_b.index(0), do_b.index(0), bar, state_row, pos_row, row, hv, True)


@gluon.jit
def chunk_coords(c, step, N, H, K: gl.constexpr, V: gl.constexpr):
    """Chunk c's b, first row t0, row in (B T, H D) and column offset of its head's keys, the offset of its
    (b, 0, h) in (B, T, H), and the rows of the next chunk's (c + step) state group."""
    b, h, t0, _, _, row, hk, _ = _chunk_rows(c, N, H, K, V)
    _, _, _, n_state_row, n_pos_row, n_row, _, n_hv = _chunk_rows(c + step, N, H, K, V)
    return b, t0, row, hk, scal_base(b, h, N, H), n_state_row, n_pos_row, n_row, n_hv


@gluon.jit
def chunk_loads(g, beta, dbeta_v, c, N, H, n_pos, NV: gl.constexpr, row: gl.constexpr):
    """Chunk c's g (one element a thread), beta (as `chunk.gate_loads` gives it) and dbeta's v parts (`v_parts`, in
    the `row` layout), which the kernel loads a chunk ahead, so that their latency is not on the chunk's path. They
    are live across a whole chunk: g in `gate_loads`' column slice would take 8 registers a thread and make the
    K = 128 kernel spill, so `chunk.gate_columns` lays it out so when the chunk takes it."""
    one: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
    sq: gl.constexpr = gate_layout(gl.num_warps())
    b, h, t0, _, _, _, _, _ = _chunk_rows(c, N, H, BT, BT)  # K and V shape only the rows not taken here
    base = scal_base(b, h, N, H)
    gj = gl.load(g + base + (t0 + gl.arange(0, BT, layout=one)) * H)
    beta_rows = gl.load(beta + base + (t0 + gl.arange(0, BT, layout=gl.SliceLayout(1, sq))) * H)
    return gj, beta_rows, v_parts(dbeta_v, base + (t0 + gl.arange(0, BT, layout=row)) * H, n_pos, NV)


@gluon.jit
def _chunk_rows(c, N, H, K: gl.constexpr, V: gl.constexpr):
    """Chunk c's (b, h) and first row t0, and the rows of its tiles: the state row in (BH N K, V), the position row
    in (BH T, V), the row in (B T, H D) and the head's column offsets there."""
    bh = c // N
    n = c % N
    b = bh // H
    h = bh % H
    T = N * BT
    return b, h, n * BT, c * K, bh * T + n * BT, b * T + n * BT, h * K, h * V


@gluon.jit
def tile_buffers(q_desc, k_desc, p_desc, do_desc, s_desc, ds_desc, vn_desc, x_desc, K: gl.constexpr,
                  V: gl.constexpr):
    """Shared memory for one chunk's state group (S_n, dS'_n, Vn, X, dO) and key group (q, k, p; q's buffer then
    holds dk and p's dp for their TMA stores), each [1, ...] so that a kernel takes it as a view at a runtime index
    that is always zero (`views`), and the two groups' barriers."""
    dtype: gl.constexpr = q_desc.dtype
    s_b = gl.allocate_shared_memory(dtype, [1, K, V], s_desc.layout)
    ds_b = gl.allocate_shared_memory(dtype, [1, K, V], ds_desc.layout)
    vn_b = gl.allocate_shared_memory(dtype, [1, BT, V], vn_desc.layout)
    x_b = gl.allocate_shared_memory(dtype, [1, BT, V], x_desc.layout)
    do_b = gl.allocate_shared_memory(dtype, [1, BT, V], do_desc.layout)
    q_b = gl.allocate_shared_memory(dtype, [1, BT, K], q_desc.layout)
    k_b = gl.allocate_shared_memory(dtype, [1, BT, K], k_desc.layout)
    p_b = gl.allocate_shared_memory(dtype, [1, BT, K], p_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(bars.index(0), count=1)
    mbarrier.init(bars.index(1), count=1)
    return s_b, ds_b, vn_b, x_b, do_b, q_b, k_b, p_b, bars.index(0), bars.index(1)


@gluon.jit
def views(zero, s_b, ds_b, vn_b, x_b, do_b, q_b, k_b, p_b):
    """The tile buffers as views at `zero`, a zero the compiler cannot prove (c // C in the chunk loop: it folds
    c >= C from the loop's guard, not this division), so that the views, and the masks made with it, are formed in
    each iteration where they are used. Hoisted out of the loop, the products' shared-memory descriptors and the
    masks would hold registers across it, and the K = 128 kernel would spill."""
    return (s_b.index(zero), ds_b.index(zero), vn_b.index(zero), x_b.index(zero), do_b.index(zero), q_b.index(zero),
            k_b.index(zero), p_b.index(zero))


@gluon.jit
def state_product(s_s, ds_s, layout: gl.constexpr, K: gl.constexpr):
    """<S_n, dS'_n> (fp32) from their tiles, 32 rows at a time, to hold few registers."""
    s_ds = 0.0
    for r0 in gl.static_range(0, K, 32):
        s_ds += gl.sum(gl.sum(s_s.slice(r0, 32).load(layout).to(gl.float32)
                              * ds_s.slice(r0, 32).load(layout).to(gl.float32), 1), 0)
    return s_ds


@gluon.jit
def v_parts(dbeta_v, rows_h, n_pos, NV: gl.constexpr):
    """dbeta's v parts from the reverse scan (one per V block of it), summed, at rows_h of the (B, T, H) layout."""
    db = gl.load(dbeta_v + rows_h)
    for iv in gl.static_range(1, NV):
        db += gl.load(dbeta_v + iv * n_pos + rows_h)
    return db


@gluon.jit
def _grads_gluon_kernel(q_desc, k_desc, p_desc, do_desc, s_desc, ds_desc, vn_desc, x_desc, dq_desc, dk_desc,
                        dp_desc, beta, g, dbeta_v, dbeta, dg, scale, N, H, n_pos, K: gl.constexpr,
                        V: gl.constexpr, NV: gl.constexpr, tt_layout: gl.constexpr):
    dtype: gl.constexpr = q_desc.dtype
    # Every product has M = 64 rows; the two warpgroups split its columns.
    acc_tk: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, K // 2, 16])
    acc_tt: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, 32, 16])
    row_k: gl.constexpr = gl.SliceLayout(1, acc_tk)
    row_t: gl.constexpr = gl.SliceLayout(1, acc_tt)
    col_t: gl.constexpr = gl.SliceLayout(0, acc_tt)
    sq: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [8, 1], [1, 0])

    s_b, ds_b, vn_b, x_b, do_b, q_b, k_b, p_b, state_bar, keys_bar = tile_buffers(
        q_desc, k_desc, p_desc, do_desc, s_desc, ds_desc, vn_desc, x_desc, K, V)
    dq_b = gl.allocate_shared_memory(dtype, [1, BT, K], dq_desc.layout)
    # The [64, 64] A operands of the products over the chunk, in shared memory: in registers both warpgroups
    # would hold each whole (they split the product's columns).
    tt_b = gl.allocate_shared_memory(dtype, [3, BT, BT], tt_layout)   # bf16 dO Vn^T E, diag(beta) dLE, dLE
    # dLE (fp32) from the products over V to the chunk's end: held in registers across the products over the chunk,
    # it would make the kernel spill. 32-byte vectors swizzled by row: the accumulator layout's stores and loads of it
    # take the fewest wavefronts.
    dle_b = gl.allocate_shared_memory(gl.float32, [1, BT, BT], gl.SwizzledSharedLayout(8, 1, 8, [1, 0]))

    zero_tk = gl.zeros([BT, K], gl.float32, acc_tk)
    zero_tt = gl.zeros([BT, BT], gl.float32, acc_tt)

    C = n_pos // BT  # chunks in all: B H N (n_pos = B T H)
    step = gl.num_programs(0)
    issue_first_state(s_desc, ds_desc, vn_desc, x_desc, do_desc, s_b, ds_b, vn_b, x_b, do_b, state_bar, N, H, K, V)
    gj, beta_rows, db_next = chunk_loads(g, beta, dbeta_v, gl.program_id(0), N, H, n_pos, NV, row_t)

    phase = 0
    for c in range(gl.program_id(0), C, step):
        b, t0, row, hk, scal_base, n_state_row, n_pos_row, n_row, n_hv = chunk_coords(c, step, N, H, K, V)
        zero = c // C
        s_s, ds_s, vn_s, x_s, do_s, q_s, k_s, p_s = views(zero, s_b, ds_b, vn_b, x_b, do_b, q_b, k_b, p_b)
        dq_s = dq_b.index(zero)
        i_tt = gl.arange(0, BT, layout=row_t)[:, None] + zero
        j_tt = gl.arange(0, BT, layout=col_t)[None, :]
        ri = gl.arange(0, BT, layout=gl.SliceLayout(1, sq)) + zero
        rj = gl.arange(0, BT, layout=gl.SliceLayout(0, sq))
        last_t = gl.arange(0, BT, layout=row_t) + zero == BT - 1
        last_k = gl.arange(0, BT, layout=row_k) + zero == BT - 1
        # The gates and dbeta's v parts (from the reverse scan) come loaded a chunk ahead; this chunk's key group is
        # copied once the previous chunk's gradients have left q_s, p_s and dq_s.
        gc, glast, bk = chunk_gates(gate_columns(gj), beta_rows)
        db = db_next
        gj, beta_rows, db_next = chunk_loads(g, beta, dbeta_v, gl.minimum(c + step, C - 1), N, H, n_pos, NV, row_t)
        rows_h = scal_base + (t0 + gl.arange(0, BT, layout=row_t)) * H
        tma.store_wait(0)
        compat.barrier()
        issue_keys(q_desc, k_desc, p_desc, q_s, k_s, p_s, keys_bar, row, hk, True)
        gc_r = gl.convert_layout(gc, row_t)
        gc_c = gl.convert_layout(gc, col_t)
        gc_k = gl.convert_layout(gc, row_k)
        bk_r = gl.convert_layout(bk, row_t)
        bk_k = gl.convert_layout(bk, row_k)

        # The products over V, from the state group.
        mbarrier.wait(state_bar, phase)
        s_ds = state_product(s_s, ds_s, sq, K)
        # The two [64, 64] products are issued together, so that the tensor cores run them back to back while the
        # warps scale and store each as it completes; the three [64, K] ones follow.
        a0 = warpgroup_mma(do_s, vn_s.permute((1, 0)), zero_tt, is_async=True)
        a3 = warpgroup_mma(x_s, vn_s.permute((1, 0)), zero_tt, is_async=True)
        e_low = gl.exp(gl.where(i_tt >= j_tt, gc_r[:, None] - gc_c[None, :], float("-inf")))      # E
        a0 = warpgroup_mma_wait(1, deps=[a0])
        tt_b.index(zero + 0).store((a0 * e_low * scale).to(dtype))
        a3 = warpgroup_mma_wait(0, deps=[a3])
        dle = gl.where(i_tt > j_tt, -a3 * e_low, 0.0)
        tt_b.index(zero + 1).store((bk_r[:, None] * dle).to(dtype))
        tt_b.index(zero + 2).store(dle.to(dtype))
        dle_b.index(zero).store(dle)
        dq = warpgroup_mma(do_s, s_s.permute((1, 0)), zero_tk, is_async=True)
        dk = warpgroup_mma(vn_s, ds_s.permute((1, 0)), zero_tk, is_async=True)
        y = warpgroup_mma(x_s, s_s.permute((1, 0)), zero_tk, is_async=True)
        dq, dk, y = warpgroup_mma_wait(0, deps=[dq, dk, y])
        dq = dq * (scale * gl.exp(gc_k))[:, None]
        dk = dk * gl.exp(glast - gc_k)[:, None]
        y = y * -gl.exp(gc_k)[:, None]                                                            # Y
        fence_async_shared()
        compat.barrier()  # the operands are in tt_b, and no warp reads the state group any more
        issue_state(s_desc, ds_desc, vn_desc, x_desc, do_desc, s_s, ds_s, vn_s, x_s, do_s, state_bar, n_state_row,
                     n_pos_row, n_row, n_hv, c + step < C)

        # The products over the chunk, from the key group.
        mbarrier.wait(keys_bar, phase)
        dq = warpgroup_mma(tt_b.index(zero + 0), k_s, dq)
        dgc = gl.convert_layout(gl.sum(q_s.load(acc_tk).to(gl.float32) * dq, 1), row_t)             # q . dq
        dq_s.store(dq.to(dtype))
        # k . dk: the state part's row sums (their total goes to the last row) and, with the read part added,
        # both at once, read as k . (read Q) where the Triton kernel takes sum_j read_ij (k_i . q_j).
        k_state = gl.sum(k_s.load(acc_tk).to(gl.float32) * dk, 1)
        dk = warpgroup_mma(tt_b.index(zero + 0).permute((1, 0)), q_s, dk)
        k_dk = gl.sum(k_s.load(acc_tk).to(gl.float32) * dk, 1)
        dgc += gl.convert_layout(gl.where(last_k, gl.sum(k_state, 0), 0.0) - k_dk, row_t)
        dk = warpgroup_mma(tt_b.index(zero + 1).permute((1, 0)), p_s, dk)
        pk = warpgroup_mma(p_s, k_s.permute((1, 0)), zero_tt)                                  # P K^T
        p_y = gl.sum(p_s.load(acc_tk).to(gl.float32) * y, 1)
        y = warpgroup_mma(tt_b.index(zero + 2), k_s, y)
        compat.barrier()  # no warp reads q_s or p_s any more: dk and dp go there
        q_s.store(dk.to(dtype))
        p_s.store((bk_k[:, None] * y).to(dtype))
        fence_async_shared()
        compat.barrier()
        compat.tma_store(dq_desc, [row, hk], dq_s)
        compat.tma_store(dk_desc, [row, hk], q_s)
        compat.tma_store(dp_desc, [row, hk], p_s)

        # dbeta = p . Y + sum_j bf16(dLE)_ij (p_i . k_j) + the reverse scan's v parts, and the pb part's d gc.
        dle = dle_b.index(zero).load(acc_tt)
        db += gl.convert_layout(p_y, row_t) + gl.sum(dle.to(dtype).to(gl.float32) * pk, 1)
        gl.store(dbeta + rows_h, db.to(dbeta.dtype.element_ty))
        dl_l = dle * pk * bk_r[:, None]
        dgc += gl.sum(dl_l, 1) - gl.convert_layout(gl.sum(dl_l, 0), row_t) + gl.convert_layout(bk_k * p_y, row_t)
        dgc += gl.where(last_t, gl.exp(glast) * s_ds, 0.0)
        # dg: the sum of d gc over the chunk's rows from each row on.
        dgc_j = gl.convert_layout(dgc, gl.SliceLayout(0, sq))
        gl.store(dg + scal_base + (t0 + ri) * H, gl.sum(gl.where(rj[None, :] >= ri[:, None], dgc_j[None, :], 0.0), 1))
        phase ^= 1
    tma.store_wait(0)
    mbarrier.invalidate(state_bar)
    mbarrier.invalidate(keys_bar)


def launch(t, q, do, beta, g, dbeta_v, dq, dk, dp, dbeta, dg, scale: float):
    """dq, dk, dp, dbeta and dg (written in place) from the inputs (B, T, H, *) with T a multiple of the chunk, their
    Tiles `t` (of the scans' S, dS', Vn and X among them) and dbeta's v parts (NV, B, T, H)."""
    B, T, H, K = q.shape
    V = do.shape[-1]
    _grads_gluon_kernel[(min(B * H * (T // CHUNK), sms(q.device)),)](  # one CTA an SM (222 KB of shared memory)
        t.q, t.k, t.p, t.do, t.S, t.dS, t.Vn, t.X, chunk_rows(dq), chunk_rows(dk), chunk_rows(dp), beta, g, dbeta_v,
        dbeta, dg, scale, T // CHUNK, H, B * T * H, K, V, dbeta_v.shape[0], shared_layout((CHUNK, CHUNK), q.dtype),
        num_warps=WARPS)


# The K = 64 kernel: one warpgroup a CTA, two CTAs an SM.
WARPS_64 = 4
CTAS_PER_SM_64 = 2
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


def launch_grads64(t, q, beta, g, dq, dk, dv, dp, dbeta, dg, scale: float):
    """As `launch`, at K = 64, with dv (= beta X) and dbeta's v part (v . X) made here, where the reverse
    scan leaves them out: dq, dk, dv, dp, dbeta and dg written in place."""
    B, T, H, K = q.shape
    V = dv.shape[-1]
    _grads64_gluon_kernel[(min(B * H * (T // CHUNK), CTAS_PER_SM_64 * sms(q.device)),)](
        t.q, t.k, t.p, t.do, t.v, t.S, t.dS, t.Vn, t.X, chunk_rows(dq), chunk_rows(dk), chunk_rows(dp), dv, beta, g,
        dbeta, dg, scale, T // CHUNK, H, B * T * H, K, V, num_warps=WARPS_64)
