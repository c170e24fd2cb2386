"""Whisper's log-mel from the waveform in Gluon with mma.sync: the fast path of `whisper_log_mel` on Hopper.

The DFT factors as in `portable/waveform.py` (400 = 25 x 16, n = 16 n1 + n2, k = k1 + 25 k2), but each warp runs
one frame at a time through both stages as [16 x 16] mma.sync products whose constant operands (the DFT tables
and twiddles) stay in registers for the whole tile, and whose intermediate never leaves them:

1. stage 1, Y[k1, n2] = C[k1, n1] S[n1, n2]: the 25-point real DFT along n1, the table C as the left operand and
   the folded samples (s[n1] +- s[25 - n1], n1 <= 12) loaded straight into the right operand's registers, a frame
   ahead; a program whose frames lie inside the clip loads them without the reflection and length tests;
2. the twiddles W400^(n2 k1), elementwise on the accumulator;
3. stage 2, Z[k1, k2] = G[k1, n2] D[n2, k2]: the 16-point complex DFT along n2. The accumulator of stage 1 is
   the left operand of stage 2 in the same registers (mma.sync's accumulator and left-operand layouts agree),
   so the transpose between the stages costs nothing;
4. the power |Z|^2 goes to shared memory as [(k2, warp), frame, k1], k1 innermost so that a warp's store of one
   frame spreads over eight banks; a run of 16 values at fixed k2 holds 13 consecutive DFT bins (k1 = 0..12 of
   X[k1 + 25 k2], or of its mirror 400 - k), so a block of 16 mel bands, whose triangles span a few dozen bins,
   needs only the k2 chunks its mask in the `chunk_plan` marks (20 of 80 at 80 mels, 23 of 128 at 128);
5. after `Config.frames` frames a warp, the projection mel^T = W^T P^T: [16 bands x 16 bins] x [16 bins x frames]
   products over the block's chunks, then log10, (x + 4) / 4 and the store, and the tile's max and min of the
   log for the floor (`portable/floor.py`, shared with the Triton path: a pass of its own, or folded into this
   kernel's launch).

Precision: the DFT products take fp16 operands split into head and tail (three products, fp32-accurate while
the operand lies in fp16's normal range): each frame's folded samples are scaled by a power of two into
[2^14, 2^15) and the stage-2 inputs by 2^-5, and the frame's exponent goes back inside the log. The projection
splits the power and the filterbank into bfloat16 head and tail (three products, about 2^-16 relative),
whose range needs no scaling.
"""

import functools
from typing import NamedTuple

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from .. import whisper
from ..common.gluon_compat import barrier
from ..common.launch import Launch, launch as run
from ..portable import floor
from ..portable.floor import count_tile, floor_group, take_item
from ..portable.log10 import log10_scaled
from ..portable.waveform import dft_tables, kept_main_pass, pow2_scale, stage2_bins

N_FFT = gl.constexpr(whisper.N_FFT)
HOP = gl.constexpr(whisper.HOP_LENGTH)
PCM_SCALE = gl.constexpr(whisper.PCM_SCALE)
BANDS = gl.constexpr(16)  # mel bands a projection block (the projection's M)


class Config(NamedTuple):
    """frames: the frames a warp transforms before projecting them (the projection's N, 8 or 16); their power
    takes 1 KB of shared memory a frame and warp, 32 KB at 8 frames and 4 warps. maxnreg: a register cap, for more
    resident warps (128 registers a thread and 33 KB let four 4-warp programs share an SM at 8 frames; 168 and 64 KB
    three at 16)."""

    frames: int = 8
    num_warps: int = 4
    maxnreg: int | None = 128

    @property
    def name(self) -> str:
        return f"j{self.frames} w{self.num_warps}" + (f" r{self.maxnreg}" if self.maxnreg else "")


DEFAULT_CONFIG = Config()


@gluon.jit
def _grid(D0: gl.constexpr, D1: gl.constexpr, D2: gl.constexpr, layout: gl.constexpr):
    """Index tensors [D0, 1, 1], [1, D1, 1], [1, 1, D2] in `layout`."""
    i0 = gl.arange(0, D0, layout=gl.SliceLayout(1, gl.SliceLayout(2, layout)))
    i1 = gl.arange(0, D1, layout=gl.SliceLayout(0, gl.SliceLayout(2, layout)))
    i2 = gl.arange(0, D2, layout=gl.SliceLayout(0, gl.SliceLayout(1, layout)))
    return (gl.expand_dims(gl.expand_dims(i0, 1), 2), gl.expand_dims(gl.expand_dims(i1, 0), 2),
            gl.expand_dims(gl.expand_dims(i2, 0), 1))


