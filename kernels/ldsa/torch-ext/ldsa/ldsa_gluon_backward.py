"""The LDSA backward for 16-bit values and windows of up to 15 taps on Hopper, written in Gluon like the forward
(`ldsa_gluon`): no band is gathered through shared memory; two skewed shared-memory views do the band work.

Per 64-frame chunk of one (b, h), STAGES deep on a persistent grid (TMA loads, zero fill outside the tensors):
- dlogits of the chunk's frames. P = G^T V ([32 frames t, 48 span positions s] a 32-frame block, `mma.sync` over
  Dh) is stored to shared memory at row stride 64 and read back at stride 65: element (t, c) of the read view is
  P[t, t + c], so da[k, t] = P[t, t + k + sh] sits at column c = k + sh (sh = lead - left) with no gather. The
  logits come through a 3-D descriptor [BH, W, T] at tap coordinate -sh, so that tap k sits at row c too (TMA
  zero-fills the rows before tap 0 and past tap W - 1). dlogits = a (da - sum a da), stored through pointers
  (a 16-row TMA store would write the next head's taps).
- dv of the chunk's positions p: G Y^T, the forward's product with grad_out in place of v and the transposed band
  Y^T[u, p] = a[p - u + c2, u] (u: frames from p0 - lead_r, c2 = left + lead_r). The weights of a block's 48
  frames are stored, frame u at row 16 + u and tap k at column 16 - c2 + k (logits loaded at tap coordinate
  c2 - 16), into a buffer of row stride 65 whose other cells stay zero; read through a plain view of row
  stride 64, rows 16 + u and columns [32, 64), that buffer is the band, loaded straight into the MMA's B-operand
  layout. The weights go as hi|lo words, two MMAs, as in the forward.
Windows: W - 1 + sh <= 16 (the forward's rule: the dlogits part reads 48 span positions a block) and c2 <= 16
(the dv part reads 48 frames a block).
"""

import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

from .ldsa_gluon import BLOCK, CHUNK, GL_DTYPES, HALO, WARPS
from .window_weights import _hi_lo_pairs, _window_softmax

ROWS = gl.constexpr(32)  # logits rows a box: the taps shifted by up to 16
# Programs an SM (110.6 KB of shared memory each at Dh = 64, offline sm_90a) and pipeline stages: not yet tuned.
PROGRAMS_PER_SM = 2
STAGES = 2


@gluon.jit
def _issue(lg_desc, lgh_desc, v_desc, vh_desc, g_desc, gh_desc, lg1_s, lg2_s, lg2h_s, v_s, vh_s, gc_s, ga_s, gh_s,
           bar, i, n_chunks, sh, c2, lead, lead_r, DH: gl.constexpr, pred):
    """Start the copies of chunk i's tiles into one pipeline stage (where pred): the logits of its frames with tap
    k at row k + sh, the logits of the frames from t0 - lead_r with tap k at row k + 16 - c2, the value span from
    t0 - lead, grad_out of the chunk's frames and its span from t0 - lead_r."""
    bh = i // n_chunks
    t0 = (i % n_chunks) * CHUNK
    nbytes: gl.constexpr = (2 * lg_desc.block_type.nbytes + lgh_desc.block_type.nbytes + v_desc.block_type.nbytes
                            + vh_desc.block_type.nbytes + 2 * g_desc.block_type.nbytes + gh_desc.block_type.nbytes)
    mbarrier.expect(bar, nbytes, pred=pred)
    tma.async_copy_global_to_shared(lg_desc, [bh, -sh, t0], bar, lg1_s, pred)
    tma.async_copy_global_to_shared(lg_desc, [bh, c2 - 16, t0 - lead_r], bar, lg2_s, pred)
    tma.async_copy_global_to_shared(lgh_desc, [bh, c2 - 16, t0 - lead_r + CHUNK], bar, lg2h_s, pred)
    tma.async_copy_global_to_shared(v_desc, [bh * DH, t0 - lead], bar, v_s, pred)
    tma.async_copy_global_to_shared(vh_desc, [bh * DH, t0 - lead + CHUNK], bar, vh_s, pred)
    tma.async_copy_global_to_shared(g_desc, [bh * DH, t0], bar, gc_s, pred)
    tma.async_copy_global_to_shared(g_desc, [bh * DH, t0 - lead_r], bar, ga_s, pred)
    tma.async_copy_global_to_shared(gh_desc, [bh * DH, t0 - lead_r + CHUNK], bar, gh_s, pred)


