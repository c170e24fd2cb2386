"""The LDSA forward for 16-bit values and windows of up to 15 taps on Hopper, written in Gluon (Triton's
explicit-layout dialect), so that the band never passes through shared memory.

The Triton forward (`ldsa_triton._ldsa_forward_tma_kernel`) multiplies the value span by the band on the tensor
cores with the band as an operand in shared memory: the gathered band is stored there and read back each chunk,
and Nsight Compute found that kernel bound by shared memory (L1/shared 85% at 32 x 3000). Here the band is the B
operand of `mma.sync` held in registers, built where the MMA wants it:

- A chunk is 64 frames of one (b, h). TMA copies its logits [16, 64] and its value span [Dh, 80] (two boxes,
  64 + 16 positions from t0 - lead; zero fill outside the tensor) into shared memory, STAGES chunks deep, on a
  persistent grid; the output tile goes back by TMA.
- The chunk is two blocks of 32 frames. Each of the four warps owns 8 frames of a block and all of Dh. A block
  reads 48 span positions, three k-steps of 16: frame f's window (tap k at span position f + k + lead - left)
  lies in them for windows with 32 + W - 1 + lead - left <= 48.
- A warp loads its frames' logits from shared memory straight into the B-operand layout, in which a frame's 16
  taps lie on the four lanes of a quad (tap = 8 j + 2 q + e: lane q of the quad, registers j and e), and takes
  the window softmax there (float32, `window_weights._window_softmax`). The weights are split into hi + lo
  halves in the values' dtype, packed in one 32-bit word (`window_weights._hi_lo_pairs`), so that the product is
  float32-accurate.
- Band element (row r, frame f) is the weight of tap r - f - (lead - left): a register of another lane of the
  same quad. One shuffle moves it, the sending lane choosing which of its four words the receiving lane needs
  (`_band_slot`). Triton's gather of the same band shuffled all four and selected (four shuffles an element).

At [64, 3000], W = 15, bf16, CUDA-graph timing: 0.133-0.134 ms (78.3-78.7% of the run's copy bandwidth) against
0.160 ms for the Triton forward timed the same way, and 0.068 against 0.079 at [32, 3000]
(bench/results/2026-11-30-7418d00-dirty-ldsa-gluon4-probe.log, rows "4{'programs_per_sm': 4, 'stages': 2,
'o_bufs': 1}"). The steps there: Triton's gather and four warps along Dh 0.246 ms; two warps along Dh and two
along frames 0.163-0.168 (each band built by two warps; -gluon-probe.log); one shuffle an element 0.153-0.155
(-gluon2-probe.log); then blocks of 32 frames with the four warps along frames (no band built twice) 0.134.
"""

import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from .window_weights import _hi_lo_pairs, _window_softmax

# Tile sizes, constexprs for the kernel (the host reads their .value).
CHUNK = gl.constexpr(64)  # frames a chunk (a TMA box of logits, of values and of output)
BLOCK = gl.constexpr(32)  # frames a block: a band product
HALO = gl.constexpr(16)  # span positions past the chunk, the second value box
TAPS = gl.constexpr(16)  # logits rows a chunk: windows of up to TAPS - 1 taps; the padded taps weigh 0
WARPS = gl.constexpr(4)  # along the frames of a block
# Programs an SM and pipeline stages (one output tile). Measured at [64, 3000], W = 15, bf16 (-gluon4-probe.log):
# 4 programs and 2 stages 0.133 ms; 5 and 2, 0.159; 6 and 2, 0.164; and with two output tiles 3 and 4, 0.142;
# 4 and 3, 0.162; 5 and 2, 0.159. As the benchmark times (cold L2), at [32, 3000] and [64, 3000]: 4 and 2, 0.068
# and 0.141 ms; 3 and 2, 0.071 and 0.134; 3 and 3, 0.070 and 0.137; 2 and 3, 0.078 and 0.149; 5 and 2, 0.083 and
# 0.177 (bench/results/2026-11-30-b5983a3-ldsa-tune-probe.log).
PROGRAMS_PER_SM = 4
STAGES = 2


@gluon.jit
def _issue(a_desc, v_desc, halo_desc, a_s, v_s, halo_s, bar, i, n_chunks, W, lead, DH: gl.constexpr, pred):
    """Start the copies of chunk i's logits and value span into one pipeline stage (where pred)."""
    bh = i // n_chunks
    t0 = (i % n_chunks) * CHUNK
    nbytes: gl.constexpr = a_desc.block_type.nbytes + v_desc.block_type.nbytes + halo_desc.block_type.nbytes
    mbarrier.expect(bar, nbytes, pred=pred)
    tma.async_copy_global_to_shared(a_desc, [bh * W, t0], bar, a_s, pred)
    tma.async_copy_global_to_shared(v_desc, [bh * DH, t0 - lead], bar, v_s, pred)
    tma.async_copy_global_to_shared(halo_desc, [bh * DH, t0 - lead + CHUNK], bar, halo_s, pred)


