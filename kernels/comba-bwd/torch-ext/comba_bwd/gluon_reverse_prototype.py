"""Prototype (session 18): the comba reverse scan in Gluon, one CTA of 8 warps per (b, h) over all of V (K = V = 128),
the next chunk's q, k, p, dO and A tiles loaded by TMA while one is computed, dS (fp32 [K, V]) in registers.
Outputs as comba_bwd.triton_bwd._reverse_scan_kernel with one V block: dS'_n (bf16), X, dv, dbeta's v part.
Per chunk n (reversed):
  dS_b = bf16(dS') -> smem (also TMA-stored as dS'_n)
  scores_t = (K Q^T) * scale * E^T                       [64, 64]
  dVn = scores_t dO + (K Gam/gam) dS_b                   [64, V]   -> bf16 smem
  X = A^T dVn                                            [64, V]   -> X, dv = beta X, sum_v(v X)
  -W^T = (-(beta gam) P)^T A^T                           [K, 64]   (off the dS chain)
  dS = Gam dS' + ((gam scale) Q)^T dO + (-W^T) dVn       [K, V]
"""
import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma, warpgroup_mma, \
    warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

BT = gl.constexpr(64)
WARPS = 8


@gluon.jit
def _gates(g, beta, scal_base, t0, H):
    """gc (inclusive cumsum of g in the chunk, as a masked row sum: a scan in these layouts does not lower), glast
    and beta, fp32 [BT], gc and beta in the row slice of a [BT, BT] blocked layout."""
    sq: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [8, 1], [1, 0])
    ri = gl.arange(0, BT, layout=gl.SliceLayout(1, sq))
    rj = gl.arange(0, BT, layout=gl.SliceLayout(0, sq))
    gj = gl.load(g + scal_base + (t0 + rj) * H)
    bk = gl.load(beta + scal_base + (t0 + ri) * H).to(gl.float32)
    gc = gl.sum(gl.where(rj[None, :] <= ri[:, None], gj[None, :], 0.0), 1)
    return gc, gl.sum(gj, 0), bk


@gluon.jit
def _issue(k_desc, q_desc, p_desc, do_desc, a_desc, k_s, q_s, p_s, do_s, a_s, bar, row, hk, hv, a_row, pred):
    nbytes: gl.constexpr = (3 * k_desc.block_type.nbytes + do_desc.block_type.nbytes + a_desc.block_type.nbytes)
    mbarrier.expect(bar, nbytes, pred=pred)
    tma.async_copy_global_to_shared(k_desc, [row, hk], bar, k_s, pred)
    tma.async_copy_global_to_shared(q_desc, [row, hk], bar, q_s, pred)
    tma.async_copy_global_to_shared(p_desc, [row, hk], bar, p_s, pred)
    tma.async_copy_global_to_shared(do_desc, [row, hv], bar, do_s, pred)
    tma.async_copy_global_to_shared(a_desc, [a_row, 0], bar, a_s, pred)


