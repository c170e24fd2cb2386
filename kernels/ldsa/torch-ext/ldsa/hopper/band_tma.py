"""The band kernels fed by the tensor memory accelerator on a persistent, pipelined grid (band-tma, Hopper): their
tiles (`tiles`, None for a call TMA cannot take), their grid and their launches. The band products of
`portable.band`, their tiles copied into shared memory by TMA while the previous chunk is computed. The forward's
value spans start `lead` >= left positions before their chunk, the backward's second span `lead_right` >= right,
both multiples of 8 (TMA's 16-byte column offsets)."""

import functools

import torch
import triton
import triton.language as tl

from ..portable.band import pow2, round_up
from ..portable.band import tiles as band_tiles
from ..common.launch import Launch, sm_count
from ..portable.products import dot_float32_weights, dot_hi_lo_pairs, dot_values
from ..portable.window_weights import hi_lo_pairs, window_softmax

# Persistent programs an SM, and pipeline depth (chunks in flight a program, the one computed included): the
# best measured on the H200. Deeper pipelines leave shared memory for fewer programs: 4 forward programs of
# 3 stages, or 3 backward programs (five tiles a stage) of 3 stages, do not fit an SM.
PROGRAMS_PER_SM = {"forward": 3, "backward": 3}
STAGES = {"forward": 3, "backward": 2}


@triton.jit
def _band_operand(weights, gather_tap, dtype: tl.constexpr):
    """The band [K, N] that gather_tap skews out of the window weights [BLOCK_W, N], as the product with
    values of `dtype` takes it: float32 weights, or `hi_lo_pairs` words for 16-bit values."""
    if dtype == tl.float32:
        band = tl.gather(weights, gather_tap, 0)
    else:
        band = tl.gather(hi_lo_pairs(weights, dtype), gather_tap, 0)
    return band


@triton.jit
def _band_product(vals, band):
    """vals [BLOCK_D, K] @ a `_band_operand` band [K, N]."""
    if vals.dtype == tl.float32:
        product = dot_float32_weights(vals, band, True)
    else:
        product = dot_hi_lo_pairs(vals, band)
    return product


@triton.jit
def _band_forward_tma_kernel(
    a_desc, v_desc, out_desc, W, left, lead, n_chunks, all_chunks,
    N: tl.constexpr, K: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_D: tl.constexpr, PARTS: tl.constexpr,
    STAGES: tl.constexpr,
):  # fmt: skip
    """The band forward fed by the tensor memory accelerator, on a persistent grid.

    The descriptors view a_logits as [B*H*W, T] and v, out as [B*H*Dh, T] (Dh = BLOCK_D). Each program walks
    chunks i = pid, pid + programs, ... of all (b, h, chunk) in one pipelined loop, so its STAGES - 1 next
    chunks' logits and values are in flight (copied to shared memory by TMA, no registers held) while it
    computes one; the copy engine zero-fills what lies outside the tensor (values before 0 or past T, the
    last head's padded taps), which is what the band needs. A value span starts `lead` >= left positions
    before its chunk, a multiple of 8: TMA faults on the H200 at column offsets that are not multiples of
    16 bytes.

    A chunk is PARTS parts of N frames, each with its own value span and band product, that share the
    logits load, the softmax and the gather, which spreads the per-chunk pipeline and loop work over more
    frames. The band's out-of-band positions read tap row BLOCK_W - 1 >= W, whose weight is 0."""
    taps = tl.arange(0, BLOCK_W)
    frames = tl.arange(0, PARTS * N) % N  # a frame's place in its part
    span = tl.arange(0, K)
    tap_ok = taps[:, None] < W  # rows past W are the next head's taps (or zero fill): weight 0
    band_tap = span[:, None] - frames[None, :] - (lead - left)
    gather_tap = tl.where((band_tap >= 0) & (band_tap < W), band_tap, BLOCK_W - 1)
    for i in tl.range(tl.program_id(0), all_chunks, tl.num_programs(0), num_stages=STAGES):
        bh = i // n_chunks
        t0 = (i % n_chunks) * (PARTS * N)
        weights = window_softmax(a_desc.load([bh * W, t0]), tap_ok, 0)  # [BLOCK_W, PARTS * N]
        vals = v_desc.load([bh * BLOCK_D, t0 - lead])
        if PARTS == 1:
            out = _band_product(vals, _band_operand(weights, gather_tap, vals.dtype))
            out_desc.store([bh * BLOCK_D, t0], out.to(out_desc.dtype))
        else:
            tl.static_assert(vals.dtype != tl.float32, "two-part chunks take 16-bit values")
            vals_second = v_desc.load([bh * BLOCK_D, t0 + N - lead])
            band = _band_operand(weights, gather_tap, vals.dtype)  # [K, 2N]: both parts' bands
            band_first, band_second = tl.split(tl.permute(tl.reshape(band, [K, 2, N]), (0, 2, 1)))
            # One [BLOCK_D, 2N] store for both parts, faster than a store each.
            out = tl.join(_band_product(vals, band_first), _band_product(vals_second, band_second))
            out = tl.reshape(tl.permute(out, (0, 2, 1)), [BLOCK_D, 2 * N])
            out_desc.store([bh * BLOCK_D, t0], out.to(out_desc.dtype))