@gluon.jit
def _split_slots(x):
    """A [16, N] tensor in the B-operand layout (row = 8 j + 2 q + e: lane q of a quad, registers j and e) as its
    four register slots, [4 (q), N] tensors (j, e) = (0, 0), (0, 1), (1, 0), (1, 1). Layout changes only."""
    N: gl.constexpr = x.shape[1]
    y = gl.permute(gl.reshape(x, [2, 4, 2, N]), (1, 3, 0, 2))  # (q, frame, j, e)
    e0, e1 = gl.split(y)
    s00, s10 = gl.split(e0)
    s01, s11 = gl.split(e1)
    return s00, s01, s10, s11


@gluon.jit
def _join_slots(o00, o01, o10, o11, layout: gl.constexpr):
    """The inverse of _split_slots, in `layout` (asserted to move no data)."""
    N: gl.constexpr = o00.shape[1]
    y = gl.join(gl.join(o00, o10), gl.join(o01, o11))  # (q, frame, j, e)
    y = gl.reshape(gl.permute(y, (2, 0, 3, 1)), [16, N])
    return gl.convert_layout(y, layout, assert_trivial=True)


@gluon.jit
def _shuffle(x, lane):
    """x of lane `lane` of the warp (int32, element by element)."""
    return gl.inline_asm_elementwise("shfl.sync.idx.b32 $0, $1, $2, 0x1f, -1;", "=r,r,r", [x, lane], dtype=gl.int32,
                                     is_pure=True, pack=1)


@gluon.jit
def _band_slot(w00, w01, w10, w11, q, f, d, J: gl.constexpr, e: gl.constexpr, W):
    """Register slot (J, e) of the band, rows r = 2 q + e + 8 J of the frames f: the weight of tap r - d
    (d = f + lead - left) in the quad's lanes, the weights w00 .. w11 being `_split_slots` of the packed weights.

    Tap t lies in lane (t % 8) // 2 of the quad, slot (t // 8, t % 2). For one slot, the quad's lanes read a
    rotation of its lanes (by a = ((e - d) % 8) // 2), so each lane is read by exactly one, and it sends the word
    that reader needs: the reader's tap parity is (e - d) % 2 and its j is its tap // 8, which the sender computes
    for the reader q - a. Taps outside [0, W) read as 0."""
    a = ((e - d) & 7) >> 1
    e_sent = (e - d) & 1
    j_sent = (2 * ((q - a) & 3) + e + 8 * J - d) >> 3
    sent = gl.where(j_sent == 0, gl.where(e_sent == 0, w00, w01), gl.where(e_sent == 0, w10, w11))
    got = _shuffle(sent, (f & 7) * 4 + ((q + a) & 3))
    tap = 2 * q + e + 8 * J - d
    return gl.where((tap >= 0) & (tap < W), got, 0)


