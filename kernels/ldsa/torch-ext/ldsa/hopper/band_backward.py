"""The LDSA backward for windows of up to 15 taps on Hopper, 16-bit and float32 values, written in Gluon like the
forward (`band_forward`): no band is gathered through shared memory; skewed shared-memory views do the band work.

A chunk is 64 frames of one (b, h), on a persistent grid, in two parts. Each part has its own TMA boxes (zero fill
outside the tensors; 128-byte rows as in the forward, one box a chunk in 16-bit and two in float32, and a 16-frame
halo) and its own barrier, so the next chunk's boxes for one part load while the other part runs:
- dlogits of the chunk's frames. P = G^T V ([32 frames t, 48 span positions s] a 32-frame block, `mma.sync` over
  Dh; the span starts at t0 - lead) is stored to shared memory at row stride 72 and read back at row stride 73
  from cell sh = lead - left: element (t, k) of that view is P[t, t + k + sh] = da[k, t], with no gather.
  dlogits = a (da - sum a da), stored through pointers (a 16-row TMA store would write the next head's taps).
- dv of the chunk's positions p: G Y^T with the transposed band Y^T[u, p] = a[p - u + c2, u] (u: frames from
  p0 - lead_r, c2 = left + lead_r). The weights of a block's 48 frames are stored, frame u at row 16 + u and tap
  k at column 16 - W + k, at row stride 69 (73 in float32) from cell e_s, and read back one stride lower from
  cell e_r (e_r - e_s = c2 - W): rows 16 + u and columns [32, 64) of that view are the band (the buffer's other
  cells stay zero), loaded straight into the MMA's B-operand layout; hi|lo words and two MMAs for 16-bit values,
  as in the forward (`band_mma.band_product`).
Float32 operands take three TF32 MMAs of split operands in both products (`band_mma.precise_product`); the P
product reads their Dh rows in `K_ORDER` and the dv product's warps split Dh, which keeps the operand reads cheap.

From Triton 3.8 a padded buffer is reinterpreted only as a layout of its own padding pattern, so there the skewed
views are a shared-memory gather (dlogits) and a scatter (dv) at the same cells (`SKEW_BY_INDEX`).

lead and lead_r are left and right rounded up to 8 frames: a TMA box offset that is not a multiple of 16 bytes is
an illegal instruction on the H200. The cell offsets sh, e_s and e_r put every tap in the 16 rows of a logits box
whatever the window. The padded row strides keep the shared-memory accesses free of bank conflicts, or two-way at
most; at the plain strides 64 and 65 the conflicts bound the kernel. Windows: right + lead <= 16 (the dlogits part
reads 48 span positions a block) and left + lead_r <= 16 (the dv part reads 48 frames a block).
"""

import functools

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

from ..common import gluon_compat as compat
from ..portable.band import round_up
from ..common.launch import Launch, sm_count
from ..portable.window_weights import window_softmax
from .band_mma import BLOCK, CHUNK, GL_DTYPES, HALO, WARPS, band_product, box_frames, precise_product, weight_words

ROWS = gl.constexpr(16)  # logits rows a box: the taps
# Programs an SM by the values' bytes an element: three in 16-bit (69 KB of shared memory each at Dh = 64), two
# in float32 (112.7 KB at Dh = 64).
PROGRAMS_PER_SM = {2: 3, 4: 2}
# How the skews are made. Triton 3.6 and 3.7: through views of the buffers at other row strides (padded layouts of
# other padding patterns). From 3.8 a padded buffer is not reinterpreted as another padding pattern, so the same
# cells are addressed by shared-memory gathers (the dlogits part) and scatters (the dv part), which 3.6 lacks.
SKEW_BY_INDEX = gl.constexpr(tuple(int(part) for part in triton.__version__.split(".")[:2]) >= (3, 8))


