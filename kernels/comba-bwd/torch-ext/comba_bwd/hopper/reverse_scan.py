"""The reverse scan in Gluon for K = V = 128 on Hopper: one CTA of 8 warps a (b, h) over all of V, where the Triton scan
(`portable.reverse_scan._reverse_scan_kernel`) runs two V blocks of 4 warps. Same outputs as that scan with one V block:
dS'_n (bf16), X = A^T dVn, dv = beta X and sum_v(v X) (dbeta's v part).

Per chunk n (reversed), dS' (fp32 [K, V]) in registers:
  dS'_b = bf16(dS') -> shared memory (the B operand below) and, by a TMA store, dS'_n
  scores_t = (K Q^T) * scale * E^T                          [64, 64]
  dVn = scores_t dO + (K Gam/gam) dS'_b                     [64, V]   -> shared memory (bf16)
  -W^T = (-(beta gam) P)^T A^T                              [K, 64]   (apart from dS')
  dS = Gam dS' + ((gam scale) Q)^T dO + (-W^T) dVn          [K, V]
  X = A^T dVn                                               [64, V]   -> X and dv by TMA stores, sum_v(v X)
The next chunk's q, k, p, dO and A tiles are copied by TMA while one is computed (two stages, 221 KB of shared
memory: one CTA an SM). The gates and v are plain loads, issued before the wait for the tiles so that their latency
overlaps it; loaded a chunk ahead, as the forward scan loads them, the gates make this scan slower. The gates are
loaded once and converted to each layout that needs them, X and dv leave by TMA stores (register stores from the
accumulator layout are slower), and the products are issued no earlier than here: issued earlier and asynchronously,
they spill. The scan is faster than the Triton one at K = 128.

A TMA store is issued by one thread, so a wait on the stores holds that thread alone: a barrier after it keeps the
other warps from writing a buffer that a store issued in the previous chunk may not have read yet.

K = 64 keeps the Triton scan, which fits two CTAs an SM and is faster there than this scan with its two warpgroups
along V (one CTA an SM), and than a one-warpgroup form of it at two CTAs an SM.
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
from .chunk import BT, WARPS, chunk_rows, gates, scal_base
from ..reference import CHUNK


@gluon.jit
def _issue(k_desc, q_desc, p_desc, do_desc, a_desc, k_s, q_s, p_s, do_s, a_s, bar, row, hk, hv, a_row, pred):
    """Start the copies of one chunk's k, q, p, dO and A tiles into one stage (where pred)."""
    nbytes: gl.constexpr = 3 * k_desc.block_type.nbytes + do_desc.block_type.nbytes + a_desc.block_type.nbytes
    mbarrier.expect(bar, nbytes, pred=pred)
    compat.tma_load(k_desc, [row, hk], bar, k_s, pred)
    compat.tma_load(q_desc, [row, hk], bar, q_s, pred)
    compat.tma_load(p_desc, [row, hk], bar, p_s, pred)
    compat.tma_load(do_desc, [row, hv], bar, do_s, pred)
    compat.tma_load(a_desc, [a_row, 0], bar, a_s, pred)


