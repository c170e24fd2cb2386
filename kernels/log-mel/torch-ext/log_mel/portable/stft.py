"""The fused log-mel from a complex STFT (Triton), its planning and its launch: the CUDA path of
`log_mel_spectrogram`.

The op is a bandwidth kernel with a small matmul in it: read the complex64 STFT once, write the fp32
log-mel once. Three stages, run in order by `launch`:

1. `_band_support_kernel` reads the (NM, NF) filterbank and writes, for each block of BLOCK_M bands, the
   bin range [lo, hi) outside which every weight of the block is exactly zero, and `_chunk_list_kernel`
   turns those into the main pass's chunk list. They run on every call (the filterbank is at most 400 KB),
   so no cache can go stale; a dense filterbank gives [0, NF) everywhere and the projection is then simply
   dense.
2. The main pass (`_stft_kernel`, one program per (clip, frame tile)): for a tile of BLOCK_F frames, one
   loop over the chunk list, each band block's bins [lo, hi) in chunks of BLOCK_K: square and add re/im,
   project with an fp32 `tl.dot` (`input_precision` "ieee": CUDA-core FMAs; or "tf32x3": three TF32
   tensor-core products, about fp32-accurate), then at a block's last chunk write
   `(log10(max(mel, 1e-10)) + 4) / 4` - the final value whenever the floor does not bite - and keep the
   tile's max and min of log10.
3. The floor (`_stft_floor_kernel`): the clip's maximum `hi` is the max of its tile maxima (`floor.clip_floor`);
   only tiles whose minimum lies below `hi - 8` are re-read and rewritten as `max(out, (hi - 8 + 4) / 4)`.
   Because `x -> (x + 4) / 4` is monotone in fp32 too, this equals the spec's `(max(x, hi - 8) + 4) / 4` bit
   for bit. On speech without digital silence no tile is below the floor and the pass reads only the tile
   statistics.
"""

import functools
from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ..common.direct_calls import StreamScratch
from ..common.launch import Launch, kept_launcher, launch as run
from .floor import STATS_CHUNK, clip_floor
from .log10 import log10_clamped

SUPPORT_CHUNK = 128  # filterbank bins per step of the band-support scan
FLOOR_CHUNK = 1024  # output elements per step of the floor pass
# Frame tiles a floor-pass program checks: at one a program the pass is thousands of programs of a few loads
# each, and 8 a program is faster on the H200.
FLOOR_TILES = 8
# A chunk entry of the main pass's loop: first bin, the block's hi and the block in 21-bit fields of an int64, the
# sign bit set at a block's last chunk. One 8-byte load per chunk, no load that depends on another.
FIELD_BITS = tl.constexpr(21)
FIELD_MASK = tl.constexpr((1 << FIELD_BITS.value) - 1)


@dataclass(frozen=True)
class Config:
    """Tile sizes of the main pass. block_f and block_m are powers of two; block_k a power of two >= 16
    (the minimum K of `tl.dot`)."""

    block_f: int = 64  # frames per tile (the M of the projection)
    block_m: int = 8  # mel bands per band block (the N); smaller blocks skip more zero weights
    block_k: int = 16  # frequency bins per chunk (the K)
    num_warps: int = 4
    num_stages: int = 1
    precision: str = "tf32x3"  # "tf32x3" (3 TF32 tensor-core products) or "ieee" (CUDA-core fp32); never "tf32"

    @property
    def name(self) -> str:
        return f"{self.block_f}x{self.block_m}x{self.block_k} w{self.num_warps} s{self.num_stages} {self.precision}"