@gluon.jit
def _issue_dlogits_boxes(lg_desc, v_desc, vh_desc, g_desc, lg_s, v_s, vh_s, g_s, bar, i, n_chunks, lead,
                         DH: gl.constexpr, pred):
    """Start the copies of chunk i's boxes for the dlogits part (where pred): the logits of its frames (tap k at
    row k), the value span from t0 - lead and grad_out of its frames, CHUNK // BOX boxes of each and the halo."""
    BOX: gl.constexpr = v_desc.block_type.shape[1]
    NBOX: gl.constexpr = CHUNK // BOX
    bh = i // n_chunks
    t0 = (i % n_chunks) * CHUNK
    nbytes: gl.constexpr = (NBOX * (lg_desc.block_type.nbytes + v_desc.block_type.nbytes + g_desc.block_type.nbytes)
                            + vh_desc.block_type.nbytes)
    mbarrier.expect(bar, nbytes, pred=pred)
    for n in gl.static_range(NBOX):
        compat.tma_load(lg_desc, [bh, 0, t0 + BOX * n], bar, lg_s.index(n), pred)
        compat.tma_load(v_desc, [bh * DH, t0 - lead + BOX * n], bar, v_s.index(n), pred)
        compat.tma_load(g_desc, [bh * DH, t0 + BOX * n], bar, g_s.index(n), pred)
    compat.tma_load(vh_desc, [bh * DH, t0 - lead + CHUNK], bar, vh_s, pred)


@gluon.jit
def _issue_dv_boxes(lg_desc, lgh_desc, g_desc, gh_desc, lg_s, lgh_s, g_s, gh_s, bar, i, n_chunks, W, lead_r,
                    DH: gl.constexpr, pred):
    """Start the copies of chunk i's boxes for the dv part (where pred): the logits and grad_out of the frames
    from t0 - lead_r (tap k of the logits at row ROWS - W + k), CHUNK // BOX boxes of each and the halos."""
    BOX: gl.constexpr = g_desc.block_type.shape[1]
    NBOX: gl.constexpr = CHUNK // BOX
    bh = i // n_chunks
    t0 = (i % n_chunks) * CHUNK - lead_r
    nbytes: gl.constexpr = (NBOX * (lg_desc.block_type.nbytes + g_desc.block_type.nbytes)
                            + lgh_desc.block_type.nbytes + gh_desc.block_type.nbytes)
    mbarrier.expect(bar, nbytes, pred=pred)
    for n in gl.static_range(NBOX):
        compat.tma_load(lg_desc, [bh, W - ROWS, t0 + BOX * n], bar, lg_s.index(n), pred)
        compat.tma_load(g_desc, [bh * DH, t0 + BOX * n], bar, g_s.index(n), pred)
    compat.tma_load(lgh_desc, [bh, W - ROWS, t0 + CHUNK], bar, lgh_s, pred)
    compat.tma_load(gh_desc, [bh * DH, t0 + CHUNK], bar, gh_s, pred)