@triton.jit
def _band_backward_tma_kernel(
    a_n, a_k, v_k, g_k, g_n, dv_n, dlogits_ptr, T, W, left, lead, lead_right, n_chunks, all_chunks,
    N: tl.constexpr, K: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_D: tl.constexpr, STAGES: tl.constexpr,
):  # fmt: skip
    """The backward of `portable.band._band_backward_kernel` (one channel tile) fed by TMA on a persistent grid, as the
    TMA forward. Descriptors over a_logits ([B*H*W, T]: blocks of N and K frames), v ([B*H*Dh, T]: K
    positions), grad_out (K and N positions) and dv (N); dlogits is stored through a pointer, since a block
    of BLOCK_W rows would overwrite the next head's taps."""
    right = W - 1 - left
    taps = tl.arange(0, BLOCK_W)
    frames = tl.arange(0, N)
    span = tl.arange(0, K)
    tap_ok = taps[:, None] < W
    tap_ok_u = taps[None, :] < W
    da_row = tl.minimum(frames[None, :] + taps[:, None] + (lead - left), K - 1)  # as in _band_backward_kernel
    dv_tap = frames[None, :] - span[:, None] + (lead_right - right) + (W - 1)
    in_band = (dv_tap >= 0) & (dv_tap < W)
    dv_tap = tl.minimum(tl.maximum(dv_tap, 0), BLOCK_W - 1)
    for i in tl.range(tl.program_id(0), all_chunks, tl.num_programs(0), num_stages=STAGES):
        bh = i // n_chunks
        t0 = (i % n_chunks) * N
        weights = window_softmax(a_n.load([bh * W, t0]), tap_ok, 0)  # [BLOCK_W, N]
        # Frames t0 - lead_right + j, whose windows read the chunk's values; outside [0, T) their logits are
        # zero-filled and their grad_out too, so they add nothing.
        weights_u = window_softmax(tl.trans(a_k.load([bh * W, t0 - lead_right])), tap_ok_u, 1)  # [K, BLOCK_W]
        band_t = tl.where(in_band, tl.gather(weights_u, dv_tap, 1), 0.0)  # [K, N]
        dv = dot_float32_weights(g_k.load([bh * BLOCK_D, t0 - lead_right]), band_t, False)
        dv_n.store([bh * BLOCK_D, t0], dv.to(dv_n.dtype))
        vals_t = tl.trans(v_k.load([bh * BLOCK_D, t0 - lead]))  # [K, Dh]
        da = tl.gather(dot_values(vals_t, g_n.load([bh * BLOCK_D, t0])), da_row, 0)  # [BLOCK_W, N]
        dlogits = weights * (da - tl.sum(weights * da, 0)[None, :])
        t = t0 + frames
        rows = (bh * W + taps).to(tl.int64) * T
        tl.store(dlogits_ptr + rows[:, None] + t[None, :], dlogits.to(dlogits_ptr.dtype.element_ty),
                 mask=tap_ok & (t[None, :] < T))


# ---- Tiles, grid and launches ----