@gluon.jit
def _ldsa_forward_gluon_kernel(a_desc, v_desc, halo_desc, out_desc, W, left, lead, n_chunks, all_chunks,
                               DH: gl.constexpr, STAGES: gl.constexpr):  # fmt: skip
    """The forward on a persistent grid: chunks i = pid, pid + programs, ... of all (b, h, chunk). The descriptors
    view a_logits as [B*H*W, T] (TAPS rows a box) and v, out as [B*H*DH, T]."""
    KSTEPS: gl.constexpr = BLOCK // 16 + 1
    dtype: gl.constexpr = v_desc.dtype
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, WARPS], instr_shape=[16, 8])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    b_layout: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    blocked: gl.constexpr = gl.BlockedLayout([1, 1], [4, 8], [WARPS, 1], [1, 0])

    a_s = gl.allocate_shared_memory(a_desc.dtype, [STAGES, TAPS, CHUNK], a_desc.layout)
    v_s = gl.allocate_shared_memory(dtype, [STAGES, DH, CHUNK], v_desc.layout)
    halo_s = gl.allocate_shared_memory(dtype, [STAGES, DH, HALO], halo_desc.layout)
    out_s = gl.allocate_shared_memory(dtype, [DH, CHUNK], out_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for st in gl.static_range(STAGES):
        mbarrier.init(bars.index(st), count=1)

    pid = gl.program_id(0)
    programs = gl.num_programs(0)
    count = (all_chunks - pid + programs - 1) // programs
    for st in gl.static_range(STAGES - 1):
        _issue(a_desc, v_desc, halo_desc, a_s.index(st), v_s.index(st), halo_s.index(st), bars.index(st),
               pid + st * programs, n_chunks, W, lead, DH, st < count)

    # Each element's tap and frame in the B-operand layout, and what the band slots need of a thread's place:
    # its lane q in the quad, its frame f, and d. Computed once.
    taps = gl.expand_dims(gl.arange(0, TAPS, layout=gl.SliceLayout(1, blocked)), 1)
    frames = gl.expand_dims(gl.arange(0, BLOCK, layout=gl.SliceLayout(0, blocked)), 0)
    tap_i = gl.convert_layout(taps + 0 * frames, b_layout)
    frame_i = gl.convert_layout(0 * taps + frames, b_layout)
    tap_ok = tap_i < W
    q, _, _, _ = _split_slots(tap_i)
    q = (q >> 1) & 3
    f, _, _, _ = _split_slots(frame_i)
    d = f + (lead - left)

    for it in range(count):
        s = it % STAGES
        gl.thread_barrier()  # every warp is done reading the stage refilled next (chunk it - 1's)
        nxt = it + STAGES - 1
        _issue(a_desc, v_desc, halo_desc, a_s.index(nxt % STAGES), v_s.index(nxt % STAGES),
               halo_s.index(nxt % STAGES), bars.index(nxt % STAGES), pid + nxt * programs, n_chunks, W, lead, DH,
               nxt < count)
        mbarrier.wait(bars.index(s), (it // STAGES) & 1)
        i = pid + it * programs
        tma.store_wait(0)  # the previous chunk's output store has read out_s
        gl.thread_barrier()
        for b in gl.static_range(CHUNK // BLOCK):
            logits = a_s.index(s).slice(BLOCK * b, BLOCK, dim=1).load(b_layout)
            packed = _hi_lo_pairs(_window_softmax(logits, tap_ok, 0), dtype)
            w00, w01, w10, w11 = _split_slots(packed)
            acc = gl.zeros([DH, BLOCK], gl.float32, mma)
            for k in gl.static_range(KSTEPS):
                if BLOCK * b + 16 * k < CHUNK:
                    vals = v_s.index(s).slice(BLOCK * b + 16 * k, 16, dim=1).load(a_layout)
                else:
                    vals = halo_s.index(s).load(a_layout)
                band = _join_slots(_band_slot(w00, w01, w10, w11, q, f, d, 2 * k, 0, W),
                                   _band_slot(w00, w01, w10, w11, q, f, d, 2 * k, 1, W),
                                   _band_slot(w00, w01, w10, w11, q, f, d, 2 * k + 1, 0, W),
                                   _band_slot(w00, w01, w10, w11, q, f, d, 2 * k + 1, 1, W), b_layout)
                acc = mma_v2(vals, band.to(gl.int16).to(dtype, bitcast=True), acc)
                acc = mma_v2(vals, (band >> 16).to(gl.int16).to(dtype, bitcast=True), acc)
            out_s.slice(BLOCK * b, BLOCK, dim=1).store(acc.to(dtype))
        fence_async_shared()
        gl.thread_barrier()
        tma.async_copy_shared_to_global(out_desc, [(i // n_chunks) * DH, (i % n_chunks) * CHUNK], out_s)

    tma.store_wait(0)
    for st in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(st))


def takes(W: int, shift: int, Dh: int, T: int, BH: int, dtype: torch.dtype) -> bool:
    """Whether this kernel takes a call whose value spans start `shift` = lead - left positions before the window:
    16-bit values, windows of 2 to TAPS - 1 taps whose reach W - 1 + shift fits a block's three k-steps (16 past
    the block), T a multiple of 8 (TMA row strides), Dh 16 to 64 (a power of two; 64 is the measured one, and 128
    would leave shared memory for fewer programs than PROGRAMS_PER_SM) and int32 row coordinates."""
    return (2 <= W < TAPS.value and W - 1 + shift <= 16 and dtype in (torch.bfloat16, torch.float16) and T % 8 == 0
            and Dh in (16, 32, 64) and BH * max(Dh, TAPS.value) < 2**31)


@functools.cache
def layouts(dtype: torch.dtype, Dh: int) -> tuple:
    """The shared-memory layouts of the logits, value, halo and output boxes."""
    gdtype = gl.bfloat16 if dtype == torch.bfloat16 else gl.float16
    boxes = ([TAPS.value, CHUNK.value], [Dh, CHUNK.value], [Dh, HALO.value], [Dh, CHUNK.value])
    return tuple(gl.NVMMASharedLayout.get_default_for(box, gdtype) for box in boxes)


def descriptor(x: torch.Tensor, shape: tuple, block: tuple, layout) -> TensorDescriptor:
    """A descriptor of the contiguous tensor x viewed as 2-D `shape`, copied in `block` boxes laid out as `layout`."""
    return TensorDescriptor(x, list(shape), [shape[1], 1], list(block), layout)
