"""Whisper's log-mel from the waveform in one pass (Triton): the main pass of `whisper_log_mel` on every CUDA GPU
the Gluon kernel (`hopper/waveform.py`) does not take; its floor (`floor.py`) runs as a pass of its own after it, or
folded into its launch (`with_floor`).

Per tile of BLOCK_F frames of one clip, everything stays on chip from the samples to the output:

1. Framing: frame f holds samples 160 f - 200 + n (n < 400), reflected at the clip's ends and zero at or past
   its length, times the periodic Hann window, by index arithmetic in the loads.
2. The 400-point real DFT as 25 x 16 (n = 16 n1 + n2, k = k1 + 25 k2), both stages tensor-core products:
   - stage 1, a 25-point real DFT along n1 for each (frame, n2): the real input folds n1 <-> 25 - n1 (cosines
     take s[n1] + s[25 - n1], sines s[n1] - s[25 - n1]), so two [16 x 16] products give Y[n2, k1] for
     k1 = 0..12, which is all the real signal needs;
   - the twiddles W400^(n2 k1), elementwise;
   - stage 2, a 16-point complex DFT along n2 for each (frame, k1 <= 12): X[k1 + 25 k2] for every k2. With
     X[400 - k] = conj(X[k]) these 13 x 16 values hold each of the bins 0..200 once (k1 = 0 holds 0, 25, ..,
     200 twice over: the filterbank weights the second copy zero).
   Every product is fp32-accurate (`_product`: three fp16 products of split operands): a mel band 80 dB below
   its frame's loudest bin is still above the floor, and one TF32 product's rounding (2^-11 of the frame)
   would swamp it.
3. Power, then the mel projection against the filterbank permuted into stage 2's (k1, k2) order, also split
   into three products (the power spans ten decades; a TF32 rounding per term costs up to 1e-4 of the output).
4. log10(max(mel, 1e-10)), (x + 4) / 4 written in the output dtype, transposed to (B, NM, F); the tile's max
   and min of the log kept for the floor (`floor.py`), which rewrites only tiles the clip's 80 dB floor
   reaches.
"""

import functools
import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .. import whisper
from ..common.direct_calls import StreamScratch
from ..common.launch import Launch, kept_launcher, launch as run
from . import floor
from .floor import count_tile, floor_group, take_item
from .log10 import log10_scaled

# Globals read inside @triton.jit functions must be constexpr; host code reads their `.value`.
N_FFT = tl.constexpr(whisper.N_FFT)
HOP = tl.constexpr(whisper.HOP_LENGTH)
RADIX = tl.constexpr(16)  # n2, k2: the stage-2 (complex) DFT size; 400 = 25 x 16
OUTER = tl.constexpr(25)  # n1, k1: the stage-1 (real) DFT size
HALF = tl.constexpr(13)  # k1 = 0..12: the stage-1 outputs a real signal needs
PCM_SCALE = tl.constexpr(whisper.PCM_SCALE)
# The projection's operand: the filterbank (weights below 0.05) times 2^6, closer to the top of fp16's range.
MEL_SHIFT = tl.constexpr(6)
WINDOW_PAD = 512  # the Hann window, zero past 400 (the masked lanes of the framing read there)


class Config(NamedTuple):
    """block_f frames a tile (a power of two; the stage products have 16 block_f rows), block_m mel bands a
    step of the projection (a power of two >= 16)."""

    block_f: int = 16
    block_m: int = 32
    num_warps: int = 4
    num_stages: int = 1
    k_groups: int = 4  # the projection's K = 256 in k_groups products side by side

    @property
    def name(self) -> str:
        return f"f{self.block_f} m{self.block_m} g{self.k_groups} w{self.num_warps} s{self.num_stages}"


DEFAULT_CONFIG = Config()


def split_operand(t: torch.Tensor) -> torch.Tensor:
    """A tensor-core product's constant operand as the kernel loads it: its fp16 head and tail stacked,
    (2, *t.shape), head + tail within 2^-22 of t (float64 in)."""
    head = t.to(torch.float16)
    return torch.stack([head, (t - head.to(t.dtype)).to(torch.float16)])