@functools.cache
def tiles(
    direction: str, W: int, left: int, Dh: int, T: int, BH: int, dtype: torch.dtype
) -> tuple[int, int, int, int] | None:
    """(N frames per chunk, K span positions, lead, lead_right) of the `direction` TMA kernel for values of
    `dtype`, or None where it cannot take the call.

    TMA reads rows whose byte stride is a multiple of 16 (T a multiple of 8, for every dtype) at int32
    coordinates, from column offsets that are multiples of 16 bytes: spans start at multiples of 8 frames,
    `lead` (left rounded up to 8) before the chunk for the values its frames read, `lead_right` (right rounded
    up) before it for the frames that read its values, so K >= N + W - 1 plus the larger rounding. Chunks are
    32 frames with K = 64, the fastest on the H200; windows too wide for that take 64 and 128, wider ones none.
    One channel tile: Dh a power of two from 16 (the MMA's least rows) to 128.

    Shared memory (227 KB a program) bounds each direction further. The forward's value tiles stay within
    32 KB (three stages of float32 values at Dh = K = 128 would not fit). The backward holds five tiles a stage,
    so it takes K = 64, Dh <= 64 and only 16-bit values: float32 ones run slower than band with TF32 products
    and spill registers with IEEE ones."""
    right = W - 1 - left
    lead, lead_right = round_up(left, 8), round_up(right, 8)
    if T % 8 or Dh not in (16, 32, 64, 128) or BH * max(Dh, pow2(W)) >= 2**31:
        return None
    fitting = [(N, K) for N, K in ((32, 64), (64, 128)) if N + W - 1 + max(lead - left, lead_right - right) <= K]
    if not fitting:
        return None
    N, K = fitting[0]
    if direction == "forward" and Dh * K * dtype.itemsize > 32768:
        return None
    if direction == "backward" and (K > 64 or Dh > 64 or dtype == torch.float32):
        return None
    return N, K, lead, lead_right


def _grid(
    direction: str, N: int, K: int, W: int, Dh: int, T: int, BH: int, dtype: torch.dtype, device: int
) -> tuple:  # fmt: skip
    """(programs, (chunks a head, all chunks), meta-parameters, num_warps) of a TMA kernel with N-frame parts
    and K-position spans: a persistent grid of PROGRAMS_PER_SM programs an SM, or one a chunk when there
    are fewer chunks.

    The forward's chunks are two parts where the tiles are N = 32, K = 64 with Dh <= 64 and 16-bit values
    (larger value tiles, two a stage, would leave shared memory for one program an SM), one part otherwise;
    its logits tiles have a row of zero weight past the window (BLOCK_W > W) for the band's out-of-band
    positions. The backward's chunks are one part, its logits tiles the band kernels'."""
    if direction == "forward":
        parts = 2 if (N, K) == (32, 64) and Dh <= 64 and dtype != torch.float32 else 1
        meta = dict(N=N, K=K, BLOCK_W=max(8, pow2(W + 1)), BLOCK_D=Dh, PARTS=parts)
    else:
        parts = 1
        meta = dict(N=N, K=K, BLOCK_W=band_tiles(W)[2], BLOCK_D=Dh)
    n_chunks = triton.cdiv(T, parts * N)
    programs = min(BH * n_chunks, sm_count(device) * PROGRAMS_PER_SM[direction])
    meta["STAGES"] = STAGES[direction]
    return programs, (n_chunks, BH * n_chunks), meta, 4 if K * N <= 2048 else 8


def launch_forward(tiles: tuple, W: int, left: int, Dh: int, T: int, BH: int, dtype: torch.dtype, device: int,
                   config: str, fast_path: str) -> Launch:  # fmt: skip
    """The forward's launch on the call's `tiles` and `_grid`: descriptors of a_logits as [B*H*W, T] (a chunk's taps
    and frames a box) and of v and out as [B*H*Dh, T] (a span, a chunk)."""
    N, K, lead, _ = tiles
    programs, ints, meta, num_warps = _grid("forward", N, K, W, Dh, T, BH, dtype, device)
    rows, values = (BH * W, T), (BH * Dh, T)
    chunk = meta["PARTS"] * N
    arguments = ((0, rows, (meta["BLOCK_W"], chunk)), (1, values, (Dh, K)), (2, values, (Dh, chunk)))
    return Launch(_band_forward_tma_kernel, programs, (W, left, lead, *ints), meta, num_warps, config, arguments,
                  fast_path)


def launch_backward(tiles: tuple, W: int, left: int, Dh: int, T: int, BH: int, dtype: torch.dtype, device: int,
                    config: str, fast_path: str) -> Launch:  # fmt: skip
    """The backward's launch, as `launch_forward`: a_logits 0, values 1, grad_out 2, dlogits 3 (a pointer), dv 4."""
    N, K, lead, lead_right = tiles
    programs, ints, meta, num_warps = _grid("backward", N, K, W, Dh, T, BH, dtype, device)
    rows, values, block_w = (BH * W, T), (BH * Dh, T), meta["BLOCK_W"]
    arguments = ((0, rows, (block_w, N)), (0, rows, (block_w, K)), (1, values, (Dh, K)), (2, values, (Dh, K)),
                 (2, values, (Dh, N)), (4, values, (Dh, N)), 3)  # fmt: skip
    return Launch(_band_backward_tma_kernel, programs, (T, W, left, lead, lead_right, *ints), meta, num_warps,
                  config, arguments, fast_path)  # fmt: skip
