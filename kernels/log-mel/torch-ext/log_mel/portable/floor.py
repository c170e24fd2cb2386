"""The floor of `whisper_log_mel`, shared by its Triton and Gluon main passes: each clip's 80 dB floor from the main
pass's per-tile statistics (`clip_floor`, which the STFT path's floor takes too), applied in place on the (B, NM, F)
features only on the tiles it reaches (`floor_tiles`), either as a pass of its own (`launch`) or folded into the main
pass's launch.

Folded, the main pass's grid holds B * n_tiles main items (a frame tile each) and then B * n_groups floor items (a
group of FLOOR_TILES tiles each, as the floor pass's programs), and each program takes its item by ticket
(`take_item`), in the order the programs start. A main item adds its tile to its clip's count (`count_tile`: a CTA
barrier, then a release) once its output and statistics are written; a floor item waits (acquire) until its clip's
count holds every tile, then floors its tiles (`floor_group`). The wait cannot hang, however the GPU schedules the
programs: every main item was taken before any floor item, by a program that has started and waits on nothing.
Under the interpreter the programs run one after another and no floor item waits at all. The floor stays spread
over as many programs as in its own pass (one program flooring a whole clip would serialise it); a floor item waits
only while its clip's last tiles run, alongside them at small batches, and after every main item has started at
large ones. The counters (`counters`) are left at zero by the launch that used them: the last ticket resets the
ticket count, a clip's last floor item its clip's count."""

import functools

import torch
import triton
import triton.language as tl

from ..common.launch import Launch, kept_launcher, launch as run

STATS_CHUNK = 256  # tile statistics per step of the clip-maximum reduction (`clip_floor`)
FLOOR_TILES = 2  # frame tiles a floor program or floor item checks
FLOOR_BANDS = 128  # the most mel bands a floor step covers (all of them, up to large-v3's 128)


# The functions below take their index vectors (`tl.arange`s) from the caller, which gives them their layouts in the
# Gluon kernel (whose language needs one for every tensor it creates), and plain in the Triton kernels.


@triton.jit
def clip_floor(stats_ptr, clip, n_tiles, chunk):
    """hi - 8 for `clip`, hi being the max of its tile maxima (stats hold (max, min) per tile), len(chunk) tiles a
    step (chunk: 0, 1, ...)."""
    base = stats_ptr + clip.to(tl.int64) * n_tiles * 2
    hi = tl.cast(float("-inf"), tl.float32)
    for t0 in range(0, n_tiles, chunk.shape[0]):
        t = t0 + chunk
        hi = tl.maximum(hi, tl.max(tl.load(base + 2 * t, mask=t < n_tiles, other=float("-inf"))))
    return hi - 8.0


@triton.jit
def floor_tiles(out_ptr, stats_ptr, clip, first, F, NM, n_tiles, frames_of_tile, bands_of_step, chunk,
                FLOOR_TILES: tl.constexpr):
    """out = max(out, (floor + 4) / 4) on `clip`'s tiles first .. first + FLOOR_TILES (of len(frames_of_tile) frames)
    whose minimum lies below the clip's floor, len(bands_of_step) bands a step, writing only the values below it
    (NaN stays NaN); rounding to the output dtype is monotone, so flooring the rounded value equals rounding the
    floored one."""
    floor = clip_floor(stats_ptr, clip, n_tiles, chunk)
    floor_out = ((floor + 4.0) * 0.25).to(out_ptr.dtype.element_ty)
    stats = stats_ptr + clip.to(tl.int64) * n_tiles * 2
    base = out_ptr + clip.to(tl.int64) * NM * F
    for tile in range(first, tl.minimum(first + FLOOR_TILES, n_tiles)):
        if tl.load(stats + 2 * tile + 1) < floor:
            frames = tile * frames_of_tile.shape[0] + frames_of_tile
            for m0 in range(0, NM, bands_of_step.shape[0]):
                bands = m0 + bands_of_step
                ptrs = base + bands[:, None] * F + frames[None, :]
                ok = (bands < NM)[:, None] & (frames < F)[None, :]
                x = tl.load(ptrs, mask=ok)
                tl.store(ptrs, floor_out, mask=ok & (x < floor_out))


@triton.jit
def _floor_kernel(out_ptr, stats_ptr, F, NM, n_tiles, n_groups, BLOCK_F: tl.constexpr, BLOCK_M: tl.constexpr,
                  STATS_CHUNK: tl.constexpr, FLOOR_TILES: tl.constexpr):
    """One program per (clip, group of FLOOR_TILES frame tiles of BLOCK_F frames), `floor_tiles` on them."""
    pid = tl.program_id(0)
    floor_tiles(out_ptr, stats_ptr, pid // n_groups, (pid % n_groups) * FLOOR_TILES, F, NM, n_tiles,
                tl.arange(0, BLOCK_F), tl.arange(0, BLOCK_M), tl.arange(0, STATS_CHUNK), FLOOR_TILES)