@gluon.jit
def _split(x, dtype: gl.constexpr):
    """(head, tail) of fp32 x in `dtype`: head + tail = x to about 2^-22 (fp16, in its normal range) or 2^-16
    (bf16)."""
    hi = x.to(dtype)
    return hi, (x - hi.to(gl.float32)).to(dtype)


@gluon.jit
def _mma3(a_hi, a_lo, b_hi, b_lo, acc):
    """acc + a @ b from the split operands, the tails' product left out."""
    acc = mma_v2(a_lo, b_hi, acc)
    acc = mma_v2(a_hi, b_lo, acc)
    return mma_v2(a_hi, b_hi, acc)


@gluon.jit
def _fragment_offsets(row, k):
    """`fragment_order`'s offsets of the elements [row, k] (index tensors, in the kernel or on the host)."""
    return (row // 8 + 2 * (k // 8)) * 64 + (row % 8) * 8 + k % 8


@gluon.jit
def _load_samples(audio_ptr, clip_base, length, N, frame, n, ok, IS_PCM: gl.constexpr, INTERIOR: gl.constexpr):
    """Sample n of `frame` in fp32 (int16 PCM scaled to [-1, 1)): reflected at the clip's ends and zero at or past
    `length` (INTERIOR: the program's frames lie inside both, and only `ok` masks), zero where `ok` is false."""
    j = frame * HOP - N_FFT // 2 + n
    if INTERIOR:
        x = gl.load(audio_ptr + clip_base + j, mask=ok, other=0)
    else:
        j = gl.where(j < 0, -j, j)
        j = gl.where(j >= N, 2 * N - 2 - j, j)
        x = gl.load(audio_ptr + clip_base + j, mask=ok & (j < length), other=0)
    x = x.to(gl.float32)
    if IS_PCM:
        x = x * PCM_SCALE
    return x


@gluon.jit
def _frame_samples(audio_ptr, clip_base, length, N, F, frame, n_lo, n_hi, used_lo, used_hi, IS_PCM: gl.constexpr,
                   INTERIOR: gl.constexpr):
    """(s[n_lo], s[n_hi]) of `frame` clamped to F - 1 (`_load_samples`): stage 1's samples and their mirrors."""
    frame = gl.minimum(frame, F - 1)
    return (_load_samples(audio_ptr, clip_base, length, N, frame, n_lo, used_lo, IS_PCM, INTERIOR),
            _load_samples(audio_ptr, clip_base, length, N, frame, n_hi, used_hi, IS_PCM, INTERIOR))


@gluon.jit
def _spectra(audio_ptr, window_ptr, operands_ptr, twiddles_ptr, power_s, exps_s, clip_base, length, N, F, first,
             J: gl.constexpr, IS_PCM: gl.constexpr, INTERIOR: gl.constexpr):
    """The power spectra of frames first + w * J + j (clamped to F - 1), warp w, j < J, into power_s
    [(k2, warp), frame j, k1] times 2^exps_s[warp, j]."""
    W: gl.constexpr = gl.num_warps()
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[W, 1, 1], instr_shape=[1, 16, 8])
    a_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    b_op: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    # The DFT tables, each [16, 16] (fp16 head, then the tails 4 * 256 elements on), and the twiddles. Every warp
    # holds the same ones (index 0 * w: the batch dimension is the warp's frame).
    LO: gl.constexpr = 4 * 256
    wa, ka, na = _grid(W, 16, 16, a_op)
    square_a = 0 * wa + ka * 16 + na  # C[k1, n1]: the stage-1 tables are symmetric
    cos1_hi = gl.load(operands_ptr + square_a)
    cos1_lo = gl.load(operands_ptr + LO + square_a)
    sin1_hi = gl.load(operands_ptr + 256 + square_a)
    sin1_lo = gl.load(operands_ptr + LO + 256 + square_a)
    wb, kb, nb = _grid(W, 16, 16, b_op)
    square_b = 0 * wb + kb * 16 + nb  # D[n2, k2]
    cos2_hi = gl.load(operands_ptr + 512 + square_b)
    cos2_lo = gl.load(operands_ptr + LO + 512 + square_b)
    sin2_hi = gl.load(operands_ptr + 768 + square_b)
    sin2_lo = gl.load(operands_ptr + LO + 768 + square_b)
    wc, k1c, n2c = _grid(W, 16, 16, mma)
    twiddle = twiddles_ptr + 0 * wc + n2c * 16 + k1c  # stored [n2, k1]; times 2^-5, the stage-2 inputs' scale
    t_re = gl.load(twiddle) * (1.0 / 32)
    t_im = gl.load(twiddle + 256) * (1.0 / 32)
    # Stage 1's right operand S[n1, n2]: s[n1] at 16 n1 + n2, s[25 - n1] at 400 - 16 n1 + n2, n1 <= 12.
    n_lo = 16 * kb + nb
    n_hi = N_FFT - 16 * kb + nb
    used_lo = kb < 13
    used_hi = (kb >= 1) & used_lo
    window_lo = gl.load(window_ptr + n_lo)
    window_hi = gl.load(window_ptr + n_hi)
    # Frame j + 1's samples load while frame j is transformed: the only loads ahead of the frame's barrier below.
    frame = first + wb * J
    x_lo, x_hi = _frame_samples(audio_ptr, clip_base, length, N, F, frame, n_lo, n_hi, used_lo, used_hi, IS_PCM,
                                INTERIOR)
    for j in gl.static_range(J):
        s_lo = x_lo * window_lo
        s_hi = x_hi * window_hi
        if j + 1 < J:
            x_lo, x_hi = _frame_samples(audio_ptr, clip_base, length, N, F, frame + j + 1, n_lo, n_hi, used_lo,
                                        used_hi, IS_PCM, INTERIOR)
        cosines = s_lo + s_hi
        sines = s_lo - s_hi
        amax = gl.max(gl.max(gl.maximum(gl.abs(cosines), gl.abs(sines)), axis=2), axis=1)
        scale, s = pow2_scale(amax)
        scale = gl.expand_dims(gl.expand_dims(scale, 1), 2)
        c_hi, c_lo = _split(cosines * scale, gl.float16)
        s_hi16, s_lo16 = _split(sines * scale, gl.float16)
        zero = gl.zeros([W, 16, 16], gl.float32, mma)
        y_re = _mma3(cos1_hi, cos1_lo, c_hi, c_lo, zero)
        y_im = _mma3(sin1_hi, sin1_lo, s_hi16, s_lo16, zero)
        g_re = y_re * t_re - y_im * t_im
        g_im = y_re * t_im + y_im * t_re
        gr_hi, gr_lo = _split(g_re, gl.float16)
        gi_hi, gi_lo = _split(g_im, gl.float16)
        gr_hi = gl.convert_layout(gr_hi, a_op)
        gr_lo = gl.convert_layout(gr_lo, a_op)
        gi_hi = gl.convert_layout(gi_hi, a_op)
        gi_lo = gl.convert_layout(gi_lo, a_op)
        z_re = _mma3(gi_hi, gi_lo, sin2_hi, sin2_lo, _mma3(gr_hi, gr_lo, cos2_hi, cos2_lo, zero))
        z_im = _mma3(-gr_hi, -gr_lo, sin2_hi, sin2_lo, _mma3(gi_hi, gi_lo, cos2_hi, cos2_lo, zero))
        power = z_re * z_re + z_im * z_im  # [warp, k1, k2], times 2^(2 s - 10)
        power_s.slice(j, 1, dim=1).store(gl.reshape(gl.permute(power, (2, 0, 1)), [16 * W, 1, 16]))
        exps_s.slice(j, 1, dim=1).store(gl.expand_dims(2 * s - 10, 1))
        # A CTA barrier after each frame keeps ptxas from hoisting the next frames' loads and products above this
        # frame's: it bounds the registers live at once, so that the frame loop fits the cap without spilling.
        barrier()


