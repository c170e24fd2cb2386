"""Every gradient but dv in one Gluon kernel on Hopper at K = 64 (V = 128, bf16 inputs): `gluon_grads`' work for a
chunk, in persistent CTAs of one warpgroup, two an SM.

At K = 64 the two-warpgroup `gluon_grads` (148 KB of shared memory, one CTA an SM) took as long as the Triton
gradient kernels; its chunk's products run one after another, and while a CTA waits on a product or a copy its SM has
nothing else to run. Here a CTA is one warpgroup of at most 255 registers a thread, and its tiles take 104 KB (107.5
with the compiler's scratch), so that two CTAs share an SM and each runs while the other waits. To fit:
- the [64, 64] A operands of dq's and dp's products over the chunk stay in registers (one warpgroup holds each whole
  anyway); dk's two, taken transposed by the warpgroup MMA, go to dS'_n's buffer once dk's state part has read it;
- a chunk's products go in three groups, dq's (with dk's state part), dk's and dp's, each with the products over V it
  needs, so that few accumulators are live at once; dk leaves (by TMA, from q's buffer) before dp's group starts;
- dq is stored from registers (a TMA store would need another 8 KB buffer: 16 bytes more than two CTAs may have).
The gates, the state and key groups of tiles and their copies are `gluon_grads`'. The products, their roundings to
bf16 and the terms of d gc are that kernel's, but each chunk total of d gc (sum_i k_i . dk_i over the state part, and
Gam <S_n, dS'_n>) is added to every row of dg in the final masked row sum, where that kernel adds it to the chunk's last
row before the reverse cumsum: the same sums, and here the form that was right (added to the last row through a mask
on the accumulator's row slice, the totals came out wrong in this one-warpgroup layout; dq, dk, dp and dbeta did not;
bench/results/2026-11-30-104769c-comba-k64-probe.log).

dk's operands over the chunk are transposes of tiles made for dq and dp: read = bf16(Vn dO^T * E^T * scale) is bf16(dO
Vn^T * E * scale)^T, the same sums rounded the same way, and dR^T diag(beta) = -(Vn X^T * E^T) diag(beta) on r < c is
(diag(beta) dLE)^T, dLE = -(X Vn^T * E) strictly lower. So the kernel forms neither Vn dO^T nor Vn X^T (two of its
seven [64, 64, V] products) nor E^T: at (16, 2048, 32, 64, 128) 0.848 -> 0.753 ms, the backward 1.949 -> 1.851, with
dq, dv, dp, dbeta and dg bitwise equal and dk within 1e-5 (rel.; diag(beta) dLE is rounded once where the kernel
before scaled by beta/scale a product that held scale), and 136 -> 36 B of spill
(bench/results/2026-11-30-3807016-dirty-comba-grads-transposes-probe.log).

At (16, 2048, 32, 64, 128), in the benchmark's stage sweep before that: 0.850 ms
(bench/results/2026-11-30-be323b0-comba.md; 0.867 at c5b1718, -c5b1718-comba.md), where the Triton gradient kernels
took 1.031 + 0.020 (-cbae741-comba.md); side by side in one probe, an earlier form of it (its accumulators in two
layouts) 0.935 against their 1.054, and 1.246 with one CTA an SM (-104769c-comba-k64-probe.log). ptxas: 255 registers,
36 bytes of spill (within the benchmark's SPILLS_BY_DESIGN), 107.5 KB of shared memory.

Its gates and dbeta's v parts are loaded with the chunk. A chunk ahead, as `gluon_grads` loads them, they held
registers across the chunk (192 B of spill) and the kernel took 0.877-0.893 against 0.863-0.900 ms, the backward
2.056 against 2.036-2.049 (bench/results/2026-11-30-8451943-comba-gates-ahead-probe.log); two CTAs an SM hide most of
their latency. dk and dp stored from registers, so that the next chunk's key group could be copied a chunk ahead, took
0.987 against 0.862 ms (-01f2d5c-comba-keys-ahead-probe.log). Kept as TMA stores, with the next chunk's q and k
copied once dk had left q_s (after dp's group of products, p's copy at the chunk's start behind a barrier of its own),
it took 1.005 against 0.862 ms, all outputs bitwise equal (-a1c9155-dirty-comba-grads64-keys-exp2-probe.log).
With the transposed operands (36 B of spill), each try to hide more latency spilled more and lost: the gates and
dbeta's v parts a chunk ahead again 0.762-0.764 against 0.754-0.757 ms (60 B); each chunk's dg stored while the next
chunk's first products run 0.761-0.763 (68 B); both 0.816-0.821 (140 B)
(bench/results/2026-11-30-99980e5-comba-grads64-overlap-probe.log); X Vn^T's product and dLE before the wait for the
key group, 0.745-0.785 against 0.752-0.767 in two probes, not kept, and with <S_n, dS'_n> then taken as the trace of
S_n dS'_n^T (a product issued with dq's) 0.767-0.787 (52 B; -824780b-comba-store-wait-probe.log,
-824780b-dirty-comba-grads64-order-probe.log).

The decays are powers of 2 of exponents scaled by log2(e) once a row, with log2(scale) in the rows of the scaled one
(E in dq's operand), so that no element takes the multiplications by log2(e) and scale; dLE's strict mask is on its
exponent. 0.862 -> 0.848 ms, the backward 2.019 -> 2.010 (-a1c9155-dirty-comba-grads64-keys-exp2-probe.log); the
outputs moved by 2e-5 to 8e-5 (rel.) from the kernel's before, within their bf16 rounding.
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

from .gluon_common import BT, chunk_rows, gates, sms
from .gluon_grads import (
    chunk_coords,
    issue_first_state,
    issue_keys,
    issue_state,
    state_product,
    tile_buffers,
    v_parts,
    views,
)
from .reference import CHUNK

WARPS = 4
CTAS_PER_SM = 2
LOG2E = gl.constexpr(1.4426950408889634)


@gluon.jit
def _grads64_gluon_kernel(q_desc, k_desc, p_desc, do_desc, s_desc, ds_desc, vn_desc, x_desc, dk_desc, dp_desc, dq,
                          beta, g, dbeta_v, dbeta, dg, scale, N, H, n_pos, K: gl.constexpr, V: gl.constexpr,
                          NV: gl.constexpr):
    dtype: gl.constexpr = q_desc.dtype
    # One layout for every [64, 64] accumulator (K = 64 = the chunk), and the A operands taken from it in registers.
    acc: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, K, 16])
    a_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc, k_width=2)
    row: gl.constexpr = gl.SliceLayout(1, acc)
    col: gl.constexpr = gl.SliceLayout(0, acc)
    sq: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])

    s_b, ds_b, vn_b, x_b, do_b, q_b, k_b, p_b, state_bar, keys_bar = tile_buffers(
        q_desc, k_desc, p_desc, do_desc, s_desc, ds_desc, vn_desc, x_desc, K, V)
    tt_b = ds_b._reinterpret(dtype, [2, BT, BT], q_desc.layout)  # dS'_n's bytes, once dk's state part has read it
    zero_acc = gl.zeros([BT, K], gl.float32, acc)
    log2_scale = gl.log2(scale)

    C = n_pos // BT  # chunks in all: B H N (n_pos = B T H)
    step = gl.num_programs(0)
    issue_first_state(s_desc, ds_desc, vn_desc, x_desc, do_desc, s_b, ds_b, vn_b, x_b, do_b, state_bar, N, H, K, V)

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
        rows_h = scal_base + (t0 + gl.arange(0, BT, layout=row)) * H
        db = v_parts(dbeta_v, rows_h, n_pos, NV)
        tma.store_wait(0)
        gl.thread_barrier()  # the previous chunk's dk and dp have left q_s and p_s
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
        s_ds = state_product(s_s, ds_s, sq, K)

        # The products over V that dq needs, and dk's state part, which frees dS'_n's buffer for the two [64, 64]
        # operands that dk takes transposed from shared memory.
        a0 = warpgroup_mma(do_s, vn_s.permute((1, 0)), zero_acc, is_async=True)
        dq_acc = warpgroup_mma(do_s, s_s.permute((1, 0)), zero_acc, is_async=True)
        dk = warpgroup_mma(vn_s, ds_s.permute((1, 0)), zero_acc, is_async=True)
        e_low = gl.exp2(gl.where(i_tt >= j_tt, gs_r[:, None] - g2_c[None, :], float("-inf")))    # scale E
        a0, dq_acc, dk = warpgroup_mma_wait(0, deps=[a0, dq_acc, dk])
        op = (a0 * e_low).to(dtype)
        gl.thread_barrier()  # no warp reads dS'_n any more: the operands go there
        op_s.store(op)

        # dq = scale [gam (dO S^T) + bf16(dO Vn^T * E) K]                                      q . dq -> d gc
        dq_acc = dq_acc * (scale * gl.exp(gc_r))[:, None]
        mbarrier.wait(keys_bar, phase)
        dq_acc = warpgroup_mma(gl.convert_layout(op, a_op), k_s, dq_acc)
        dgc = gl.sum(q_s.load(acc).to(gl.float32) * dq_acc, 1)
        dq_rows = (b.to(gl.int64) * (N * BT) + t0 + gl.arange(0, BT, layout=row)) * (H * K) + hk
        gl.store(dq + dq_rows[:, None] + gl.arange(0, K, layout=col)[None, :], dq_acc.to(dtype))

        # dLE = -(X Vn^T * E) strictly lower. dk = (Gam/gam) Vn dS'^T + read Q + bf16(dR^T diag(beta)) P, with
        # read = bf16(Vn dO^T * E^T * scale), dq's operand transposed, and dR^T diag(beta) = (diag(beta) dLE)^T, both
        # from shared memory;                                                                         k . dk -> d gc
        a3 = warpgroup_mma(x_s, vn_s.permute((1, 0)), zero_acc, is_async=True)
        dk = dk * gl.exp(glast - gc_r)[:, None]
        k_state = gl.sum(k_s.load(acc).to(gl.float32) * dk, 1)        # its chunk total goes to every row of dg
        a3 = warpgroup_mma_wait(0, deps=[a3])
        dle = -a3 * gl.exp2(gl.where(i_tt > j_tt, g2_r[:, None] - g2_c[None, :], float("-inf")))  # strictly lower
        dl_s.store((bk_r[:, None] * dle).to(dtype))
        fence_async_shared()
        gl.thread_barrier()
        dk = warpgroup_mma(op_s.permute((1, 0)), q_s, dk)
        dgc -= gl.sum(k_s.load(acc).to(gl.float32) * dk, 1)
        dk = warpgroup_mma(dl_s.permute((1, 0)), p_s, dk)
        gl.thread_barrier()  # no warp reads q_s any more: dk goes there
        q_s.store(dk.to(dtype))
        fence_async_shared()
        gl.thread_barrier()
        tma.async_copy_shared_to_global(dk_desc, [trow, hk], q_s)

        # dp = beta (Y + bf16(dLE) K), Y = -gam (X S^T);
        # dbeta = p . Y + sum_j bf16(dLE)_ij (p_i . k_j) + the reverse scan's v parts
        y = warpgroup_mma(x_s, s_s.permute((1, 0)), zero_acc)
        gl.thread_barrier()  # no warp reads the state group any more: the next chunk's may come
        issue_state(s_desc, ds_desc, vn_desc, x_desc, do_desc, s_s, ds_s, vn_s, x_s, do_s, state_bar, n_state_row,
                     n_pos_row, n_row, n_hv, c + step < C)
        y = y * -gl.exp(gc_r)[:, None]
        pk = warpgroup_mma(p_s, k_s.permute((1, 0)), zero_acc, is_async=True)                  # P K^T
        p_y = gl.sum(p_s.load(acc).to(gl.float32) * y, 1)
        y = warpgroup_mma(gl.convert_layout(dle.to(dtype), a_op), k_s, y, is_async=True)
        pk, y = warpgroup_mma_wait(0, deps=[pk, y])
        gl.thread_barrier()  # no warp reads p_s any more: dp goes there
        p_s.store((bk_r[:, None] * y).to(dtype))
        fence_async_shared()
        gl.thread_barrier()
        tma.async_copy_shared_to_global(dp_desc, [trow, hk], p_s)

        db += p_y + gl.sum(dle.to(dtype).to(gl.float32) * pk, 1)
        gl.store(dbeta + rows_h, db.to(dbeta.dtype.element_ty))
        dl_l = dle * pk * bk_r[:, None]
        dgc += gl.sum(dl_l, 1) - gl.convert_layout(gl.sum(dl_l, 0), row) + bk_r * p_y
        # dg: the sum of d gc over the chunk's rows from each row on, plus the chunk totals.
        dgc_j = gl.convert_layout(dgc, gl.SliceLayout(0, sq))
        k_state_j = gl.convert_layout(k_state, gl.SliceLayout(0, sq))
        dg_i = gl.sum(gl.where(rj[None, :] >= ri[:, None], dgc_j[None, :], 0.0) + k_state_j[None, :], 1)
        gl.store(dg + scal_base + (t0 + ri) * H, dg_i + gl.exp(glast) * s_ds)
        phase ^= 1
    tma.store_wait(0)
    mbarrier.invalidate(state_bar)
    mbarrier.invalidate(keys_bar)


def launch(t, q, do, beta, g, dbeta_v, dq, dk, dp, dbeta, dg, scale: float):
    """As `gluon_grads.launch`, at K = 64: dq, dk, dp, dbeta and dg written in place."""
    B, T, H, K = q.shape
    V = do.shape[-1]
    _grads64_gluon_kernel[(min(B * H * (T // CHUNK), CTAS_PER_SM * sms(q.device)),)](
        t.q, t.k, t.p, t.do, t.S, t.dS, t.Vn, t.X, chunk_rows(dk), chunk_rows(dp), dq, beta, g, dbeta_v, dbeta, dg,
        scale, T // CHUNK, H, B * T * H, K, V, dbeta_v.shape[0], num_warps=WARPS)