@gluon.jit
def _ldsa_backward_gluon_kernel(lg_desc, lgh_desc, v_desc, vh_desc, g_desc, gh_desc, dv_desc, dl_ptr, T, W, left,
                                lead, lead_r, n_chunks, all_chunks, DH: gl.constexpr, STAGES: gl.constexpr):
    """The backward on a persistent grid: chunks i = pid, pid + programs, ... of all (b, h, chunk). The logits
    descriptors view a_logits as [B*H, W, T]; the others view v, grad_out and dv as [B*H*DH, T]."""
    dtype: gl.constexpr = v_desc.dtype
    sh = lead - left
    c2 = left + lead_r
    mma_dv: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, WARPS], instr_shape=[16, 8])
    a_dv: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_dv, k_width=2)
    b_dv: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma_dv, k_width=2)
    mma_p: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[2, 2], instr_shape=[16, 8])
    a_p: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_p, k_width=2)
    b_p: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma_p, k_width=2)
    # One element a thread along a padded buffer's rows: Gluon vectorises padded-layout accesses as if the rows
    # were aligned (a vector at an odd row stride is a misaligned address).
    l_da: gl.constexpr = gl.BlockedLayout([1, 1], [8, 4], [WARPS, 1], [1, 0])  # [32 frames, 32 shifted taps]
    l_w: gl.constexpr = gl.BlockedLayout([1, 1], [4, 8], [WARPS, 1], [1, 0])  # [16 frames, 32 shifted taps]
    plain: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    stride65: gl.constexpr = gl.PaddedSharedLayout.with_identity_for([[64, 1]], [64, 64], [1, 0])

    lg1_s = gl.allocate_shared_memory(lg_desc.dtype, [STAGES, 1, ROWS, CHUNK], lg_desc.layout)
    lg2_s = gl.allocate_shared_memory(lg_desc.dtype, [STAGES, 1, ROWS, CHUNK], lg_desc.layout)
    lg2h_s = gl.allocate_shared_memory(lg_desc.dtype, [STAGES, 1, ROWS, HALO], lgh_desc.layout)
    v_s = gl.allocate_shared_memory(dtype, [STAGES, DH, CHUNK], v_desc.layout)
    vh_s = gl.allocate_shared_memory(dtype, [STAGES, DH, HALO], vh_desc.layout)
    gc_s = gl.allocate_shared_memory(dtype, [STAGES, DH, CHUNK], g_desc.layout)
    ga_s = gl.allocate_shared_memory(dtype, [STAGES, DH, CHUNK], g_desc.layout)
    gh_s = gl.allocate_shared_memory(dtype, [STAGES, DH, HALO], gh_desc.layout)
    # 32 x 64 cells; the stride-65 view below reads up to cell 65 * 31 + 31 = 2046 of them
    p_s = gl.allocate_shared_memory(gl.float32, [32, 64], plain)
    w_s = gl.allocate_shared_memory(gl.int32, [64, 64], stride65)
    dv_s = gl.allocate_shared_memory(dtype, [DH, CHUNK], dv_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for st in gl.static_range(STAGES):
        mbarrier.init(bars.index(st), count=1)
    # The band buffer's cells outside the stored columns stay zero: rows 0-15, columns 32-63 and the padding.
    flat: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    zl: gl.constexpr = gl.BlockedLayout([4], [32], [WARPS], [0])
    cells = w_s._reinterpret(gl.int32, [8192], flat)  # 64 x 65 = 4160 of them allocated
    cells.slice(0, 4096).store(gl.zeros([4096], gl.int32, zl))
    cells.slice(4096, 64).store(gl.zeros([64], gl.int32, zl))
    p_skew: gl.constexpr = gl.PaddedSharedLayout.with_identity_for([[64, 1]], [32, 64], [1, 0])
    p_view = p_s._reinterpret(gl.float32, [32, 64], p_skew)  # element (t, c) = P[t, t + c]
    band_view = w_s._reinterpret(gl.int32, [64, 64], plain)  # rows 16 + u, columns 32 + p: Y^T[u, p]

    pid = gl.program_id(0)
    programs = gl.num_programs(0)
    count = (all_chunks - pid + programs - 1) // programs
    for st in gl.static_range(STAGES - 1):
        _issue(lg_desc, lgh_desc, v_desc, vh_desc, g_desc, gh_desc, lg1_s.index(st), lg2_s.index(st),
               lg2h_s.index(st), v_s.index(st), vh_s.index(st), gc_s.index(st), ga_s.index(st), gh_s.index(st),
               bars.index(st), pid + st * programs, n_chunks, sh, c2, lead, lead_r, DH, st < count)

    t_i = gl.expand_dims(gl.arange(0, BLOCK, layout=gl.SliceLayout(1, l_da)), 1)  # [32, 1] frames
    c_i = gl.expand_dims(gl.arange(0, ROWS, layout=gl.SliceLayout(0, l_da)), 0)  # [1, 32] shifted taps
    tap1 = c_i - sh
    ok1 = (tap1 >= 0) & (tap1 < W)
    r2 = gl.expand_dims(gl.arange(0, ROWS, layout=gl.SliceLayout(0, l_w)), 0)  # [1, 32]
    u_i = gl.expand_dims(gl.arange(0, 16, layout=gl.SliceLayout(1, l_w)), 1)  # [16, 1]
    tap2 = r2 - (16 - c2) + 0 * u_i
    ok2 = (tap2 >= 0) & (tap2 < W)

    for it in range(count):
        s = it % STAGES
        gl.thread_barrier()
        nxt = it + STAGES - 1
        ns = nxt % STAGES
        _issue(lg_desc, lgh_desc, v_desc, vh_desc, g_desc, gh_desc, lg1_s.index(ns), lg2_s.index(ns),
               lg2h_s.index(ns), v_s.index(ns), vh_s.index(ns), gc_s.index(ns), ga_s.index(ns), gh_s.index(ns),
               bars.index(ns), pid + nxt * programs, n_chunks, sh, c2, lead, lead_r, DH, nxt < count)
        mbarrier.wait(bars.index(s), (it // STAGES) & 1)
        i = pid + it * programs
        bh = i // n_chunks
        t0 = (i % n_chunks) * CHUNK
        tma.store_wait(0)
        gl.thread_barrier()

        # (i) dlogits, a block of 32 frames at a time
        for b in gl.static_range(CHUNK // BLOCK):
            gt = gc_s.index(s).slice(BLOCK * b, BLOCK, dim=1).permute((1, 0)).load(a_p)  # [32 t, DH]
            for j in gl.static_range(3):
                if BLOCK * b + 16 * j < CHUNK:
                    vals = v_s.index(s).slice(BLOCK * b + 16 * j, 16, dim=1).load(b_p)
                else:
                    vals = vh_s.index(s).load(b_p)
                pj = mma_v2(gt, vals, gl.zeros([BLOCK, 16], gl.float32, mma_p))
                p_s.slice(16 * j, 16, dim=1).store(pj)
            gl.thread_barrier()
            da = p_view.slice(0, ROWS, dim=1).load(l_da)  # da[t, c] = P[t, t + c]
            logits = lg1_s.index(s).reshape([ROWS, CHUNK]).slice(BLOCK * b, BLOCK, dim=1).permute((1, 0)).load(l_da)
            a1 = _window_softmax(logits, ok1, 1)
            da = gl.where(ok1, da, 0.0)
            dl = a1 * (da - gl.expand_dims(gl.sum(a1 * da, 1), 1))
            t = t0 + BLOCK * b + t_i
            rows = (bh * W + tap1).to(gl.int64) * T
            gl.store(dl_ptr + rows + t, dl.to(dl_ptr.dtype.element_ty), mask=ok1 & (t < T))
            gl.thread_barrier()  # p_s is read before the next block overwrites it

        # (ii) dv, a block of 32 positions at a time
        for b in gl.static_range(CHUNK // BLOCK):
            for kk in gl.static_range(3):
                if BLOCK * b + 16 * kk < CHUNK:
                    lg = lg2_s.index(s).reshape([ROWS, CHUNK]).slice(BLOCK * b + 16 * kk, 16, dim=1)
                else:
                    lg = lg2h_s.index(s).reshape([ROWS, HALO])
                w2 = _window_softmax(lg.permute((1, 0)).load(l_w), ok2, 1)  # [16 frames, 32 shifted taps]
                w_s.slice(16 + 16 * kk, 16, dim=0).slice(0, ROWS, dim=1).store(_hi_lo_pairs(w2, dtype))
            gl.thread_barrier()
            acc = gl.zeros([DH, BLOCK], gl.float32, mma_dv)
            for kk in gl.static_range(3):
                if BLOCK * b + 16 * kk < CHUNK:
                    gu = ga_s.index(s).slice(BLOCK * b + 16 * kk, 16, dim=1).load(a_dv)
                else:
                    gu = gh_s.index(s).load(a_dv)
                band = band_view.slice(16 + 16 * kk, 16, dim=0).slice(32, BLOCK, dim=1).load(b_dv)
                acc = mma_v2(gu, band.to(gl.int16).to(dtype, bitcast=True), acc)
                acc = mma_v2(gu, (band >> 16).to(gl.int16).to(dtype, bitcast=True), acc)
            dv_s.slice(BLOCK * b, BLOCK, dim=1).store(acc.to(dtype))
            gl.thread_barrier()  # w_s is read before the next block overwrites it
        fence_async_shared()
        gl.thread_barrier()
        tma.async_copy_shared_to_global(dv_desc, [bh * DH, t0], dv_s)

    tma.store_wait(0)
    for st in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(st))


def takes(W: int, left: int, Dh: int, T: int, BH: int, dtype: torch.dtype) -> bool:
    """Whether this kernel takes a call: 16-bit values, 2 to 15 taps with right + lead <= 16 and left + lead_r <= 16
    (lead, lead_r: left and right rounded up to 8, the spans' TMA column offsets), T a multiple of 8, Dh 16 to 64
    and int32 row coordinates."""
    right = W - 1 - left
    lead, lead_r = -(-left // 8) * 8, -(-right // 8) * 8
    return (2 <= W <= 15 and right + lead <= 16 and left + lead_r <= 16 and dtype in (torch.bfloat16, torch.float16)
            and T % 8 == 0 and Dh in (16, 32, 64) and BH * max(Dh, W) < 2**31)


@functools.cache
def layouts(dtype: torch.dtype, Dh: int) -> tuple:
    """The shared-memory layouts of the logits boxes ([1, ROWS, CHUNK] and [1, ROWS, HALO] of [BH, W, T]) and of
    the value, grad_out and dv boxes ([Dh, CHUNK] and [Dh, HALO])."""
    boxes = ([1, ROWS.value, CHUNK.value], [1, ROWS.value, HALO.value], [Dh, CHUNK.value], [Dh, HALO.value])
    return tuple(gl.NVMMASharedLayout.get_default_for(box, GL_DTYPES[dtype]) for box in boxes)