@gluon.jit
def _rev_kernel(k_desc, q_desc, p_desc, do_desc, a_desc, ds_desc, x_desc, dv_desc, v, beta, g, dbeta_v, scale, N, H,
                K: gl.constexpr, V: gl.constexpr):
    bh = gl.program_id(0)
    b = bh // H
    h = bh % H
    T = N * BT
    scal_base = b.to(gl.int64) * T * H + h
    dtype: gl.constexpr = k_desc.dtype

    # accumulator layouts: [K, V] state and [K, 64] (two warpgroups along M), [64, V] and [64, 64] (along N)
    acc_kv: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[8, 1], instr_shape=[16, V, 16])
    acc_k64: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[8, 1], instr_shape=[16, 64, 16])
    acc_tv: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, V // 2, 16])
    acc_tt: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, 32, 16])
    blk: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [8, 1], [1, 0])
    blk_t: gl.constexpr = gl.BlockedLayout([8, 1], [8, 4], [1, 8], [0, 1])

    k_s = gl.allocate_shared_memory(dtype, [2, BT, K], k_desc.layout)
    q_s = gl.allocate_shared_memory(dtype, [2, BT, K], q_desc.layout)
    p_s = gl.allocate_shared_memory(dtype, [2, BT, K], p_desc.layout)
    do_s = gl.allocate_shared_memory(dtype, [2, BT, V], do_desc.layout)
    a_s = gl.allocate_shared_memory(dtype, [2, BT, BT], a_desc.layout)
    dsb_s = gl.allocate_shared_memory(dtype, [K, V], ds_desc.layout)
    dvn_s = gl.allocate_shared_memory(dtype, [BT, V], do_desc.layout)
    dv_s = gl.allocate_shared_memory(dtype, [BT, V], do_desc.layout)
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
    for i in range(N):
        n = N - 1 - i
        s = i % 2
        t0 = n * BT
        # the next chunk's tiles into the other stage (its last reads finished before the previous iteration ended)
        nxt = gl.maximum(n - 1, 0)
        _issue(k_desc, q_desc, p_desc, do_desc, a_desc, k_s.index(1 - s), q_s.index(1 - s), p_s.index(1 - s),
               do_s.index(1 - s), a_s.index(1 - s), bars.index(1 - s), row0 + nxt * BT, hk, hv,
               (bh * N + nxt) * BT, n > 0)
        # dS'_n to shared memory (bf16): the B operand of (K Gam/gam) dS', and the stored state
        tma.store_wait(0)
        dsb_s.store(dS.to(dtype))
        fence_async_shared()
        gl.thread_barrier()
        tma.async_copy_shared_to_global(ds_desc, [(bh * N + n) * K, 0], dsb_s)
        # the gates and v (for dbeta) are plain loads: issued before the wait, so that their latency overlaps it
        gc, glast, bk = _gates(g, beta, scal_base, t0, H)
        pos = (b.to(gl.int64) * T + t0 + rows_tv)[:, None] * (H * V) + hv + cols_tv[None, :]
        vk = gl.load(v + pos)
        mbarrier.wait(bars.index(s), (i // 2) & 1)
        ks = k_s.index(s)
        qs = q_s.index(s)
        ps = p_s.index(s)
        dos = do_s.index(s)
        as_t = a_s.index(s).permute((1, 0))                                     # A^T

        # dVn = scores_t dO + (K Gam/gam) dS'
        gc_b = gl.convert_layout(gc, gl.SliceLayout(1, blk))
        kdec = (ks.load(blk).to(gl.float32) * gl.exp(glast - gc_b)[:, None]).to(dtype)
        # scores_t = (K Q^T) * scale * E^T
        gc_r = gl.convert_layout(gc, gl.SliceLayout(1, acc_tt))
        gc_c = gl.convert_layout(gc, gl.SliceLayout(0, acc_tt))
        sc = warpgroup_mma(ks, qs.permute((1, 0)), gl.zeros([BT, BT], gl.float32, acc_tt))
        sc = warpgroup_mma_wait(0, deps=[sc])
        et = gl.exp(gl.where(j_tt >= i_tt, gc_c[None, :] - gc_r[:, None], float("-inf")))
        sc = (sc * et * scale).to(dtype)

        a_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_tv, k_width=2)
        dvn = warpgroup_mma(gl.convert_layout(sc, a_op), dos, gl.zeros([BT, V], gl.float32, acc_tv), is_async=True)
        dvn = warpgroup_mma(gl.convert_layout(kdec, a_op), dsb_s, dvn, is_async=True)
        dvn = warpgroup_mma_wait(0, deps=[dvn])
        dvn_s.store(dvn.to(dtype))
        fence_async_shared()
        gl.thread_barrier()

        # -W^T = (-(beta gam) P)^T A^T, then dS = Gam dS' + ((gam scale) Q)^T dO + (-W^T) dVn
        gc_t = gl.convert_layout(gc, gl.SliceLayout(0, blk_t))
        bk_t = gl.convert_layout(bk, gl.SliceLayout(0, blk_t))
        pt = ps.permute((1, 0)).load(blk_t).to(gl.float32) * -(bk_t * gl.exp(gc_t))[None, :]
        a_op_k: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_k64, k_width=2)
        w_t = warpgroup_mma(gl.convert_layout(pt.to(dtype), a_op_k), as_t, gl.zeros([K, BT], gl.float32, acc_k64))
        w_t = warpgroup_mma_wait(0, deps=[w_t])
        qt = qs.permute((1, 0)).load(blk_t).to(gl.float32) * (gl.exp(gc_t) * scale)[None, :]
        a_op_s: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_kv, k_width=2)
        dS = warpgroup_mma(gl.convert_layout(qt.to(dtype), a_op_s), dos, dS * gl.exp(glast), is_async=True)
        dS = warpgroup_mma(gl.convert_layout(w_t.to(dtype), a_op_s), dvn_s, dS, is_async=True)

        # X = A^T dVn, dv = beta X, sum_v(v X)
        x = warpgroup_mma(as_t, dvn_s, gl.zeros([BT, V], gl.float32, acc_tv), is_async=True)
        x, dS = warpgroup_mma_wait(0, deps=[x, dS])
        bk_r = gl.convert_layout(bk, gl.SliceLayout(1, acc_tv))
        gl.store(dbeta_v + scal_base + (t0 + rows_tv) * H, gl.sum(vk.to(gl.float32) * x, 1))
        # X and dv through shared memory and TMA stores (dvn_s is free once both products have read it)
        dvn_s.store(x.to(dtype))
        dv_s.store((bk_r[:, None] * x).to(dtype))
        fence_async_shared()
        gl.thread_barrier()
        tma.async_copy_shared_to_global(x_desc, [bh * T + t0, 0], dvn_s)
        tma.async_copy_shared_to_global(dv_desc, [row0 + t0, hv], dv_s)
        gl.thread_barrier()  # every warpgroup's products have read this stage and dvn_s
    tma.store_wait(0)
    for st in gl.static_range(2):
        mbarrier.invalidate(bars.index(st))


def _desc(x2d, block):
    layout = gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16)
    return TensorDescriptor.from_tensor(x2d, block, layout)


def reverse_scan_gluon(q, k, v, p, beta, g, do, A, scale):
    """(dS' (BH, N, K, V), X (BH, T, V), dv, dbeta_v (1, B, T, H)) as the Triton reverse scan with one V block."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    N = T // 64
    dS = torch.empty(B * H, N, K, V, device=q.device, dtype=torch.bfloat16)
    X = torch.empty(B * H, T, V, device=q.device, dtype=torch.bfloat16)
    dv = torch.empty_like(v)
    dbeta_v = torch.empty(1, B, T, H, device=q.device, dtype=torch.float32)
    d = lambda x, D: _desc(x.view(B * T, H * D), [64, D])  # noqa: E731
    a_desc = _desc(A.view(-1, 64), [64, 64])
    ds_desc = _desc(dS.view(-1, V), [K, V])
    x_desc = _desc(X.view(-1, V), [64, V])
    _rev_kernel[(B * H,)](d(k, K), d(q, K), d(p, K), d(do, V), a_desc, ds_desc, x_desc, d(dv, V), v, beta, g, dbeta_v,
                          scale, N, H, K, V, num_warps=WARPS)
    return dS, X, dv, dbeta_v