# The main pass runs one loop over the tile's chunk list, the next chunk's loads in flight, which is faster on the
# H200 than a loop per band block, pipelined or not, at every swept shape. Its epilogue runs only at a block's last
# chunk and its chunk entries are packed and its loads unmasked, which holds 64x8x16 tiles to 72 registers (7 CTAs
# an SM). The hardware log2 (`log10.log10_clamped`) is level with libdevice's there and a clear
# gain at 64x16x32 (4 CTAs an SM, where issue slots are busier). 16-band blocks of 32-bin chunks take fewer,
# wider steps (128 registers, 4 CTAs an SM) and are the fastest at NM 128 and at (104, 3000, 401, 80); where the
# bands are narrower, at (208, 3000, 201, 80), 8-band blocks of 32 bins are faster, and 16-band blocks only
# level with 8 x 16 ones.
DEFAULT_CONFIG = Config(block_m=16, block_k=32)
NARROW_BANDS_CONFIG = Config(block_k=32)


@triton.jit
def _band_support_kernel(w_ptr, lo_ptr, hi_ptr, NM, NF, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr):
    """[lo, hi): the bins any band of band block `program_id` weights with a nonzero (or NaN) value; an
    empty block gets lo = NF > hi = 0."""
    block = tl.program_id(0)
    bands = block * BLOCK_M + tl.arange(0, BLOCK_M)
    lo = tl.zeros((), tl.int32) + NF
    hi = tl.zeros((), tl.int32)
    for k0 in range(0, NF, CHUNK):
        ks = k0 + tl.arange(0, CHUNK)
        inside = (bands < NM)[:, None] & (ks < NF)[None, :]
        w = tl.load(w_ptr + bands[:, None] * NF + ks[None, :], mask=inside, other=0.0)
        used = inside & (w != 0.0)
        lo = tl.minimum(lo, tl.min(tl.where(used, ks[None, :], NF)))
        hi = tl.maximum(hi, tl.max(tl.where(used, ks[None, :] + 1, 0)))
    tl.store(lo_ptr + block, lo)
    tl.store(hi_ptr + block, hi)


