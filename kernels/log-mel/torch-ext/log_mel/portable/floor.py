"""The floor pass of `whisper_log_mel`, shared by its Triton and Gluon main passes: each clip's 80 dB floor from
the main pass's per-tile statistics (`clip_floor`, which the STFT path's floor takes too), applied in place on the
(B, NM, F) features only on the tiles it reaches."""

import functools

import torch
import triton
import triton.language as tl

from ..common.launch import Launch, launch as run

STATS_CHUNK = 256  # tile statistics per step of the clip-maximum reduction (`clip_floor`)
FLOOR_TILES = 2  # frame tiles a floor-pass program checks
FLOOR_BANDS = 128  # the most mel bands a floor-pass step covers (all of them, up to large-v3's 128)


@triton.jit
def clip_floor(stats_ptr, clip, n_tiles, CHUNK: tl.constexpr):
    """hi - 8 for `clip`, hi being the max of its tile maxima (stats hold (max, min) per tile)."""
    base = stats_ptr + clip.to(tl.int64) * n_tiles * 2
    hi = tl.full((), float("-inf"), tl.float32)
    for t0 in range(0, n_tiles, CHUNK):
        t = t0 + tl.arange(0, CHUNK)
        hi = tl.maximum(hi, tl.max(tl.load(base + 2 * t, mask=t < n_tiles, other=float("-inf"))))
    return hi - 8.0


@triton.jit
def _floor_kernel(out_ptr, stats_ptr, F, NM, n_tiles, n_groups, BLOCK_F: tl.constexpr,
                  BLOCK_M: tl.constexpr, STATS_CHUNK: tl.constexpr, FLOOR_TILES: tl.constexpr):
    """One program per (clip, group of FLOOR_TILES frame tiles): out = max(out, (floor + 4) / 4) on
    the tiles whose minimum lies below the clip's floor, writing only the values below it (NaN stays NaN);
    rounding to the output dtype is monotone, so flooring the rounded value equals rounding the floored one."""
    pid = tl.program_id(0)
    clip = pid // n_groups
    first = (pid % n_groups) * FLOOR_TILES
    floor = clip_floor(stats_ptr, clip, n_tiles, STATS_CHUNK)
    floor_out = ((floor + 4.0) * 0.25).to(out_ptr.dtype.element_ty)
    stats = stats_ptr + clip.to(tl.int64) * n_tiles * 2
    base = out_ptr + clip.to(tl.int64) * NM * F
    for tile in range(first, tl.minimum(first + FLOOR_TILES, n_tiles)):
        if tl.load(stats + 2 * tile + 1) < floor:
            frames = tile * BLOCK_F + tl.arange(0, BLOCK_F)
            for m0 in range(0, NM, BLOCK_M):
                bands = m0 + tl.arange(0, BLOCK_M)
                ptrs = base + bands[:, None] * F + frames[None, :]
                ok = (bands < NM)[:, None] & (frames < F)[None, :]
                x = tl.load(ptrs, mask=ok)
                tl.store(ptrs, floor_out, mask=ok & (x < floor_out))


def launch(out: torch.Tensor, stats: torch.Tensor, block_f: int) -> None:
    """The floor pass in place on out (B, NM, F), from the main pass's statistics (B, n_tiles, 2) of its tiles of
    block_f frames."""
    B, NM, F = out.shape
    run(_plan(B, NM, F, stats.shape[1], block_f), (out, stats))


@functools.cache
def _plan(B: int, NM: int, F: int, n_tiles: int, block_f: int) -> Launch:
    """The floor pass's launch for a call shape, built once."""
    n_groups = triton.cdiv(n_tiles, FLOOR_TILES)
    meta = dict(BLOCK_F=block_f, BLOCK_M=min(triton.next_power_of_2(NM), FLOOR_BANDS), STATS_CHUNK=STATS_CHUNK,
                FLOOR_TILES=FLOOR_TILES)
    return Launch(_floor_kernel, B * n_groups, (F, NM, n_tiles, n_groups), meta, 4, "floor")
