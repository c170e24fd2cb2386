"""The LDSA forward for windows of up to 15 taps on Hopper, written in Gluon (Triton's explicit-layout dialect),
so that the band never passes through shared memory. 16-bit and float32 values.

The Triton TMA forward (`band_tma`) stores its gathered band in shared memory as an MMA operand and reads it
back each chunk, which leaves it bound by shared memory. Here the band is the B operand of `mma.sync`, held in
registers and built where the MMA wants it:

- A chunk is 64 frames of one (b, h). TMA copies its logits [16, 64] and its value span [Dh, 80] (64 + 16
  positions from t0 - lead; zero fill outside the tensor) into shared memory, STAGES chunks deep, on a persistent
  grid; the output tile goes back by TMA. The boxes are 128 bytes a row (`box_frames`): one box a chunk for
  16-bit values, two for float32, and the 16-position halo box.
- The chunk is two blocks of 32 frames. Each of the four warps owns 8 frames of a block and all of Dh, so no
  band is built by two warps. A block reads 48 span positions, three k-steps of 16: frame f's window (tap k at
  span position f + k + lead - left) lies in them for windows with 32 + W - 1 + lead - left <= 48.
- A warp loads its frames' logits from shared memory straight into the B-operand layout, in which a frame's 16
  taps lie on the four lanes of a quad, four taps a lane (`_split_slots`), and takes the window softmax there
  (`portable.window_weights.window_softmax`). For 16-bit values the weights are split into hi + lo halves in the
  values' dtype, packed in one 32-bit word (`band_mma.weight_words`); float32 weights stay whole.
- Band element (row r, frame f) is the weight of tap r - f - (lead - left): a register of another lane of the
  same quad. One shuffle moves it, the sending lane choosing which of its four words the receiving lane needs
  (`_band_slot`), where a gather would shuffle all four and select.
- The products keep float32's accuracy (`band_mma.band_product`): two MMAs (hi, lo) for 16-bit values, three TF32 MMAs
  of split operands for float32.
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
from .band_mma import BLOCK, CHUNK, GL_DTYPES, HALO, WARPS, band_product, box_frames, weight_words

TAPS = gl.constexpr(16)  # logits rows a chunk: windows of up to TAPS - 1 taps; the padded taps weigh 0
# Programs an SM by the values' bytes an element, and pipeline stages (one output tile): the best measured on the
# H200. A float32 program takes 64 KB of shared memory at Dh = 64, so at most 3 fit an SM.
PROGRAMS_PER_SM = {2: 4, 4: 3}
STAGES = 2


@gluon.jit
def _issue(a_desc, v_desc, halo_desc, a_s, v_s, halo_s, st, bar, i, n_chunks, W, lead, DH: gl.constexpr, pred):
    """Start the copies of chunk i's logits and value span into pipeline stage st (where pred): the chunk's
    logits and value boxes, CHUNK // BOX of each, and the halo box."""
    BOX: gl.constexpr = v_desc.block_type.shape[1]
    NBOX: gl.constexpr = CHUNK // BOX
    bh = i // n_chunks
    t0 = (i % n_chunks) * CHUNK
    nbytes: gl.constexpr = NBOX * (a_desc.block_type.nbytes + v_desc.block_type.nbytes) + halo_desc.block_type.nbytes
    mbarrier.expect(bar, nbytes, pred=pred)
    for n in gl.static_range(NBOX):
        compat.tma_load(a_desc, [bh * W, t0 + BOX * n], bar, a_s.index(NBOX * st + n), pred)
        compat.tma_load(v_desc, [bh * DH, t0 - lead + BOX * n], bar, v_s.index(NBOX * st + n), pred)
    compat.tma_load(halo_desc, [bh * DH, t0 - lead + CHUNK], bar, halo_s.index(st), pred)


@gluon.jit
def _split_slots(x, KW: gl.constexpr):
    """A [16, N] tensor in the B-operand layout of k_width KW as its four register slots, [4 (q), N] tensors,
    slot 2 h + l. 16-bit operands (KW = 2): row = 8 j + 2 q + e (lane q of a quad, registers j and e), slot
    (h, l) = (j, e); 32-bit ones (KW = 1): row = 4 j + q, slot j = 2 h + l. Layout changes only."""
    N: gl.constexpr = x.shape[1]
    if KW == 2:
        y = gl.permute(gl.reshape(x, [2, 4, 2, N]), (1, 3, 0, 2))  # (q, frame, h, l)
    else:
        y = gl.permute(gl.reshape(x, [2, 2, 4, N]), (2, 3, 0, 1))
    l0, l1 = gl.split(y)
    s0, s2 = gl.split(l0)
    s1, s3 = gl.split(l1)
    return s0, s1, s2, s3


@gluon.jit
def _join_slots(o0, o1, o2, o3, KW: gl.constexpr, layout: gl.constexpr):
    """The inverse of _split_slots, in `layout` (asserted to move no data)."""
    N: gl.constexpr = o0.shape[1]
    y = gl.join(gl.join(o0, o2), gl.join(o1, o3))  # (q, frame, h, l)
    if KW == 2:
        y = gl.permute(y, (2, 0, 3, 1))
    else:
        y = gl.permute(y, (2, 3, 0, 1))
    return gl.convert_layout(gl.reshape(y, [16, N]), layout, assert_trivial=True)