@gluon.jit
def _frames(boxes, halo, start: gl.constexpr, n: gl.constexpr):
    """Frames [start, start + n) of a chunk's span (within one box), a [rows, n] view: its CHUNK // BOX boxes
    ([NBOX, rows, BOX], or [NBOX, 1, rows, BOX] for the logits' 3-D boxes), then the halo box."""
    RANK: gl.constexpr = len(boxes.shape)
    BOX: gl.constexpr = boxes.shape[RANK - 1]
    NROWS: gl.constexpr = boxes.shape[RANK - 2]
    if start < CHUNK:
        view = boxes.index(start // BOX)
        start_in: gl.constexpr = start % BOX
    else:
        view = halo
        start_in: gl.constexpr = start - CHUNK
    if RANK == 4:
        view = view.reshape([NROWS, view.shape[2]])
    return view.slice(start_in, n, dim=1)


@gluon.jit
def _at_cell(buf, offset, dtype: gl.constexpr, shape: gl.constexpr, layout: gl.constexpr):
    """A view of `buf` from cell `offset` on (a runtime offset: a [N, 1, 1] view's row, reinterpreted)."""
    column: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    cell = compat.reinterpret(buf, dtype, [8192, 1, 1], column).index(offset)
    return compat.reinterpret(cell, dtype, shape, layout)


@gluon.jit
def _band_backward_gluon_kernel(lg_desc, lgh_desc, v_desc, vh_desc, g_desc, gh_desc, dv_desc, dl_ptr, T, W, left,
                                lead, lead_r, n_chunks, all_chunks, DH: gl.constexpr, BOX_VIEW: gl.constexpr,
                                HALO_VIEW: gl.constexpr):
    """The backward on a persistent grid: chunks i = pid, pid + programs, ... of all (b, h, chunk). The logits
    descriptors view a_logits as [B*H, W, T]; the others view v, grad_out and dv as [B*H*DH, T]. Boxes are
    BOX = 128 bytes of frames wide (`band_mma.box_frames`), CHUNK // BOX of them a chunk. BOX_VIEW and HALO_VIEW
    (`p_operand_views`) are the layouts through which the P product reads the grad_out and value boxes."""
    dtype: gl.constexpr = v_desc.dtype
    KW: gl.constexpr = 32 // dtype.primitive_bitwidth  # the MMA operands' k_width: elements in 32 bits
    BOX: gl.constexpr = v_desc.block_type.shape[1]
    NBOX: gl.constexpr = CHUNK // BOX
    sh = lead - left
    c2 = left + lead_r
    # The dv product's warps: along the positions for 16-bit values, each warp then reading the whole grad_out
    # operand; along Dh for float32, whose grad_out operand each warp would otherwise split into TF32 parts too.
    if KW == 1:
        dv_warps: gl.constexpr = [WARPS, 1]
    else:
        dv_warps: gl.constexpr = [1, WARPS]
    mma_dv: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=dv_warps, instr_shape=[16, 8])
    a_dv: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_dv, k_width=KW)
    b_dv: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma_dv, k_width=KW)
    mma_p: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[2, 2], instr_shape=[16, 8])
    a_p: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_p, k_width=KW)
    b_p: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma_p, k_width=KW)
    # One element a thread along a padded view's rows: Gluon vectorises padded-layout accesses as if the rows
    # were aligned (a vector at an odd row stride is a misaligned address).
    l_da: gl.constexpr = gl.BlockedLayout([1, 1], [8, 4], [WARPS, 1], [1, 0])  # [32 frames, 16 taps]
    l_w: gl.constexpr = gl.BlockedLayout([1, 1], [4, 8], [WARPS, 1], [1, 0])  # [16 frames, 16 tap columns]
    # Row strides: P stored at 72 (8-byte pairs, no conflicts) and read at 73 (columns < 32 of [[32, 4], [64, 1]]
    # are 73 apart). The band is read one stride below the weights' store: the B operand's lanes q = 0..3 read
    # rows 2q and 2q + 1 in 16-bit (k_width 2), rows q in float32, which strides 68 and 72 put 8 banks apart; the
    # weights are stored at 69 and 73 (columns < 32 of [[32, 2], [64, 1]] and [[32, 4], [64, 1]]), in a buffer
    # of 64 rows of 72 or 80 cells.
    p_rows: gl.constexpr = gl.PaddedSharedLayout.with_identity_for([[64, 8]], [32, 64], [1, 0])
    p_skew: gl.constexpr = gl.PaddedSharedLayout.with_identity_for([[32, 4], [64, 1]], [32, 64], [1, 0])
    if KW == 1:
        w_rows: gl.constexpr = gl.PaddedSharedLayout.with_identity_for([[64, 16]], [64, 64], [1, 0])
        w_skew: gl.constexpr = gl.PaddedSharedLayout.with_identity_for([[32, 4], [64, 1]], [64, 64], [1, 0])
        band_rows: gl.constexpr = gl.PaddedSharedLayout.with_identity_for([[64, 8]], [64, 64], [1, 0])
        W_CELLS: gl.constexpr = 64 * 80
    else:
        w_rows: gl.constexpr = gl.PaddedSharedLayout.with_identity_for([[64, 8]], [64, 64], [1, 0])
        w_skew: gl.constexpr = gl.PaddedSharedLayout.with_identity_for([[32, 2], [64, 1]], [64, 64], [1, 0])
        band_rows: gl.constexpr = gl.PaddedSharedLayout.with_identity_for([[64, 4]], [64, 64], [1, 0])
        W_CELLS: gl.constexpr = 64 * 72

    # The logits boxes are [1, ROWS, BOX] boxes of [B*H, W, T].
    lg1_s = gl.allocate_shared_memory(lg_desc.dtype, [NBOX, 1, ROWS, BOX], lg_desc.layout)
    lg2_s = gl.allocate_shared_memory(lg_desc.dtype, [NBOX, 1, ROWS, BOX], lg_desc.layout)
    lg2h_s = gl.allocate_shared_memory(lg_desc.dtype, [1, ROWS, HALO], lgh_desc.layout)
    v_s = gl.allocate_shared_memory(dtype, [NBOX, DH, BOX], v_desc.layout)
    vh_s = gl.allocate_shared_memory(dtype, [DH, HALO], vh_desc.layout)
    gc_s = gl.allocate_shared_memory(dtype, [NBOX, DH, BOX], g_desc.layout)
    ga_s = gl.allocate_shared_memory(dtype, [NBOX, DH, BOX], g_desc.layout)
    gh_s = gl.allocate_shared_memory(dtype, [DH, HALO], gh_desc.layout)
    # 32 x 72 cells; the skewed view reads up to cell 7 + 73 * 31 + 15 = 2285 of them
    p_s = gl.allocate_shared_memory(gl.float32, [32, 64], p_rows)
    if SKEW_BY_INDEX:
        w_s = gl.allocate_shared_memory(gl.int32, [64, 64], band_rows)
    else:
        # W_CELLS cells; the weights go up to cell 1 + 69 * 63 + 15 = 4363 (1 + 73 * 63 + 15 = 4615 in float32),
        # the band up to 6 + 68 * 63 + 63 = 4353 (4605)
        w_s = gl.allocate_shared_memory(gl.int32, [64, 64], w_rows)
    dv_s = gl.allocate_shared_memory(dtype, [NBOX, DH, BOX], dv_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for part in gl.static_range(2):
        mbarrier.init(bars.index(part), count=1)
    gc_p = compat.reinterpret(gc_s, dtype, [NBOX, DH, BOX], BOX_VIEW)
    v_p = compat.reinterpret(v_s, dtype, [NBOX, DH, BOX], BOX_VIEW)
    vh_p = compat.reinterpret(vh_s, dtype, [DH, HALO], HALO_VIEW)
    # The band buffer's cells other than the stored weights stay zero, all chunks long.
    if SKEW_BY_INDEX:
        zl: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [WARPS, 1], [1, 0])
        w_s.store(gl.zeros([64, 64], gl.int32, zl))
        band_view = w_s  # rows 16 + u, columns 32 + p: Y^T[u, p]
    else:
        flat: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
        zl: gl.constexpr = gl.BlockedLayout([4], [32], [WARPS], [0])
        cells = compat.reinterpret(w_s, gl.int32, [8192], flat)
        cells.slice(0, 4096).store(gl.zeros([4096], gl.int32, zl))
        cells.slice(4096, W_CELLS - 4096).store(gl.zeros([W_CELLS - 4096], gl.int32, zl))
        e_r = gl.maximum(c2 - W, 0)
        e_s = gl.maximum(W - c2, 0)
        da_view = _at_cell(p_s, sh, gl.float32, [32, 64], p_skew)  # (t, k): P[t, t + k + sh] = da[k, t]
        w_view = _at_cell(w_s, e_s, gl.int32, [64, 64], w_skew)
        band_view = _at_cell(w_s, e_r, gl.int32, [64, 64], band_rows)  # rows 16 + u, columns 32 + p: Y^T[u, p]

    pid = gl.program_id(0)
    programs = gl.num_programs(0)
    count = (all_chunks - pid + programs - 1) // programs
    _issue_dlogits_boxes(lg_desc, v_desc, vh_desc, g_desc, lg1_s, v_s, vh_s, gc_s, bars.index(0), pid, n_chunks,
                         lead, DH, count > 0)
    _issue_dv_boxes(lg_desc, lgh_desc, g_desc, gh_desc, lg2_s, lg2h_s, ga_s, gh_s, bars.index(1), pid, n_chunks, W,
                    lead_r, DH, count > 0)

    t_i = gl.expand_dims(gl.arange(0, BLOCK, layout=gl.SliceLayout(1, l_da)), 1)  # [32, 1] frames
    tap1 = gl.expand_dims(gl.arange(0, ROWS, layout=gl.SliceLayout(0, l_da)), 0)  # [1, 16] taps
    ok1 = tap1 < W
    col2 = gl.expand_dims(gl.arange(0, ROWS, layout=gl.SliceLayout(0, l_w)), 0)  # [1, 16] tap columns
    u_i = gl.expand_dims(gl.arange(0, 16, layout=gl.SliceLayout(1, l_w)), 1)  # [16, 1] frames
    ok2 = (col2 + 0 * u_i) >= ROWS - W

    for it in range(count):
        i = pid + it * programs
        bh = i // n_chunks
        t0 = (i % n_chunks) * CHUNK
        mbarrier.wait(bars.index(0), it & 1)

        # dlogits, a block of 32 frames at a time
        for b in gl.static_range(CHUNK // BLOCK):
            gt = _frames(gc_p, gc_p, BLOCK * b, BLOCK).permute((1, 0)).load(a_p)  # [32 t, DH]
            for j in gl.static_range(3):
                vals = _frames(v_p, vh_p, BLOCK * b + 16 * j, 16).load(b_p)
                pj = precise_product(gt, vals, gl.zeros([BLOCK, 16], gl.float32, mma_p))
                p_s.slice(16 * j, 16, dim=1).store(pj)
            compat.barrier()
            if SKEW_BY_INDEX:  # the addresses of the skewed view: P[t, t + k + sh] at cell 73 t + k + sh
                da = gl.where(ok1, p_s.gather(t_i + tap1 + sh, 1), 0.0)
            else:
                da = gl.where(ok1, da_view.slice(0, ROWS, dim=1).load(l_da), 0.0)
            logits = _frames(lg1_s, lg1_s, BLOCK * b, BLOCK).permute((1, 0)).load(l_da)
            a1 = window_softmax(logits, ok1, 1)
            dl = a1 * (da - gl.expand_dims(gl.sum(a1 * da, 1), 1))
            t = t0 + BLOCK * b + t_i
            rows = (bh * W + tap1).to(gl.int64) * T
            gl.store(dl_ptr + rows + t, dl.to(dl_ptr.dtype.element_ty), mask=ok1 & (t < T))
            compat.barrier()  # p_s is read before the next block overwrites it
        _issue_dlogits_boxes(lg_desc, v_desc, vh_desc, g_desc, lg1_s, v_s, vh_s, gc_s, bars.index(0), i + programs,
                             n_chunks, lead, DH, it + 1 < count)
        mbarrier.wait(bars.index(1), it & 1)
        tma.store_wait(0)  # dv_s: the previous chunk's store has read it
        compat.barrier()

        # dv, a block of 32 positions at a time
        for b in gl.static_range(CHUNK // BLOCK):
            for kk in gl.static_range(3):
                lg = _frames(lg2_s, lg2h_s, BLOCK * b + 16 * kk, 16)
                w2 = window_softmax(lg.permute((1, 0)).load(l_w), ok2, 1)  # [16 frames, 16 tap columns]
                if SKEW_BY_INDEX:
                    # Tap column c of frame u (row 16 + u) at band column 16 + u + c + W - c2, the place the skewed
                    # view stores it; the columns outside the band's [32, 64) go to column c, which no band read
                    # reaches.
                    column = 16 + 16 * kk + u_i + col2 + (W - c2)
                    column = gl.where((column >= 32) & (column < 64), column, col2 + 0 * u_i)
                    w_s.slice(16 + 16 * kk, 16, dim=0).scatter(weight_words(w2, dtype), column, 1)
                else:
                    w_view.slice(16 + 16 * kk, 16, dim=0).slice(0, ROWS, dim=1).store(weight_words(w2, dtype))
            compat.barrier()
            acc = gl.zeros([DH, BLOCK], gl.float32, mma_dv)
            for kk in gl.static_range(3):
                gu = _frames(ga_s, gh_s, BLOCK * b + 16 * kk, 16).load(a_dv)
                band = band_view.slice(16 + 16 * kk, 16, dim=0).slice(32, BLOCK, dim=1).load(b_dv)
                acc = band_product(gu, band, acc)
            _frames(dv_s, dv_s, BLOCK * b, BLOCK).store(acc.to(dtype))
            compat.barrier()  # w_s is read before the next block overwrites it
        fence_async_shared()
        compat.barrier()
        for n in gl.static_range(NBOX):
            compat.tma_store(dv_desc, [bh * DH, t0 + BOX * n], dv_s.index(n))
        _issue_dv_boxes(lg_desc, lgh_desc, g_desc, gh_desc, lg2_s, lg2h_s, ga_s, gh_s, bars.index(1), i + programs,
                        n_chunks, W, lead_r, DH, it + 1 < count)

    tma.store_wait(0)
    for part in gl.static_range(2):
        mbarrier.invalidate(bars.index(part))


def _leads(W: int, left: int) -> tuple[int, int]:
    """(lead, lead_r): left and right = W - 1 - left rounded up to 8 frames, the spans' TMA column offsets."""
    return round_up(left, 8), round_up(W - 1 - left, 8)


def takes(W: int, left: int, Dh: int, T: int, BH: int, dtype: torch.dtype) -> bool:
    """Whether this kernel takes a call: 16-bit or float32 values, 2 to 15 taps with right + lead <= 16 and
    left + lead_r <= 16 (`_leads`), T a multiple of 8, Dh 16 to 64 and int32 row coordinates."""
    right = W - 1 - left
    lead, lead_r = _leads(W, left)
    return (2 <= W <= 15 and right + lead <= 16 and left + lead_r <= 16 and dtype in GL_DTYPES
            and T % 8 == 0 and Dh in (16, 32, 64) and BH * max(Dh, W) < 2**31)


@functools.cache
def layouts(dtype: torch.dtype, Dh: int) -> tuple:
    """The shared-memory layouts of the logits boxes ([1, ROWS, box] and [1, ROWS, HALO] of [BH, W, T]) and of
    the value, grad_out and dv boxes ([Dh, box] and [Dh, HALO]); box = `box_frames(dtype)`."""
    box = box_frames(dtype)
    boxes = ([1, ROWS.value, box], [1, ROWS.value, HALO.value], [Dh, box], [Dh, HALO.value])
    return tuple(gl.NVMMASharedLayout.get_default_for(box, GL_DTYPES[dtype]) for box in boxes)


# The order in which a float32 MMA step's eight k rows (Dh rows of the grad_out and value boxes) are taken: the
# operand lanes q = 0..3 read k rows q and q + 4, which sit at Dh rows 0, 3, 5, 6 and 1, 2, 4, 7 of each eight
# (a linear map over the row index's bits, as a shared layout needs). In the boxes' 128-byte swizzle (64-byte for
# the float32 halo) rows 0..3 fall on the same banks as pairs of frames do; rows 0, 3, 5, 6 fall on distinct ones,
# so each operand load is one wavefront rather than two. The P product sums over k, so its order is free.
K_ORDER = (0, 3, 5, 6, 1, 2, 4, 7)


def _swizzled_offset(row: int, column: int, row_bytes: int, swizzle_bytes: int, itemsize: int) -> int:
    """The element offset of (row, column) in a TMA box laid out with the NVMMA swizzle of `swizzle_bytes`: the
    16-byte unit index of each 128-byte line XORed with the line index, over log2(swizzle_bytes / 16) bits."""
    byte = row * row_bytes + column * itemsize
    unit_bits = (swizzle_bytes // 16).bit_length() - 1
    byte ^= ((byte >> 7) << 4) & (((1 << unit_bits) - 1) << 4)
    return byte // itemsize


def _k_ordered_view(shape: list, layout: gl.NVMMASharedLayout, itemsize: int) -> gl.SharedLinearLayout:
    """`layout`, the layout of a TMA box of `shape` [Dh, frames], seen with the Dh rows in K_ORDER within each
    eight: a shared linear layout, element offset bit i -> the (row, frame) it adds. (It also views a
    [boxes, Dh, frames] buffer of such boxes, whose .index(n) is box n.)"""
    rows, columns = shape
    place = {}
    for r in range(rows):
        row = r & ~7 | K_ORDER[r & 7]
        for c in range(columns):
            place[_swizzled_offset(row, c, columns * itemsize, layout.swizzle_byte_width, itemsize)] = (r, c)
    return gl.SharedLinearLayout([list(place[1 << i]) for i in range((rows * columns).bit_length() - 1)])


@functools.cache
def p_operand_views(dtype: torch.dtype, Dh: int) -> tuple:
    """The layouts through which the P product reads the grad_out and value boxes ([Dh, box]) and the value halo
    ([Dh, HALO]): Dh rows in K_ORDER for float32, whose operands are read an element at a time; the
    boxes' own layouts for 16-bit values (ldmatrix reads those without conflicts)."""
    box = box_frames(dtype)
    _, _, box_layout, halo_layout = layouts(dtype, Dh)
    if dtype != torch.float32:
        return box_layout, halo_layout
    return (_k_ordered_view([Dh, box], box_layout, dtype.itemsize),
            _k_ordered_view([Dh, HALO.value], halo_layout, dtype.itemsize))


def launch(W: int, left: int, Dh: int, T: int, BH: int, dtype: torch.dtype, device: int, config: str,
           fast_path: str) -> Launch:  # fmt: skip
    """The backward's launch for a call `takes` takes: a persistent grid of PROGRAMS_PER_SM programs an SM for the
    dtype's size (one a chunk when there are fewer chunks). Its logits descriptors view a_logits as [B*H, W, T], the
    others v, grad_out and dv as [B*H*Dh, T]."""
    frames = box_frames(dtype)
    n_chunks = triton.cdiv(T, CHUNK.value)
    programs = min(BH * n_chunks, sm_count(device) * PROGRAMS_PER_SM[dtype.itemsize])
    logits, values, rows, halo = (BH, W, T), (BH * Dh, T), ROWS.value, HALO.value
    tile, tile_halo, box, box_halo = layouts(dtype, Dh)
    # a_logits 0, values 1, grad_out 2, dlogits 3, dv 4
    arguments = ((0, logits, (1, rows, frames), tile), (0, logits, (1, rows, halo), tile_halo),
                 (1, values, (Dh, frames), box), (1, values, (Dh, halo), box_halo), (2, values, (Dh, frames), box),
                 (2, values, (Dh, halo), box_halo), (4, values, (Dh, frames), box), 3)
    lead, lead_r = _leads(W, left)
    box_view, halo_view = p_operand_views(dtype, Dh)
    return Launch(_band_backward_gluon_kernel, programs, (T, W, left, lead, lead_r, n_chunks, BH * n_chunks),
                  dict(DH=Dh, BOX_VIEW=box_view, HALO_VIEW=halo_view), WARPS.value, config, arguments, fast_path)