@gluon.jit
def _reverse_scan_gluon_kernel(k_desc, q_desc, p_desc, do_desc, a_desc, ds_desc, x_desc, dv_desc, v, beta, g,
                               dbeta_v, scale, N, H, K: gl.constexpr, V: gl.constexpr):
    bh = gl.program_id(0)
    b = bh // H
    h = bh % H
    T = N * BT
    base = scal_base(b, h, N, H)
    dtype: gl.constexpr = k_desc.dtype

    # Accumulator layouts: [K, V] (the state) and [K, 64] with the two warpgroups along M, [64, V] and [64, 64]
    # with them along N.
    acc_kv: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[8, 1], instr_shape=[16, V, 16])
    acc_k64: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[8, 1], instr_shape=[16, 64, 16])
    acc_tv: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, V // 2, 16])
    acc_tt: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, 32, 16])
    a_tv: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_tv, k_width=2)
    a_k64: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_k64, k_width=2)
    a_kv: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_kv, k_width=2)
    blk: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [8, 1], [1, 0])
    blk_t: gl.constexpr = gl.BlockedLayout([8, 1], [8, 4], [1, 8], [0, 1])

    k_s = gl.allocate_shared_memory(dtype, [2, BT, K], k_desc.layout)
    q_s = gl.allocate_shared_memory(dtype, [2, BT, K], q_desc.layout)
    p_s = gl.allocate_shared_memory(dtype, [2, BT, K], p_desc.layout)
    do_s = gl.allocate_shared_memory(dtype, [2, BT, V], do_desc.layout)
    a_s = gl.allocate_shared_memory(dtype, [2, BT, BT], a_desc.layout)
    dsb_s = gl.allocate_shared_memory(dtype, [K, V], ds_desc.layout)
    dvn_s = gl.allocate_shared_memory(dtype, [BT, V], x_desc.layout)    # dVn, then X for its store
    dv_s = gl.allocate_shared_memory(dtype, [BT, V], dv_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for st in gl.static_range(2):
        mbarrier.init(bars.index(st), count=1)

    row0 = b * T
    hk = h * K
    hv = h * V
    _issue(k_desc, q_desc, p_desc, do_desc, a_desc, k_s.index(0), q_s.index(0), p_s.index(0), do_s.index(0),
           a_s.index(0), bars.index(0), row0 + (N - 1) * BT, hk, hv, (bh * N + N - 1) * BT, True)

    dS = gl.zeros([K, V], gl.float32, acc_kv)
    rows_tv = gl.arange(0, BT, layout=gl.SliceLayout(1, acc_tv))
    cols_tv = gl.arange(0, V, layout=gl.SliceLayout(0, acc_tv))
    i_tt = gl.arange(0, BT, layout=gl.SliceLayout(1, acc_tt))[:, None]
    j_tt = gl.arange(0, BT, layout=gl.SliceLayout(0, acc_tt))[None, :]
    for i in range(N):  # chunks N - 1 down to 0
        n = N - 1 - i
        s = i % 2
        t0 = n * BT
        # The next chunk's tiles into the other stage, whose reads all ended with the previous iteration.
        nxt = gl.maximum(n - 1, 0)
        _issue(k_desc, q_desc, p_desc, do_desc, a_desc, k_s.index(1 - s), q_s.index(1 - s), p_s.index(1 - s),
               do_s.index(1 - s), a_s.index(1 - s), bars.index(1 - s), row0 + nxt * BT, hk, hv,
               (bh * N + nxt) * BT, n > 0)
        # dS'_n in bf16 to shared memory once the previous chunk's stores have read it (and dvn_s, dv_s).
        tma.store_wait(0)
        compat.barrier()  # one thread issued the stores: its wait holds the other warps
        dsb_s.store(dS.to(dtype))
        fence_async_shared()
        compat.barrier()
        compat.tma_store(ds_desc, [(bh * N + n) * K, 0], dsb_s)
        gc, glast, bk = gates(g, beta, base, t0, H)
        pos = (b.to(gl.int64) * T + t0 + rows_tv)[:, None] * (H * V) + hv + cols_tv[None, :]
        vk = gl.load(v + pos)
        mbarrier.wait(bars.index(s), (i // 2) & 1)
        ks = k_s.index(s)
        qs = q_s.index(s)
        dos = do_s.index(s)
        a_t = a_s.index(s).permute((1, 0))                                  # A^T

        # dVn = scores_t dO + (K Gam/gam) dS'
        gc_b = gl.convert_layout(gc, gl.SliceLayout(1, blk))
        k_dec = (ks.load(blk).to(gl.float32) * gl.exp(glast - gc_b)[:, None]).to(dtype)
        gc_r = gl.convert_layout(gc, gl.SliceLayout(1, acc_tt))
        gc_c = gl.convert_layout(gc, gl.SliceLayout(0, acc_tt))
        sc = warpgroup_mma(ks, qs.permute((1, 0)), gl.zeros([BT, BT], gl.float32, acc_tt))
        e_t = gl.exp(gl.where(j_tt >= i_tt, gc_c[None, :] - gc_r[:, None], float("-inf")))
        sc = (sc * e_t * scale).to(dtype)
        dvn = warpgroup_mma(gl.convert_layout(sc, a_tv), dos, gl.zeros([BT, V], gl.float32, acc_tv), is_async=True)
        dvn = warpgroup_mma(gl.convert_layout(k_dec, a_tv), dsb_s, dvn, is_async=True)
        dvn = warpgroup_mma_wait(0, deps=[dvn])
        dvn_s.store(dvn.to(dtype))
        fence_async_shared()
        compat.barrier()

        # -W^T, then dS = Gam dS' + ((gam scale) Q)^T dO + (-W^T) dVn, and X = A^T dVn beside it
        gc_t = gl.convert_layout(gc, gl.SliceLayout(0, blk_t))
        bk_t = gl.convert_layout(bk, gl.SliceLayout(0, blk_t))
        p_t = p_s.index(s).permute((1, 0)).load(blk_t).to(gl.float32) * -(bk_t * gl.exp(gc_t))[None, :]
        w_t = warpgroup_mma(gl.convert_layout(p_t.to(dtype), a_k64), a_t, gl.zeros([K, BT], gl.float32, acc_k64))
        q_t = qs.permute((1, 0)).load(blk_t).to(gl.float32) * (gl.exp(gc_t) * scale)[None, :]
        dS = warpgroup_mma(gl.convert_layout(q_t.to(dtype), a_kv), dos, dS * gl.exp(glast), is_async=True)
        dS = warpgroup_mma(gl.convert_layout(w_t.to(dtype), a_kv), dvn_s, dS, is_async=True)
        x = warpgroup_mma(a_t, dvn_s, gl.zeros([BT, V], gl.float32, acc_tv), is_async=True)
        x, dS = warpgroup_mma_wait(0, deps=[x, dS])

        # dbeta's v part; X and dv through shared memory (dvn_s is free once both products have read it) by TMA
        bk_r = gl.convert_layout(bk, gl.SliceLayout(1, acc_tv))
        gl.store(dbeta_v + base + (t0 + rows_tv) * H, gl.sum(vk.to(gl.float32) * x, 1))
        dvn_s.store(x.to(dtype))
        dv_s.store((bk_r[:, None] * x).to(dtype))
        fence_async_shared()
        compat.barrier()
        compat.tma_store(x_desc, [bh * T + t0, 0], dvn_s)
        compat.tma_store(dv_desc, [row0 + t0, hv], dv_s)
        compat.barrier()  # both warpgroups are done with this stage's tiles before the next copy into it
    tma.store_wait(0)
    for st in gl.static_range(2):
        mbarrier.invalidate(bars.index(st))


def launch(t, q, v, beta, g, dv, dbeta_v, scale: float):
    """The scan over inputs (B, T, H, 128) with T a multiple of the chunk, their Tiles `t`: writes dS (BH, N, K, V),
    X (BH, T, V), dv like v and dbeta_v (1, B, T, H), as `_reverse_scan_kernel` with one V block."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    _reverse_scan_gluon_kernel[(B * H,)](t.k, t.q, t.p, t.do, t.A, t.dS, t.X, chunk_rows(dv), v, beta, g, dbeta_v,
                                         scale, T // CHUNK, H, K, V, num_warps=WARPS)