@triton.jit
def take_item(counters_ptr, n_items):
    """The program's item of a folded launch of n_items programs: its ticket, in the order programs start (so every
    lower item belongs to a program that has started). The last ticket leaves the ticket count at zero."""
    item = tl.atomic_add(counters_ptr, 1, sem="relaxed")
    if item == n_items - 1:
        tl.atomic_xchg(counters_ptr, 0, sem="relaxed")
    return item


@triton.jit
def count_tile(counters_ptr, clip):
    """A main item's last step: its clip's count takes the tile, after every thread's stores of its output and
    statistics (the barrier, then a release)."""
    tl.debug_barrier()
    tl.atomic_add(counters_ptr + 1 + clip, 1, sem="release")


@triton.jit
def floor_group(out_ptr, stats_ptr, counters_ptr, group, F, NM, n_tiles, n_groups, frames_of_tile, bands_of_step,
                chunk, FLOOR_TILES: tl.constexpr):
    """Floor item `group` (clip-major) of a folded launch: wait (acquire) until its clip's count holds all n_tiles
    tiles, `floor_tiles` on its group, then count itself out; the clip's last floor item leaves the count at zero."""
    clip = group // n_groups
    count = counters_ptr + 1 + clip
    seen = tl.atomic_add(count, 0, sem="acquire")
    while seen < n_tiles:
        seen = tl.atomic_add(count, 0, sem="acquire")
    floor_tiles(out_ptr, stats_ptr, clip, (group % n_groups) * FLOOR_TILES, F, NM, n_tiles, frames_of_tile,
                bands_of_step, chunk, FLOOR_TILES)
    if tl.atomic_add(count, 1, sem="relaxed") == n_tiles + n_groups - 1:
        tl.atomic_xchg(count, 0, sem="relaxed")


def groups(n_tiles: int) -> int:
    """Floor programs, or floor items of a folded launch, a clip of n_tiles tiles takes."""
    return triton.cdiv(n_tiles, FLOOR_TILES)


def folded_meta(NM: int) -> dict:
    """The meta-parameters of a main pass's folded floor items at NM bands: FLOOR_M bands a step, STATS_CHUNK,
    FLOOR_TILES."""
    return dict(FLOOR_M=_floor_bands(NM), STATS_CHUNK=STATS_CHUNK, FLOOR_TILES=FLOOR_TILES)


def counters(device: torch.device, B: int) -> torch.Tensor:
    """Zeros for a folded launch of B clips on `device`: the ticket count, then each clip's count ((1 + B,) int32 or
    longer). An eager CUDA call takes the buffer kept for its stream, which every launch leaves at zero (launches on
    one stream run in order; two streams hold two buffers); a call under CUDA graph capture, on the CPU (the
    interpreter) or on meta tensors takes fresh zeros, under capture a fill node of its graph, so that no two
    graphs share counters."""
    if device.type != "cuda" or torch._C._cuda_isCurrentStreamCapturing():
        return torch.zeros(1 + B, dtype=torch.int32, device=device)
    key = (device.index, torch._C._cuda_getCurrentRawStream(device.index))  # torch's C calls: per-call host time
    kept = _kept_counters.get(key)
    if kept is None or kept.numel() < 1 + B:
        kept = _kept_counters[key] = torch.zeros(triton.next_power_of_2(1 + B), dtype=torch.int32, device=device)
    return kept


# The counters of eager folded launches by (CUDA device, stream): see `counters`.
_kept_counters: dict = {}


def launch(out: torch.Tensor, stats: torch.Tensor, block_f: int) -> None:
    """The floor pass in place on out (B, NM, F), from the main pass's statistics (B, n_tiles, 2) of its tiles of
    block_f frames."""
    B, NM, F = out.shape
    run(_plan(B, NM, F, stats.shape[1], block_f), (out, stats))


def kept_launch(B: int, NM: int, F: int, n_tiles: int, block_f: int, device: torch.device, out_dtype: torch.dtype):
    """`launch` for every call of B clips of NM bands, F frames and n_tiles tiles of block_f frames on `device` with
    out of `out_dtype`, once it ran on such a call: a function (out, stats) that launches the kept kernel; None where
    no launcher is kept."""
    return kept_launcher(_plan(B, NM, F, n_tiles, block_f), device.index, (out_dtype, torch.float32))


@functools.cache
def _plan(B: int, NM: int, F: int, n_tiles: int, block_f: int) -> Launch:
    """The floor pass's launch for a call shape, built once."""
    n_groups = groups(n_tiles)
    meta = dict(BLOCK_F=block_f, BLOCK_M=_floor_bands(NM), STATS_CHUNK=STATS_CHUNK, FLOOR_TILES=FLOOR_TILES)
    return Launch(_floor_kernel, B * n_groups, (F, NM, n_tiles, n_groups), meta, 4, "floor")


def _floor_bands(NM: int) -> int:
    """Bands a floor step covers: all NM, rounded up to a power of two, up to FLOOR_BANDS."""
    return min(triton.next_power_of_2(NM), FLOOR_BANDS)