@gluon.jit
def _waveform_gluon_tile(audio_ptr, lengths_ptr, operands_ptr, twiddles_ptr, window_ptr, proj_ptr, plan_ptr, out_ptr,
                         stats_ptr, item, N, F, NM, n_tiles, J: gl.constexpr, N_BLOCKS: gl.constexpr,
                         IS_PCM: gl.constexpr, HAS_LENGTHS: gl.constexpr):
    """Main item `item`, tile item % n_tiles (of num_warps * J frames) of clip item // n_tiles, warp w taking its
    frames w * J + j: (log10(max(mel, 1e-10)) + 4) / 4 into out (B, NM, F), and the tile's (max, min) of the log
    into stats."""
    W: gl.constexpr = gl.num_warps()
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[W, 1, 1], instr_shape=[1, 16, 8])
    a_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    b_op: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    flat: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[2, 1, 0])
    flat2: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0])

    clip = item // n_tiles
    first = (item % n_tiles) * (W * J)
    length = N
    if HAS_LENGTHS:
        length = gl.minimum(gl.load(lengths_ptr + clip), N).to(gl.int32)
    clip_base = clip.to(gl.int64) * N

    # Shared-memory views take static offsets: the frame loop and the projection's chunk loop are unrolled.
    power_s = gl.allocate_shared_memory(gl.float32, [16 * W, J, 16], flat)  # [(k2, warp), frame j, k1]
    exps_s = gl.allocate_shared_memory(gl.int32, [W, J], flat2)
    # Samples 160 f - 200 .. 160 f + 199 of the tile's frames f: inside the clip, no reflection or length test.
    last = gl.minimum(first + W * J, F) - 1
    if (first * HOP >= N_FFT // 2) & (last * HOP + N_FFT // 2 <= length):
        _spectra(audio_ptr, window_ptr, operands_ptr, twiddles_ptr, power_s, exps_s, clip_base, length, N, F, first,
                 J, IS_PCM, True)
    else:
        _spectra(audio_ptr, window_ptr, operands_ptr, twiddles_ptr, power_s, exps_s, clip_base, length, N, F, first,
                 J, IS_PCM, False)
    barrier()

    # The projection mel^T[band, frame] = W^T[band, bin] P^T[bin, frame], 16 bands at a time over the chunks (k2)
    # the plan marks for the block.
    wp, bp, jp = _grid(W, BANDS, J, mma)
    ww, bw, kw = _grid(W, BANDS, 16, a_op)
    fragments = 0 * ww + _fragment_offsets(bw, kw)
    frames = first + wp * J + jp
    exps = gl.expand_dims(exps_s.load(gl.SliceLayout(1, mma)), 1)  # [warp, 1, frame j]
    out_clip = out_ptr + clip.to(gl.int64) * NM * F
    PROJ_LO: gl.constexpr = N_BLOCKS * 16 * 256  # the heads: 16 chunks (k2) of 256 weights a block
    run_max = gl.full([W, BANDS, J], float("-inf"), gl.float32, mma)
    run_min = gl.full([W, BANDS, J], float("inf"), gl.float32, mma)
    for block in range(N_BLOCKS):
        needed = gl.load(plan_ptr + block)
        mel = gl.zeros([W, BANDS, J], gl.float32, mma)
        for k2 in gl.static_range(16):
            if (needed >> k2) & 1:
                p_hi, p_lo = _split(power_s.slice(k2 * W, W, dim=0).permute((0, 2, 1)).load(b_op), gl.bfloat16)
                weights = proj_ptr + (block * 16 + k2) * 256 + fragments
                mel = _mma3(gl.load(weights), gl.load(weights + PROJ_LO), p_hi, p_lo, mel)
        log_spec = log10_scaled(mel, exps, True)
        bands = block * BANDS + bp
        gl.store(out_clip + bands * F + frames, ((log_spec + 4.0) * 0.25).to(out_ptr.dtype.element_ty),
                 mask=(bands < NM) & (frames < F))
        # Frames past F repeat frame F - 1; bands past NM (zero weights) must not lower the minimum.
        run_max = gl.maximum(run_max, log_spec)
        run_min = gl.minimum(run_min, gl.where(bands < NM, log_spec, float("inf")))
    stats = stats_ptr + item.to(gl.int64) * 2
    gl.store(stats, gl.max(gl.max(gl.max(run_max, axis=2), axis=1), axis=0))
    gl.store(stats + 1, gl.min(gl.min(gl.min(run_min, axis=2), axis=1), axis=0))


# n_tiles stays a runtime value: specialized to 1 (a clip of one tile) it makes the frame indices constants, on
# which Triton 3.6's lowering to LLVM fails an assertion. B and n_groups too: specialized to 1 (one clip, clips of
# at most two tiles) they change the capped kernel's register allocation, and its spills, with the floor folded in.
@gluon.jit(do_not_specialize=["n_tiles", "B", "n_groups"])
def _waveform_gluon_kernel(audio_ptr, lengths_ptr, operands_ptr, twiddles_ptr, window_ptr, proj_ptr, plan_ptr,
                           out_ptr, stats_ptr, counters_ptr, N, F, NM, n_tiles, B, n_groups, J: gl.constexpr,
                           N_BLOCKS: gl.constexpr, IS_PCM: gl.constexpr, HAS_LENGTHS: gl.constexpr,
                           WITH_FLOOR: gl.constexpr, FLOOR_M: gl.constexpr, STATS_CHUNK: gl.constexpr,
                           FLOOR_TILES: gl.constexpr):
    """One program per (clip, tile), clip-major (`_waveform_gluon_tile`); WITH_FLOOR, one per item of the floor
    folded in (`portable/floor.py`): B * n_tiles main items, then B * n_groups floor items, taken by ticket."""
    if WITH_FLOOR:
        n_main = B * n_tiles
        item = take_item(counters_ptr, n_main + B * n_groups)
        if item < n_main:
            _waveform_gluon_tile(audio_ptr, lengths_ptr, operands_ptr, twiddles_ptr, window_ptr, proj_ptr, plan_ptr,
                                 out_ptr, stats_ptr, item, N, F, NM, n_tiles, J, N_BLOCKS, IS_PCM, HAS_LENGTHS)
            count_tile(counters_ptr, item // n_tiles)
        else:
            # The floor's layouts: a step's [FLOOR_M bands, W * J frames] tile, the tile statistics in a vector.
            W: gl.constexpr = gl.num_warps()
            step: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [W, 1], [1, 0])
            vector: gl.constexpr = gl.BlockedLayout([1], [32], [W], [0])
            floor_group(out_ptr, stats_ptr, counters_ptr, item - n_main, F, NM, n_tiles, n_groups,
                        gl.arange(0, W * J, gl.SliceLayout(0, step)), gl.arange(0, FLOOR_M, gl.SliceLayout(1, step)),
                        gl.arange(0, STATS_CHUNK, vector), FLOOR_TILES)
    else:
        _waveform_gluon_tile(audio_ptr, lengths_ptr, operands_ptr, twiddles_ptr, window_ptr, proj_ptr, plan_ptr,
                             out_ptr, stats_ptr, gl.program_id(0), N, F, NM, n_tiles, J, N_BLOCKS, IS_PCM,
                             HAS_LENGTHS)


def fragment_order() -> torch.Tensor:
    """(16, 16) int64: the offset of element [row, k] of a [16 x 16] 16-bit left operand of mma.sync when stored in
    the order a warp loads its fragments. Lane 4 (row % 8) + (k % 8) // 2 holds the element in its register pair
    row // 8 + 2 (k // 8), at (32 pair + lane) * 2 + k % 2: the warp's load of one pair reads 128 consecutive
    bytes, where [row, k] order spreads it over eight rows."""
    return _fragment_offsets.fn(torch.arange(16)[:, None], torch.arange(16)[None, :])


def chunk_plan(mel_filters: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(plan, projection) for `mel_filters` (NM, 201): plan (blocks,) int32, per block of 16 bands a mask of the
    k2 chunks (bit k2) on whose bins a weight of the block is non-zero (NaN included); projection
    (2, blocks, 16, 256) bfloat16, the head and tail of the weights W^T[band, k1] of each (block, k2) chunk in
    `fragment_order`, zero on the unused stage-2 outputs and on the bands past NM."""
    NM = mel_filters.shape[0]
    n_blocks = triton.cdiv(NM, BANDS.value)
    bins, used = stage2_bins()  # in the order k1 * 16 + k2
    bins = bins.view(16, 16).t().reshape(-1)
    used = used.view(16, 16).t().reshape(-1)
    weights = torch.zeros(256, n_blocks * BANDS.value, dtype=torch.float64)
    rows = torch.nonzero(used).flatten()
    weights[rows, :NM] = mel_filters.t().double().cpu()[bins[rows]]
    blocks = weights.view(16, 16, n_blocks, BANDS.value)  # [k2, k1, block, band]
    needed = (blocks != 0).any(dim=3).any(dim=1).t()  # [block, k2]
    plan = (needed.long() << torch.arange(16)).sum(dim=1).to(torch.int32)
    chunks = blocks.permute(2, 0, 3, 1)  # [block, k2, band, k1]
    packed = torch.zeros(n_blocks, 16, 256, dtype=torch.float64)
    packed[..., fragment_order().flatten()] = chunks.flatten(2)
    head = packed.to(torch.bfloat16)
    projection = torch.stack([head, (packed - head.double()).to(torch.bfloat16)])
    return plan, projection


@functools.cache
def _plan(n_mels: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """`chunk_plan(mel_filters(n_mels))` on `device`, once per (n_mels, device)."""
    plan, projection = chunk_plan(whisper.mel_filters(n_mels))
    return plan.to(device), projection.to(device)


def launch(audio: torch.Tensor, lengths: torch.Tensor | None, n_mels: int, out_dtype: torch.dtype,
           config: Config | None = None, with_floor: bool = False) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The main pass on validated, contiguous audio (B, N) and lengths (B,) int64 on its device, or None:
    (out, stats, block_f) as `portable.waveform.launch` returns them, for `floor.launch`, or `with_floor` with the
    floor folded into the same launch."""
    config = config or DEFAULT_CONFIG
    B, N = audio.shape
    device = audio.device  # read once: each read builds a torch.device
    operands, twiddles, window = dft_tables(device)
    plan, projection = _plan(n_mels, device)
    chosen = _launch_plan(B, N, n_mels, audio.dtype == torch.int16, lengths is not None, projection.shape[1], config,
                          with_floor)
    n_tiles = chosen.ints[3]
    stats = torch.empty(B, n_tiles, 2, dtype=torch.float32, device=device)
    out = torch.empty(B, n_mels, N // HOP.value, dtype=out_dtype, device=device)
    counters = floor.counters(device, B) if with_floor else None
    run(chosen, (audio, lengths, operands, twiddles, window, projection, plan, out, stats, counters))
    return out, stats, config.num_warps * config.frames


def kept_launch(audio: torch.Tensor, lengths: torch.Tensor | None, n_mels: int, out_dtype: torch.dtype,
                with_floor: bool = False):
    """`launch` in the default config for every later call of the same shapes, dtypes and device on tensors on 16
    bytes, once it ran on such tensors: (main_pass, block_f) as `portable.waveform.kept_launch` returns them; None
    where no launcher is kept."""
    config = DEFAULT_CONFIG
    B, N = audio.shape
    device = audio.device
    plan, projection = _plan(n_mels, device)
    chosen = _launch_plan(B, N, n_mels, audio.dtype == torch.int16, lengths is not None, projection.shape[1], config,
                          with_floor)
    main_pass = kept_main_pass(chosen, audio, lengths, (*dft_tables(device), projection, plan), out_dtype)
    return None if main_pass is None else (main_pass, config.num_warps * config.frames)


@functools.cache
def _launch_plan(B: int, N: int, n_mels: int, is_pcm: bool, has_lengths: bool, n_blocks: int, config: Config,
                 with_floor: bool) -> Launch:  # fmt: skip
    """The main pass's launch for a call shape, built once: its grid (with_floor: the floor items too), integer
    arguments (N, F, NM, n_tiles, B, n_groups) and meta-parameters."""
    F = N // HOP.value
    n_tiles = triton.cdiv(F, config.num_warps * config.frames)
    n_groups = floor.groups(n_tiles)
    meta = dict(J=config.frames, N_BLOCKS=n_blocks, IS_PCM=is_pcm, HAS_LENGTHS=has_lengths, WITH_FLOOR=with_floor,
                **floor.folded_meta(n_mels), maxnreg=config.maxnreg)
    programs = B * (n_tiles + n_groups) if with_floor else B * n_tiles
    return Launch(_waveform_gluon_kernel, programs, (N, F, n_mels, n_tiles, B, n_groups), meta, config.num_warps,
                  config.name + (" with floor" if with_floor else ""))
