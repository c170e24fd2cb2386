"""The band kernels fed by the tensor memory accelerator on a persistent, pipelined grid (band-tma, Hopper), and
their launches: the band products of `band`, their tiles copied into shared memory by TMA while the previous chunk
is computed. The forward's value spans start `lead` >= left positions before their chunk, the backward's second
span `lead_right` >= right, both multiples of 8 (TMA's 16-byte column offsets); the tiles and the grid are the
dispatcher's plan (`dispatch._tma_tiles`, `dispatch._tma_plan`)."""

import triton
import triton.language as tl

from .launch import Launch
from .products import dot_float32_weights, dot_hi_lo_pairs, dot_values
from .window_weights import hi_lo_pairs, window_softmax


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
def _ldsa_forward_tma_kernel(
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
def _ldsa_backward_tma_kernel(
    a_n, a_k, v_k, g_k, g_n, dv_n, dlogits_ptr, T, W, left, lead, lead_right, n_chunks, all_chunks,
    N: tl.constexpr, K: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_D: tl.constexpr, STAGES: tl.constexpr,
):  # fmt: skip
    """The backward of `band._ldsa_backward_kernel` (one channel tile) fed by TMA on a persistent grid, as the
    TMA forward. Descriptors over a_logits ([B*H*W, T]: blocks of N and K frames), v ([B*H*Dh, T]: K
    positions), grad_out (K and N positions) and dv (N); dlogits is stored through a pointer, since a block
    of BLOCK_W rows would overwrite the next head's taps."""
    right = W - 1 - left
    taps = tl.arange(0, BLOCK_W)
    frames = tl.arange(0, N)
    span = tl.arange(0, K)
    tap_ok = taps[:, None] < W
    tap_ok_u = taps[None, :] < W
    da_row = tl.minimum(frames[None, :] + taps[:, None] + (lead - left), K - 1)  # as in band._ldsa_backward_kernel
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


def forward_launch(tiles: tuple, plan: tuple, W: int, left: int, Dh: int, T: int, BH: int, config: str,
                   fast_path: str) -> Launch:  # fmt: skip
    """The forward's launch for the `dispatch._tma_tiles` `tiles` and `dispatch._tma_plan` `plan`: descriptors of
    a_logits as [B*H*W, T] (a chunk's taps and frames a box) and of v and out as [B*H*Dh, T] (a span, a chunk)."""
    N, K, lead, _ = tiles
    programs, ints, meta, num_warps = plan
    rows, values = (BH * W, T), (BH * Dh, T)
    chunk = meta["PARTS"] * N
    arguments = ((0, rows, (meta["BLOCK_W"], chunk)), (1, values, (Dh, K)), (2, values, (Dh, chunk)))
    return Launch(_ldsa_forward_tma_kernel, programs, (W, left, lead, *ints), meta, num_warps, config, arguments,
                  fast_path)


def backward_launch(tiles: tuple, plan: tuple, W: int, left: int, Dh: int, T: int, BH: int, config: str,
                    fast_path: str) -> Launch:  # fmt: skip
    """The backward's launch, as `forward_launch`: a_logits 0, values 1, grad_out 2, dlogits 3 (a pointer), dv 4."""
    N, K, lead, lead_right = tiles
    programs, ints, meta, num_warps = plan
    rows, values, block_w = (BH * W, T), (BH * Dh, T), meta["BLOCK_W"]
    arguments = ((0, rows, (block_w, N)), (0, rows, (block_w, K)), (1, values, (Dh, K)), (2, values, (Dh, K)),
                 (2, values, (Dh, N)), (4, values, (Dh, N)), 3)  # fmt: skip
    return Launch(_ldsa_backward_tma_kernel, programs, (T, W, left, lead, lead_right, *ints), meta, num_warps,
                  config, arguments, fast_path)  # fmt: skip