@functools.cache
def dft_tables(device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(operands, twiddles, window) on `device`, from float64, once per device: the products'
    tables (stage-1 cos, stage-1 -sin, stage-2 cos, stage-2 sin; (4, 16, 16), split by `split_operand`), the
    twiddles W400^(n2 k1) ((2, 16, 16) float32: real, imaginary part) and the Hann window ((512,) float32)."""
    radix, outer, half, n_fft = RADIX.value, OUTER.value, HALF.value, N_FFT.value
    i = torch.arange(radix, dtype=torch.float64)
    row, col = i[:, None], i[None, :]
    used = (row < half) & (col < half)
    operands = torch.stack([
        torch.where(used, torch.cos(2 * math.pi * row * col / outer), 0.0),  # [n1, k1]: n1 = 0..12
        torch.where(used & (row >= 1), -torch.sin(2 * math.pi * row * col / outer), 0.0),  # [n1, k1]: n1 = 1..12
        torch.cos(2 * math.pi * row * col / radix),  # [n2, k2]
        torch.sin(2 * math.pi * row * col / radix),
    ])
    twiddles = torch.stack([torch.cos(2 * math.pi * row * col / n_fft), -torch.sin(2 * math.pi * row * col / n_fft)])
    n = torch.arange(WINDOW_PAD, dtype=torch.float64)
    window = torch.where(n < n_fft, 0.5 - 0.5 * torch.cos(2 * math.pi * n / n_fft), 0.0)
    return (split_operand(operands).to(device), twiddles.to(device, torch.float32),
            window.to(device, torch.float32))


def stage2_bins() -> tuple[torch.Tensor, torch.Tensor]:
    """(bin, used) of the 256 stage-2 outputs in the kernel's order (k1 * 16 + k2): the DFT bin 0..200 each
    holds, and whether it is the one copy of that bin the projection counts."""
    radix, outer, n_fft = RADIX.value, OUTER.value, N_FFT.value
    k1 = torch.arange(radix)[:, None]
    k2 = torch.arange(radix)[None, :]
    k = k1 + outer * k2
    bins = torch.where(k <= n_fft // 2, k, n_fft - k)
    used = (k1 < HALF.value) & ~((k1 == 0) & (k2 > n_fft // (2 * outer)))
    return bins.flatten(), used.flatten()


def permuted_filterbank(mel_filters: torch.Tensor, block_m: int) -> torch.Tensor:
    """(256, NM rounded up to block_m) float32: row k1 * 16 + k2 holds the filterbank column of the bin that
    stage-2 output holds, zero for the unused ones and past NM."""
    NM = mel_filters.shape[0]
    bins, used = stage2_bins()
    out = torch.zeros(RADIX.value ** 2, triton.cdiv(NM, block_m) * block_m, dtype=torch.float32,
                      device=mel_filters.device)
    index = torch.nonzero(used).flatten()
    out[index.to(out.device), :NM] = mel_filters.t()[bins[used].to(mel_filters.device)]
    return out


@functools.cache
def _projection(n_mels: int, device: torch.device, block_m: int) -> torch.Tensor:
    """`permuted_filterbank(mel_filters(n_mels))` times 2^MEL_SHIFT as the projection loads it (`split_operand`)
    on `device`, once per (n_mels, device, block_m)."""
    weights = permuted_filterbank(whisper.mel_filters(n_mels), block_m).double() * 2.0**MEL_SHIFT.value
    return split_operand(weights).to(device)


@triton.jit
def _product(a, b_ptr, offsets, acc, B_LO: tl.constexpr):
    """acc + a @ b to about fp32 accuracy from three fp16 tensor-core products: a = fp16(a) + fp16(a - fp16(a)),
    exact to 2^-22 of a while a lies in fp16's normal range (the callers scale by powers of two to put their
    operands' maxima in [2^14, 2^15); smaller values keep an absolute accuracy of 2^-25 there), b the constant
    operand at b_ptr + offsets split the same way by `split_operand` (its tail B_LO elements on), the product of
    the two tails left out. fp16 products run at twice TF32's tensor-core rate."""
    a_hi = a.to(tl.float16)
    a_lo = (a - a_hi.to(tl.float32)).to(tl.float16)
    acc = tl.dot(a_hi, tl.load(b_ptr + B_LO + offsets), acc)
    b_hi = tl.load(b_ptr + offsets)
    acc = tl.dot(a_lo, b_hi, acc)
    return tl.dot(a_hi, b_hi, acc)


@triton.jit
def pow2_scale(amax):
    """(2^s, s) for the integer s that puts amax (>= 0) in [2^14, 2^15), within fp32's normal exponents (any s
    for 0). Multiplying by 2^s is exact."""
    biased = 268 - ((amax.to(tl.int32, bitcast=True) >> 23) & 255)  # 127 + 14 - (exponent of amax)
    biased = tl.minimum(tl.maximum(biased, 1), 254)
    return (biased << 23).to(tl.float32, bitcast=True), biased - 127


@triton.jit
def _frame_samples(audio_ptr, window_ptr, clip_base, length, N, frame, n, ok, IS_PCM: tl.constexpr):
    """Sample n of `frame` times the window: centre reflect padding at the clip's ends (N > 200), zero at or
    past `length` and where `ok` is false."""
    j = frame * HOP - N_FFT // 2 + n
    j = tl.where(j < 0, -j, j)
    j = tl.where(j >= N, 2 * N - 2 - j, j)
    x = tl.load(audio_ptr + clip_base + j, mask=ok & (j < length), other=0).to(tl.float32)
    if IS_PCM:
        x = x * PCM_SCALE
    return x * tl.load(window_ptr + n)


@triton.jit
def _power_tile(audio_ptr, lengths_ptr, operands_ptr, twiddles_ptr, window_ptr, clip, tile, N, F,
                BLOCK_F: tl.constexpr, IS_PCM: tl.constexpr, HAS_LENGTHS: tl.constexpr):
    """(power [BLOCK_F, 256], e): the power spectra of frames tile * BLOCK_F + i (clamped to F - 1) times 2^e,
    in the order k1 * 16 + k2 of `stage2_bins`. For `_product`'s fp16 operands the samples are scaled by 2^s
    (the tile's largest stage-1 input into [2^14, 2^15)) and the stage-2 inputs by 2^-5 (their bound
    26 * 2^15 * sqrt(2) into fp16's range), so e = 2 s - 10."""
    R: tl.constexpr = BLOCK_F * RADIX
    rows = tl.arange(0, R)
    n2 = rows % RADIX
    frame = tl.minimum(tile * BLOCK_F + rows // RADIX, F - 1)[:, None]
    cols = tl.arange(0, RADIX)
    length = N
    if HAS_LENGTHS:
        length = tl.load(lengths_ptr + clip).to(tl.int32)
    base = clip.to(tl.int64) * N
    # Stage-1 inputs [R, 16]: row (frame, n2), column n1 <= 12; s[n1] at 16 n1 + n2, s[25 - n1] at 400 - 16 n1 + n2.
    n_lo = RADIX * cols[None, :] + n2[:, None]
    n_hi = N_FFT - RADIX * cols[None, :] + n2[:, None]
    s_lo = _frame_samples(audio_ptr, window_ptr, base, length, N, frame, n_lo, cols[None, :] < HALF, IS_PCM)
    s_hi = _frame_samples(audio_ptr, window_ptr, base, length, N, frame, n_hi,
                          (cols[None, :] >= 1) & (cols[None, :] < HALF), IS_PCM)
    cosines = s_lo + s_hi
    sines = s_lo - s_hi
    scale, s = pow2_scale(tl.maximum(tl.max(tl.abs(cosines)), tl.max(tl.abs(sines))))
    square = cols[:, None] * RADIX + cols[None, :]
    LO: tl.constexpr = 4 * RADIX * RADIX  # the operands' tails (`split_operand`)
    y_re = _product(cosines * scale, operands_ptr, square, None, LO)
    y_im = _product(sines * scale, operands_ptr + RADIX * RADIX, square, None, LO)
    twiddle = twiddles_ptr + n2[:, None] * RADIX + cols[None, :]
    t_re = tl.load(twiddle)
    t_im = tl.load(twiddle + RADIX * RADIX)
    t_re *= 1.0 / 32
    t_im *= 1.0 / 32
    g_re = y_re * t_re - y_im * t_im
    g_im = y_re * t_im + y_im * t_re
    # Row (frame, n2), column k1 -> row (frame, k1), column n2: stage 2 contracts over n2.
    g_re = tl.reshape(tl.permute(tl.reshape(g_re, (BLOCK_F, RADIX, RADIX)), (0, 2, 1)), (R, RADIX))
    g_im = tl.reshape(tl.permute(tl.reshape(g_im, (BLOCK_F, RADIX, RADIX)), (0, 2, 1)), (R, RADIX))
    cos2 = operands_ptr + 2 * RADIX * RADIX
    sin2 = operands_ptr + 3 * RADIX * RADIX
    z_re = _product(g_im, sin2, square, _product(g_re, cos2, square, None, LO), LO)
    z_im = _product(-g_re, sin2, square, _product(g_im, cos2, square, None, LO), LO)
    e = 2 * s - 10
    return tl.reshape(z_re * z_re + z_im * z_im, (BLOCK_F, RADIX * RADIX)), e


@triton.jit
def _waveform_tile(audio_ptr, lengths_ptr, operands_ptr, twiddles_ptr, window_ptr, proj_ptr, out_ptr, stats_ptr, item,
                   N, F, NM, n_tiles, BLOCK_F: tl.constexpr, BLOCK_M: tl.constexpr, NM_PAD: tl.constexpr,
                   K_GROUPS: tl.constexpr, IS_PCM: tl.constexpr, HAS_LENGTHS: tl.constexpr, HW_LOG2: tl.constexpr):
    """Main item `item`, frame tile item % n_tiles of clip item // n_tiles: (log10(max(mel, 1e-10)) + 4) / 4 into out
    (B, NM, F), and the tile's (max, min) of the log into stats."""
    clip = item // n_tiles
    tile = item % n_tiles
    power, e = _power_tile(audio_ptr, lengths_ptr, operands_ptr, twiddles_ptr, window_ptr, clip, tile, N, F,
                           BLOCK_F, IS_PCM, HAS_LENGTHS)
    # The power into [2^14, 2^15) as well (the filterbank arrives times 2^MEL_SHIFT), so that
    # mel = product * 2^-(e + s + MEL_SHIFT).
    scale, s = pow2_scale(tl.max(power))
    e += s + MEL_SHIFT
    frames = tile * BLOCK_F + tl.arange(0, BLOCK_F)
    out_clip = out_ptr + clip.to(tl.int64) * NM * F
    run_max = tl.full((BLOCK_F, BLOCK_M), float("-inf"), tl.float32)
    run_min = tl.full((BLOCK_F, BLOCK_M), float("inf"), tl.float32)
    # The projection contracts 256 values a frame; one product of K = 256 would hold its whole A operand in
    # each thread (128 registers for each half of the split), so it runs as K_GROUPS products of
    # K = 256 / K_GROUPS side by side (a batched product, the groups spread over the warps), then sums them.
    power = tl.permute(tl.reshape(power * scale, (BLOCK_F, K_GROUPS, RADIX * RADIX // K_GROUPS)), (1, 0, 2))
    group_rows = tl.arange(0, K_GROUPS)[:, None, None] * (RADIX * RADIX // K_GROUPS)
    k_in_group = tl.arange(0, RADIX * RADIX // K_GROUPS)[None, :, None]
    for m0 in range(0, NM_PAD, BLOCK_M):
        bands = m0 + tl.arange(0, BLOCK_M)
        w = (group_rows + k_in_group) * NM_PAD + bands[None, None, :]
        mel = tl.sum(_product(power, proj_ptr, w, None, RADIX * RADIX * NM_PAD), axis=0)
        log_spec = log10_scaled(mel, e, HW_LOG2)
        # Stored as [BLOCK_M, BLOCK_F] (frames contiguous, as in memory): stored untransposed, a 16-bit output
        # costs about 90 registers more.
        tl.store(out_clip + bands[:, None] * F + frames[None, :],
                 tl.trans(((log_spec + 4.0) * 0.25).to(out_ptr.dtype.element_ty)),
                 mask=(bands < NM)[:, None] & (frames < F)[None, :])
        # Frames past F repeat frame F - 1; bands past NM (zero weights) must not lower the minimum.
        run_max = tl.maximum(run_max, log_spec)
        run_min = tl.minimum(run_min, tl.where((bands < NM)[None, :], log_spec, float("inf")))
    stats = stats_ptr + item.to(tl.int64) * 2
    tl.store(stats, tl.max(run_max))
    tl.store(stats + 1, tl.min(run_min))


@triton.jit
def _waveform_kernel(audio_ptr, lengths_ptr, operands_ptr, twiddles_ptr, window_ptr, proj_ptr, out_ptr,
                     stats_ptr, counters_ptr, N, F, NM, n_tiles, B, n_groups, BLOCK_F: tl.constexpr,
                     BLOCK_M: tl.constexpr, NM_PAD: tl.constexpr, K_GROUPS: tl.constexpr, IS_PCM: tl.constexpr,
                     HAS_LENGTHS: tl.constexpr, HW_LOG2: tl.constexpr, WITH_FLOOR: tl.constexpr,
                     FLOOR_M: tl.constexpr, STATS_CHUNK: tl.constexpr, FLOOR_TILES: tl.constexpr):
    """The main pass, one program per (clip, frame tile), clip-major (`_waveform_tile`); WITH_FLOOR, one per item of
    the floor folded in (`floor.py`): B * n_tiles main items, then B * n_groups floor items, taken by ticket."""
    if WITH_FLOOR:
        n_main = B * n_tiles
        item = take_item(counters_ptr, n_main + B * n_groups)
        if item < n_main:
            _waveform_tile(audio_ptr, lengths_ptr, operands_ptr, twiddles_ptr, window_ptr, proj_ptr, out_ptr,
                           stats_ptr, item, N, F, NM, n_tiles, BLOCK_F, BLOCK_M, NM_PAD, K_GROUPS, IS_PCM,
                           HAS_LENGTHS, HW_LOG2)
            count_tile(counters_ptr, item // n_tiles)
        else:
            floor_group(out_ptr, stats_ptr, counters_ptr, item - n_main, F, NM, n_tiles, n_groups,
                        tl.arange(0, BLOCK_F), tl.arange(0, FLOOR_M), tl.arange(0, STATS_CHUNK), FLOOR_TILES)
    else:
        _waveform_tile(audio_ptr, lengths_ptr, operands_ptr, twiddles_ptr, window_ptr, proj_ptr, out_ptr, stats_ptr,
                       tl.program_id(0), N, F, NM, n_tiles, BLOCK_F, BLOCK_M, NM_PAD, K_GROUPS, IS_PCM, HAS_LENGTHS,
                       HW_LOG2)


def launch(audio: torch.Tensor, lengths: torch.Tensor | None, n_mels: int, out_dtype: torch.dtype,
           config: Config | None = None, with_floor: bool = False) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The main pass on validated, contiguous audio (B, N) (float32, float16, bfloat16 or int16 PCM) and lengths
    (B,) int64 on its device, or None: (out, stats, block_f), out (B, n_mels, N // 160) in `out_dtype`, stats
    (B, n_tiles, 2) the (max, min) of the log in each tile of block_f frames. out is before the floor, for
    `floor.launch`, or `with_floor` final: the floor folded into the same launch (`floor.py`)."""
    config = config or DEFAULT_CONFIG
    B, N = audio.shape
    device = audio.device  # read once: each read builds a torch.device
    operands, twiddles, window = dft_tables(device)
    proj = _projection(n_mels, device, config.block_m)
    plan = _plan(B, N, n_mels, audio.dtype == torch.int16, lengths is not None, proj.shape[-1], config, with_floor)
    n_tiles = plan.ints[3]
    stats = torch.empty(B, n_tiles, 2, dtype=torch.float32, device=device)
    out = torch.empty(B, n_mels, N // HOP.value, dtype=out_dtype, device=device)
    counters = floor.counters(device, B) if with_floor else None
    run(plan, (audio, lengths, operands, twiddles, window, proj, out, stats, counters))
    return out, stats, config.block_f


def kept_launch(audio: torch.Tensor, lengths: torch.Tensor | None, n_mels: int, out_dtype: torch.dtype,
                with_floor: bool = False):
    """`launch` in the default config for every later call of the same shapes, dtypes and device on tensors on 16
    bytes, once it ran on such tensors: (main_pass, block_f), main_pass a function (audio, lengths) -> (out, stats)
    (`kept_main_pass`); None where no launcher is kept."""
    config = DEFAULT_CONFIG
    B, N = audio.shape
    device = audio.device
    tables = (*dft_tables(device), _projection(n_mels, device, config.block_m))
    plan = _plan(B, N, n_mels, audio.dtype == torch.int16, lengths is not None, tables[-1].shape[-1], config,
                 with_floor)
    main_pass = kept_main_pass(plan, audio, lengths, tables, out_dtype)
    return None if main_pass is None else (main_pass, config.block_f)


def kept_main_pass(plan: Launch, audio: torch.Tensor, lengths: torch.Tensor | None, tables: tuple,
                   out_dtype: torch.dtype):  # fmt: skip
    """A main pass's launch `plan` (this module's or the Gluon kernel's: integers (N, F, NM, n_tiles, B, n_groups),
    tensors audio, lengths, the constant `tables`, out, stats and the floor's counters) for calls on tensors of
    audio's and lengths' dtypes and device, on 16 bytes: a function (audio, lengths) -> (out, stats) that allocates
    out, takes stats and counters from its stream's scratch (`common.direct_calls.StreamScratch`) and launches the
    kept kernel. None where no launcher is kept."""
    _, F, NM, n_tiles, B, _ = plan.ints
    with_floor = plan.meta["WITH_FLOOR"]
    device = audio.device
    dtypes = (audio.dtype, None if lengths is None else lengths.dtype, *[t.dtype for t in tables], out_dtype,
              torch.float32, torch.int32 if with_floor else None)
    launch_kept = kept_launcher(plan, device.index, dtypes)
    if launch_kept is None:
        return None

    def fresh_scratch():  # the tile statistics, and the folded floor's counters (`floor.counters`)
        stats = torch.empty(B, n_tiles, 2, dtype=torch.float32, device=device)
        return stats, torch.zeros(1 + B, dtype=torch.int32, device=device) if with_floor else None

    scratch, empty, out_shape = StreamScratch(device.index, fresh_scratch), torch.empty, (B, NM, F)

    def main_pass(audio, lengths):
        out = empty(*out_shape, dtype=out_dtype, device=device)  # sizes as arguments: parsed faster
        stats, counters = scratch()
        launch_kept(audio, lengths, *tables, out, stats, counters)
        return out, stats

    return main_pass


@functools.cache
def _plan(B: int, N: int, n_mels: int, is_pcm: bool, has_lengths: bool, nm_pad: int, config: Config,
          with_floor: bool) -> Launch:  # fmt: skip
    """The main pass's launch for a call shape, built once: its grid (with_floor: the floor items too), integer
    arguments (N, F, NM, n_tiles, B, n_groups) and meta-parameters."""
    F = N // HOP.value
    n_tiles = triton.cdiv(F, config.block_f)
    n_groups = floor.groups(n_tiles)
    meta = dict(BLOCK_F=config.block_f, BLOCK_M=config.block_m, NM_PAD=nm_pad, K_GROUPS=config.k_groups,
                IS_PCM=is_pcm, HAS_LENGTHS=has_lengths,
                # The interpreter (CPU) cannot run inline PTX.
                HW_LOG2=not triton.knobs.runtime.interpret, WITH_FLOOR=with_floor, **floor.folded_meta(n_mels),
                num_stages=config.num_stages)
    programs = B * (n_tiles + n_groups) if with_floor else B * n_tiles
    return Launch(_waveform_kernel, programs, (N, F, n_mels, n_tiles, B, n_groups), meta, config.num_warps,
                  config.name + (" with floor" if with_floor else ""))