@gluon.jit
def _shuffle(x, lane):
    """x of lane `lane` of the warp (int32, element by element)."""
    return gl.inline_asm_elementwise("shfl.sync.idx.b32 $0, $1, $2, 0x1f, -1;", "=r,r,r", [x, lane], dtype=gl.int32,
                                     is_pure=True, pack=1)


@gluon.jit
def _band_slot(w0, w1, w2, w3, q, f, d, K: gl.constexpr, S: gl.constexpr, KW: gl.constexpr, W):
    """Register slot S of k-step K of the band (k_width KW), the rows r = ROW + KW q of the frames f: the weight of
    tap r - d (d = f + lead - left) in the quad's lanes, the words w0 .. w3 being `_split_slots` of the weights.

    Tap t lies in lane (t // KW) % 4 of the quad, in the slot of `_split_slots`. For one slot, the quad's lanes
    read a rotation of its lanes (by a), so each lane is read by exactly one, and it sends the word that reader
    needs, the slot of the reader's tap, which the sender computes for the reader q - a. Taps outside [0, W) read
    as 0."""
    ROW: gl.constexpr = 16 * K + 4 * KW * (S // KW) + S % KW
    a = ((S % KW - d) & (4 * KW - 1)) >> (KW // 2)  # ROW - d's lane (quarter of 4 KW) past q's
    tap_sent = ROW + KW * ((q - a) & 3) - d
    h = tap_sent >> 3
    if KW == 2:
        l = (S % KW - d) & 1  # tap_sent's parity
    else:
        l = (tap_sent >> 2) & 1
    sent = gl.where(h == 0, gl.where(l == 0, w0, w1), gl.where(l == 0, w2, w3))
    got = _shuffle(sent, (f & 7) * 4 + ((q + a) & 3))
    tap = ROW + KW * q - d
    return gl.where((tap >= 0) & (tap < W), got, 0)


@gluon.jit
def _band_forward_gluon_kernel(a_desc, v_desc, halo_desc, out_desc, W, left, lead, n_chunks, all_chunks,
                               DH: gl.constexpr, STAGES: gl.constexpr):  # fmt: skip
    """The forward on a persistent grid: chunks i = pid, pid + programs, ... of all (b, h, chunk). The descriptors
    view a_logits as [B*H*W, T] (TAPS rows a box) and v, out as [B*H*DH, T]."""
    KSTEPS: gl.constexpr = BLOCK // 16 + 1
    dtype: gl.constexpr = v_desc.dtype
    KW: gl.constexpr = 32 // dtype.primitive_bitwidth  # the MMA operands' k_width: elements in 32 bits
    BOX: gl.constexpr = v_desc.block_type.shape[1]
    NBOX: gl.constexpr = CHUNK // BOX
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, WARPS], instr_shape=[16, 8])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=KW)
    b_layout: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=KW)
    blocked: gl.constexpr = gl.BlockedLayout([1, 1], [4, 8], [WARPS, 1], [1, 0])

    a_s = gl.allocate_shared_memory(a_desc.dtype, [STAGES * NBOX, TAPS, BOX], a_desc.layout)
    v_s = gl.allocate_shared_memory(dtype, [STAGES * NBOX, DH, BOX], v_desc.layout)
    halo_s = gl.allocate_shared_memory(dtype, [STAGES, DH, HALO], halo_desc.layout)
    out_s = gl.allocate_shared_memory(dtype, [NBOX, DH, BOX], out_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for st in gl.static_range(STAGES):
        mbarrier.init(bars.index(st), count=1)

    pid = gl.program_id(0)
    programs = gl.num_programs(0)
    count = (all_chunks - pid + programs - 1) // programs
    for st in gl.static_range(STAGES - 1):
        _issue(a_desc, v_desc, halo_desc, a_s, v_s, halo_s, st, bars.index(st), pid + st * programs, n_chunks, W,
               lead, DH, st < count)

    # Each element's tap and frame in the B-operand layout, and what the band slots need of a thread's place:
    # its lane q in the quad, its frame f, and d. Computed once.
    taps = gl.expand_dims(gl.arange(0, TAPS, layout=gl.SliceLayout(1, blocked)), 1)
    frames = gl.expand_dims(gl.arange(0, BLOCK, layout=gl.SliceLayout(0, blocked)), 0)
    tap_i = gl.convert_layout(taps + 0 * frames, b_layout)
    frame_i = gl.convert_layout(0 * taps + frames, b_layout)
    tap_ok = tap_i < W
    q, _, _, _ = _split_slots(tap_i, KW)
    q = (q // KW) & 3
    f, _, _, _ = _split_slots(frame_i, KW)
    d = f + (lead - left)

    for it in range(count):
        s = it % STAGES
        compat.barrier()  # every warp is done reading the stage refilled next (chunk it - 1's)
        nxt = it + STAGES - 1
        _issue(a_desc, v_desc, halo_desc, a_s, v_s, halo_s, nxt % STAGES, bars.index(nxt % STAGES),
               pid + nxt * programs, n_chunks, W, lead, DH, nxt < count)
        mbarrier.wait(bars.index(s), (it // STAGES) & 1)
        i = pid + it * programs
        tma.store_wait(0)  # the previous chunk's output store has read out_s
        compat.barrier()
        for b in gl.static_range(CHUNK // BLOCK):
            logits = a_s.index(NBOX * s + BLOCK * b // BOX).slice(BLOCK * b % BOX, BLOCK, dim=1).load(b_layout)
            w0, w1, w2, w3 = _split_slots(weight_words(window_softmax(logits, tap_ok, 0), dtype), KW)
            acc = gl.zeros([DH, BLOCK], gl.float32, mma)
            for k in gl.static_range(KSTEPS):
                if BLOCK * b + 16 * k < CHUNK:  # the k-step's span positions, in a value box or in the halo
                    vals = v_s.index(NBOX * s + (BLOCK * b + 16 * k) // BOX).slice((BLOCK * b + 16 * k) % BOX, 16,
                                                                                   dim=1).load(a_layout)
                else:
                    vals = halo_s.index(s).load(a_layout)
                band = _join_slots(_band_slot(w0, w1, w2, w3, q, f, d, k, 0, KW, W),
                                   _band_slot(w0, w1, w2, w3, q, f, d, k, 1, KW, W),
                                   _band_slot(w0, w1, w2, w3, q, f, d, k, 2, KW, W),
                                   _band_slot(w0, w1, w2, w3, q, f, d, k, 3, KW, W), KW, b_layout)
                acc = band_product(vals, band, acc)
            out_s.index(BLOCK * b // BOX).slice(BLOCK * b % BOX, BLOCK, dim=1).store(acc.to(dtype))
        fence_async_shared()
        compat.barrier()
        for n in gl.static_range(NBOX):
            compat.tma_store(out_desc, [(i // n_chunks) * DH, (i % n_chunks) * CHUNK + BOX * n],
                                            out_s.index(n))

    tma.store_wait(0)
    for st in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(st))


def _lead(left: int) -> int:
    """How far a chunk's value span starts before its first frame: left rounded up to 8 frames, TMA's 16-byte
    column offsets (as band-tma's spans)."""
    return round_up(left, 8)


def takes(W: int, left: int, Dh: int, T: int, BH: int, dtype: torch.dtype) -> bool:
    """Whether this kernel takes a call, its value spans starting shift = `_lead(left)` - left positions before the
    window: 16-bit or float32 values, windows of 2 to TAPS - 1 taps whose reach W - 1 + shift fits a block's three
    k-steps (16 past the block), T a multiple of 8 (TMA row strides), Dh 16 to 64 (a power of two; 128 would
    leave shared memory for fewer programs than PROGRAMS_PER_SM) and int32 row coordinates."""
    shift = _lead(left) - left
    return (2 <= W < TAPS.value and W - 1 + shift <= 16 and dtype in GL_DTYPES and T % 8 == 0
            and Dh in (16, 32, 64) and BH * max(Dh, TAPS.value) < 2**31)


@functools.cache
def layouts(dtype: torch.dtype, Dh: int) -> tuple:
    """The shared-memory layouts of the logits, value, halo and output boxes."""
    box = box_frames(dtype)
    boxes = ([TAPS.value, box], [Dh, box], [Dh, HALO.value], [Dh, box])
    return tuple(gl.NVMMASharedLayout.get_default_for(shape, GL_DTYPES[dtype]) for shape in boxes)


def launch(W: int, left: int, Dh: int, T: int, BH: int, dtype: torch.dtype, device: int, config: str,
           fast_path: str) -> Launch:  # fmt: skip
    """The forward's launch for a call `takes` takes, its value spans `_lead(left)` positions before their chunks: a
    persistent grid of PROGRAMS_PER_SM programs an SM for the dtype's size (one a chunk when there are fewer
    chunks), descriptors of a_logits as [B*H*W, T] (TAPS rows a box) and of v and out as [B*H*Dh, T]."""
    box = box_frames(dtype)
    n_chunks = triton.cdiv(T, CHUNK.value)
    programs = min(BH * n_chunks, sm_count(device) * PROGRAMS_PER_SM[dtype.itemsize])
    rows, values = (BH * W, T), (BH * Dh, T)
    a_layout, v_layout, halo_layout, out_layout = layouts(dtype, Dh)
    arguments = ((0, rows, (TAPS.value, box), a_layout), (1, values, (Dh, box), v_layout),
                 (1, values, (Dh, HALO.value), halo_layout), (2, values, (Dh, box), out_layout))
    return Launch(_band_forward_gluon_kernel, programs, (W, left, _lead(left), n_chunks, BH * n_chunks),
                  dict(DH=Dh, STAGES=STAGES), WARPS.value, config, arguments, fast_path)