@triton.jit
def _chunk_list_kernel(lo_ptr, hi_ptr, chunks_ptr, n_blocks, BLOCK_K: tl.constexpr, BLOCKS: tl.constexpr):
    """The main pass's work list, one program, all blocks at once (BLOCKS: a power of two >= n_blocks):
    chunks_ptr[0] = the number of chunks, then one packed int64 entry per chunk (FIELD_BITS), blocks in
    order, each block's [lo, hi) in BLOCK_K steps. An empty block (lo = NF > hi = 0) gets one chunk whose
    loads are all masked, so its bands are still written (silence)."""
    blocks = tl.arange(0, BLOCKS)
    real = blocks < n_blocks
    lo = tl.load(lo_ptr + blocks, mask=real, other=0)
    hi = tl.load(hi_ptr + blocks, mask=real, other=0)
    start = tl.minimum(lo, hi)
    count = tl.where(real, tl.maximum((hi - start + BLOCK_K - 1) // BLOCK_K, 1), 0)
    first = tl.cumsum(count, 0) - count  # each block's first entry
    for j in range(0, tl.max(count)):
        entry = ((start + j * BLOCK_K).to(tl.int64) | (hi.to(tl.int64) << FIELD_BITS)
                 | (blocks.to(tl.int64) << (2 * FIELD_BITS)) | ((j == count - 1).to(tl.int64) << 63))
        tl.store(chunks_ptr + 1 + first + j, entry, mask=j < count)
    tl.store(chunks_ptr, tl.sum(count).to(tl.int64))


@triton.jit
def _load_chunk(x_rows, w_ptr, frame_ok, bands, band_ok, k0, k_hi, NF, BLOCK_K: tl.constexpr):
    """Bins k0 .. k0 + BLOCK_K (zero from k_hi on): the STFT as (re, im) pairs [BLOCK_F, 2 * BLOCK_K] and the
    band block's weights [BLOCK_K, BLOCK_M]."""
    # BLOCK_K bins of each frame are 2 * BLOCK_K contiguous floats: one vectorised load per row.
    cols = 2 * k0 + tl.arange(0, 2 * BLOCK_K)
    xy = tl.load(x_rows + cols[None, :], mask=frame_ok[:, None] & (cols < 2 * k_hi)[None, :], other=0.0)
    ks = k0 + tl.arange(0, BLOCK_K)
    w = tl.load(w_ptr + bands[None, :] * NF + ks[:, None], mask=(ks < k_hi)[:, None] & band_ok[None, :], other=0.0)
    return xy, w


@triton.jit
def _project(mel, xy, w, BLOCK_F: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    """mel + power(xy) @ w."""
    re, im = tl.split(tl.reshape(xy, (BLOCK_F, BLOCK_K, 2)))
    return tl.dot(re * re + im * im, w, mel, input_precision=PRECISION)


@triton.jit
def _unpack_chunk(entry):
    """(first bin, the block's hi, band block) of a packed chunk entry; `entry < 0` at a block's last chunk."""
    k0 = (entry & FIELD_MASK).to(tl.int32)
    k_hi = ((entry >> FIELD_BITS) & FIELD_MASK).to(tl.int32)
    block = ((entry >> (2 * FIELD_BITS)) & FIELD_MASK).to(tl.int32)
    return k0, k_hi, block


@triton.jit
def _log_mel_tile(x_ptr, w_ptr, chunks_ptr, out_ptr, clip, tile, F, NM, BLOCK_F: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_K: tl.constexpr, PRECISION: tl.constexpr, SHORT_CLIP: tl.constexpr, NF: tl.constexpr,
                  HW_LOG2: tl.constexpr):
    """Write (log10(max(mel, 1e-10)) + 4) / 4 for frames [tile*BLOCK_F, +BLOCK_F) of `clip`; return the
    tile's (max, min) of log10(max(mel, 1e-10)).

    One loop over the tile's chunk list (`_chunk_list_kernel`), each step issuing the next chunk's loads before
    projecting its own, and a block's output written at its last chunk (NF a compile-time constant; SHORT_CLIP:
    F < BLOCK_F).

    Every lane computes a real value of the clip, so the loads need no frame or band mask, the tile's max and min
    no mask at all, and only the store is masked: a clip's last tile ends at frame F (it starts early and rewrites
    frames of the tile before it with the same values), a clip shorter than a tile reads frame F - 1 for the
    frames it lacks, and bands past NM (below) the weights of band NM - 1. One pointer to the tile's first frame
    plus affine int32 offsets: with NF a compile-time constant the rows are immediate offsets of that pointer, not
    one 64-bit pointer per row (two-pass at 64x8x16: 72 registers, so 7 CTAs per SM; 64-bit row pointers would
    cost 96 and allow 5)."""
    frames = tl.arange(0, BLOCK_F)
    if SHORT_CLIP:  # F < BLOCK_F
        frame_ok = frames < F
        frames = tl.minimum(frames, F - 1)
    else:
        frame_ok = tl.full((BLOCK_F,), 1, tl.int1)
    first = clip.to(tl.int64) * F + tl.maximum(tl.minimum(tile * BLOCK_F, F - BLOCK_F), 0)
    x_rows = x_ptr + first * (2 * NF) + (frames * (2 * NF))[:, None]  # the STFT as float32 pairs (re, im)
    out_rows = out_ptr + first * NM + (frames * NM)[:, None]
    lanes = tl.arange(0, BLOCK_M)
    # Elementwise running max/min, reduced once at the end: a reduction per band block would cost two
    # cross-warp exchanges (shared memory and barriers) per block.
    run_max = tl.full((BLOCK_F, BLOCK_M), float("-inf"), tl.float32)
    run_min = tl.full((BLOCK_F, BLOCK_M), float("inf"), tl.float32)
    everything = tl.full((BLOCK_F,), 1, tl.int1)  # constant-true masks fold away
    all_bands = tl.full((BLOCK_M,), 1, tl.int1)
    mel = tl.zeros((BLOCK_F, BLOCK_M), tl.float32)  # reset after each block's last chunk
    n_chunks = tl.load(chunks_ptr).to(tl.int32)
    entries = chunks_ptr + 1  # packed (first bin, block's hi, block, last chunk of its block) per chunk
    entry_next = tl.load(entries)
    k0, k_hi, block = _unpack_chunk(entry_next)
    xy_next, w_next = _load_chunk(x_rows, w_ptr, everything, tl.minimum(block * BLOCK_M + lanes, NM - 1),
                                  all_bands, k0, k_hi, NF, BLOCK_K)
    for i in range(0, n_chunks):
        xy, w, entry = xy_next, w_next, entry_next
        entry_next = tl.load(entries + tl.minimum(i + 1, n_chunks - 1))  # the last step reloads its own
        k0, k_hi, block = _unpack_chunk(entry_next)
        xy_next, w_next = _load_chunk(x_rows, w_ptr, everything, tl.minimum(block * BLOCK_M + lanes, NM - 1),
                                      all_bands, k0, k_hi, NF, BLOCK_K)
        mel = _project(mel, xy, w, BLOCK_F, BLOCK_K, PRECISION)
        # A uniform condition: the chunks before a block's last one only load and project.
        if entry < 0:
            _, _, block = _unpack_chunk(entry)
            bands = block * BLOCK_M + lanes
            log_spec = log10_clamped(mel, HW_LOG2)
            tl.store(out_rows + bands[None, :], (log_spec + 4.0) * 0.25,
                     mask=frame_ok[:, None] & (bands < NM)[None, :])
            run_max = tl.maximum(run_max, log_spec)
            run_min = tl.minimum(run_min, log_spec)
            mel = tl.zeros((BLOCK_F, BLOCK_M), tl.float32)
    return tl.max(run_max), tl.min(run_min)


@triton.jit
def _floor_tile(out_ptr, clip, tile, F, NM, floor, BLOCK_F: tl.constexpr, CHUNK: tl.constexpr):
    """out = max(out, (floor + 4) / 4) over one frame tile: BLOCK_F whole rows, one contiguous range."""
    start = (clip.to(tl.int64) * F + tile * BLOCK_F) * NM
    n = tl.minimum(F - tile * BLOCK_F, BLOCK_F) * NM
    floor_out = (floor + 4.0) * 0.25
    for i0 in range(0, n, CHUNK):
        i = i0 + tl.arange(0, CHUNK)
        v = tl.load(out_ptr + start + i, mask=i < n)
        tl.store(out_ptr + start + i, tl.maximum(v, floor_out), mask=i < n)


@triton.jit
def _stft_kernel(x_ptr, w_ptr, chunks_ptr, out_ptr, stats_ptr, F, NM, n_tiles, BLOCK_F: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr, SHORT_CLIP: tl.constexpr,
                 NF: tl.constexpr, HW_LOG2: tl.constexpr):
    """The main pass: one program per (clip, frame tile), clip-major."""
    pid = tl.program_id(0)
    clip = pid // n_tiles
    tile = pid % n_tiles
    tile_max, tile_min = _log_mel_tile(x_ptr, w_ptr, chunks_ptr, out_ptr, clip, tile, F, NM, BLOCK_F, BLOCK_M,
                                       BLOCK_K, PRECISION, SHORT_CLIP, NF, HW_LOG2)
    stats = stats_ptr + pid.to(tl.int64) * 2
    tl.store(stats, tile_max)
    tl.store(stats + 1, tile_min)


@triton.jit
def _stft_floor_kernel(out_ptr, stats_ptr, F, NM, n_tiles, n_groups, BLOCK_F: tl.constexpr,
                       STATS_CHUNK: tl.constexpr, FLOOR_CHUNK: tl.constexpr, FLOOR_TILES: tl.constexpr):
    """The floor: one program per (clip, group of FLOOR_TILES frame tiles); touches the output only where the
    80 dB floor bites."""
    pid = tl.program_id(0)
    clip = pid // n_groups
    first = (pid % n_groups) * FLOOR_TILES
    floor = clip_floor(stats_ptr, clip, n_tiles, tl.arange(0, STATS_CHUNK))
    stats = stats_ptr + clip.to(tl.int64) * n_tiles * 2
    for tile in range(first, tl.minimum(first + FLOOR_TILES, n_tiles)):
        if tl.load(stats + 2 * tile + 1) < floor:
            _floor_tile(out_ptr, clip, tile, F, NM, floor, BLOCK_F, FLOOR_CHUNK)


@dataclass(frozen=True)
class PickRule:
    """A row of PICK_TABLE: shapes with NF <= max_nf, NM <= max_nm and F >= min_f run `config`."""

    max_nf: float
    max_nm: float
    min_f: int
    config: Config


# First matching row wins; the last row catches every shape. The rows follow a config sweep on the H200: 80
# bands over 201 bins are about 2.5 bins apart, so 8 of them span about one 32-bin chunk.
PICK_TABLE = (
    PickRule(max_nf=201, max_nm=80, min_f=1, config=NARROW_BANDS_CONFIG),
    PickRule(max_nf=float("inf"), max_nm=float("inf"), min_f=1, config=DEFAULT_CONFIG),
)


def pick(B: int, F: int, NF: int, NM: int) -> Config:
    """The tile config a call of this shape runs."""
    return next(r for r in PICK_TABLE if NF <= r.max_nf and NM <= r.max_nm and F >= r.min_f).config


def band_plan(mel_filters: torch.Tensor, block_m: int, block_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(support, chunks): support (2, ceil(NM / block_m)) int32, row 0 the first and row 1 one past the last
    used bin of each band block (`_band_support_kernel`); chunks int64 [1 + L], the main pass's work list
    (`_chunk_list_kernel`; L bounds every block's chunk count by NF's). Built on every call, so no cache can go
    stale. Two launches, because one program doing both is slower than the support kernel and the list kernel
    together."""
    NM, NF = mel_filters.shape
    plans = _band_plans(NM, NF, block_m, block_k)
    support, chunks = _run_band_plan(plans, mel_filters)
    return support[:, : plans.n_blocks], chunks


def launch(stft: torch.Tensor, mel_filters: torch.Tensor, config: Config | None = None) -> torch.Tensor:
    """The fused log-mel of contiguous, validated inputs: the band plan, the main pass and the floor, in `config`
    (default: `pick(...)`)."""
    B, F, NF = stft.shape
    NM = mel_filters.shape[0]
    plans = _plans(B, F, NF, NM, config or pick(B, F, NF, NM))
    _, chunks = _run_band_plan(plans.band, mel_filters)
    stats = torch.empty(plans.stats_shape, dtype=torch.float32, device=stft.device)
    out = torch.empty(B, F, NM, dtype=torch.float32, device=stft.device)
    run(plans.main, (torch.view_as_real(stft), mel_filters, chunks, out, stats))  # (B, F, NF, 2) float32 view
    run(plans.floor, (out, stats))
    return out


def kept_launch(stft: torch.Tensor, mel_filters: torch.Tensor):
    """`launch` in the default config for every later call of the same shapes and device on tensors on 16 bytes,
    once it ran on such tensors: a function (stft, mel_filters) -> out that allocates out, takes the band plan and
    the tile statistics from its stream's scratch (`common.direct_calls.StreamScratch`) and launches the four kept
    kernels (`common.launch.kept_launcher`); None where no launcher is kept."""
    B, F, NF = stft.shape
    NM = mel_filters.shape[0]
    plans = _plans(B, F, NF, NM, pick(B, F, NF, NM))
    index = stft.device.index
    band = plans.band
    kept = (kept_launcher(band.support, index, (torch.float32, torch.int32, torch.int32)),
            kept_launcher(band.chunk_list, index, (torch.int32, torch.int32, torch.int64)),
            kept_launcher(plans.main, index, (torch.float32,) * 2 + (torch.int64,) + (torch.float32,) * 2),
            kept_launcher(plans.floor, index, (torch.float32, torch.float32)))
    if None in kept:
        return None
    support, chunk_list, main, floor = kept
    device = stft.device

    def fresh_scratch():  # the band plan's support rows and chunk list, the tile statistics
        lo, hi = torch.empty(2, band.row, dtype=torch.int32, device=device).unbind()
        chunks = torch.empty(band.chunks, dtype=torch.int64, device=device)
        return lo, hi, chunks, torch.empty(plans.stats_shape, dtype=torch.float32, device=device)

    scratch = StreamScratch(device.index, fresh_scratch)
    empty, view_as_real, out_shape = torch.empty, torch.view_as_real, (B, F, NM)

    def log_mel_spectrogram_kept(stft, mel_filters):
        lo, hi, chunks, stats = scratch()
        support(mel_filters, lo, hi)
        chunk_list(lo, hi, chunks)
        out = empty(*out_shape, dtype=torch.float32, device=device)  # sizes as arguments: parsed faster
        main(view_as_real(stft), mel_filters, chunks, out, stats)
        floor(out, stats)
        return out

    return log_mel_spectrogram_kept


class _BandPlans(NamedTuple):
    """The launches of the band plan of a filterbank shape, its band blocks, the row length of its support (a
    multiple of four, so that both rows start on 16 bytes) and its chunk list's length."""

    support: Launch
    chunk_list: Launch
    n_blocks: int
    row: int
    chunks: int


class _Plans(NamedTuple):
    """The launches of a call shape and config: the band plan's, the main pass's and the floor's, and the shape of
    the tile statistics."""

    band: _BandPlans
    main: Launch
    floor: Launch
    stats_shape: tuple


@functools.cache
def _band_plans(NM: int, NF: int, block_m: int, block_k: int) -> _BandPlans:
    """The band plan's launches for a filterbank shape and tiles, built once."""
    n_blocks = triton.cdiv(NM, block_m)
    if max(NF, n_blocks) > FIELD_MASK.value:
        raise ValueError(f"the main pass's chunk entries hold at most {FIELD_MASK.value} bins and band blocks")
    support = Launch(_band_support_kernel, n_blocks, (NM, NF), dict(BLOCK_M=block_m, CHUNK=SUPPORT_CHUNK), 4,
                     "band support")
    chunk_list = Launch(_chunk_list_kernel, 1, (n_blocks,),
                        dict(BLOCK_K=block_k, BLOCKS=triton.next_power_of_2(n_blocks)), 4, "chunk list")
    return _BandPlans(support, chunk_list, n_blocks, triton.cdiv(n_blocks, 4) * 4,
                      1 + n_blocks * max(1, triton.cdiv(NF, block_k)))


def _run_band_plan(plans: _BandPlans, mel_filters: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(support (2, plans.row), chunks) of `band_plan`: its two launches."""
    support = torch.empty(2, plans.row, dtype=torch.int32, device=mel_filters.device)
    chunks = torch.empty(plans.chunks, dtype=torch.int64, device=mel_filters.device)
    lo, hi = support
    run(plans.support, (mel_filters, lo, hi))
    run(plans.chunk_list, (lo, hi, chunks))
    return support, chunks


@functools.cache
def _plans(B: int, F: int, NF: int, NM: int, config: Config) -> _Plans:
    """The launches of a call shape in `config`, built once."""
    n_tiles = triton.cdiv(F, config.block_f)
    n_groups = triton.cdiv(n_tiles, FLOOR_TILES)
    main = Launch(_stft_kernel, B * n_tiles, (F, NM, n_tiles),
                  dict(BLOCK_F=config.block_f, BLOCK_M=config.block_m, BLOCK_K=config.block_k,
                       PRECISION=config.precision, SHORT_CLIP=F < config.block_f, NF=NF,
                       # The interpreter (CPU) cannot run inline PTX.
                       HW_LOG2=not triton.knobs.runtime.interpret, num_stages=config.num_stages),
                  config.num_warps, config.name)
    floor = Launch(_stft_floor_kernel, B * n_groups, (F, NM, n_tiles, n_groups),
                   dict(BLOCK_F=config.block_f, STATS_CHUNK=STATS_CHUNK, FLOOR_CHUNK=FLOOR_CHUNK,
                        FLOOR_TILES=FLOOR_TILES), 4, "stft floor")
    return _Plans(_band_plans(NM, NF, config.block_m, config.block_k), main, floor, (B, n_tiles, 2))
