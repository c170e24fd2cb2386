"""Fused Triton forward and backward of the LDSA window op, and their launchers.

The op is a banded matrix product per (b, h): out[:, t] = sum_s v[:, s] * Y[s, t], where the band Y holds
the window softmax, Y[t - left + k, t] = a[k, t]. A program owns one (b, h) and a run of frames, walked in
chunks of N frames. For a chunk it loads the logits [W, N] and takes the window softmax in float32 registers,
skews the weights into the band tile [K, N] (K >= N + W - 1 span positions) with `tl.gather`, and multiplies
the value span [Dh, K] by it on the tensor cores. The halo K - N comes from L1/L2, so each v element comes
from HBM about once; a tap-by-tap loop would read it W times through L1 and stay far below the copy bandwidth.
Weights stay float32-accurate: 16-bit values take them as a high and a low part in the values' dtype
(`_dot_hi_lo`), float32 values three TF32 products of split operands (`_dot_3xtf32`), except in the backward's
V^T G product (IEEE, `_dot_values`).

The backward is one kernel on the same grid. For the chunk's frames it forms V^T G on the span, gathers
da[k, t] from its band and applies the softmax Jacobian; for the chunk's value positions it recomputes the
weights of the frames whose windows reach them and forms dv = G Y^T like the forward. Each input is read
from HBM about once and each gradient written once: the minimal bytes.

Large calls take the same band products fed by the tensor memory accelerator on a persistent, pipelined grid
(band-tma: `_ldsa_forward_tma_kernel`, and `_ldsa_backward_tma_kernel` for 16-bit values); on Hopper, windows
of up to 15 taps take the Gluon kernels instead (band-gluon: `ldsa_gluon`, `ldsa_gluon_backward`). The
launchers pick a configuration per call from a fixed table (no autotuning: a shape's first call costs one
compile) and skip Triton's per-call argument binding.
"""

import contextlib
import functools
import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.compiler.compiler import CompiledKernel
from triton.tools.tensor_descriptor import TensorDescriptor

from .dispatch import FAST_PATHS
from .common.fast_paths import falls_back
from .common.tf32 import tf32_high
from .window_weights import _hi_lo_pairs, _split_hi_lo, _window_softmax

try:  # Gluon, Triton's explicit-layout dialect (its Hopper TMA and mma.sync): band-gluon
    from . import ldsa_gluon, ldsa_gluon_backward
except ImportError:  # a Triton without it: the other configurations
    ldsa_gluon = ldsa_gluon_backward = None

# Frames per program: at most this many (faster than 256 or 512 in both dtypes), to amortize the per-program
# setup over several chunks ...
FRAMES_PER_PROGRAM = 128
# ... but fewer when the grid would drop below this many programs (about 8 per SM on an H200's 132), so
# that small, launch-bound shapes run their chunks side by side rather than one after another.
MIN_PROGRAMS = 1024


@triton.jit
def _aligned(T, T_ALIGN: tl.constexpr):
    """T, with its known divisor T_ALIGN visible to the compiler's alignment analysis: Triton vectorizes
    loads and stores only where it can prove the row starts aligned."""
    return (T // T_ALIGN) * T_ALIGN


@triton.jit
def _dot_float32_weights(x, w, FORWARD: tl.constexpr):
    """x @ w for values x (input dtype) and float32 weights w, products as accurate as in float32, in the
    forward's way or the backward's (FORWARD).

    Tensor-core operands share one dtype, so 16-bit values take w as hi + lo in that dtype (`_split_hi_lo`);
    the forward multiplies both in one MMA (`_dot_hi_lo`), the backward in two: one MMA gives wrong gradients
    at 21 and 113 taps on Triton 3.6's Hopper backend. Float32 values take three TF32 products (`_dot_3xtf32`),
    which are faster than IEEE products in the backward too."""
    if x.dtype == tl.float32:
        product = _dot_3xtf32(x, w)
    else:
        hi, lo = _split_hi_lo(w, x.dtype)
        if FORWARD:
            product = _dot_hi_lo(x, hi, lo)
        else:
            product = tl.dot(x, lo, tl.dot(x, hi))
    return product


@triton.jit
def _dot_3xtf32(x, y):
    """x @ y for float32 x and y, about 1e-7 relative, by three TF32 tensor-core products: each operand split in
    a TF32 high part (`tf32_high`) and a residual, the residuals' product left out (one TF32 product would lose
    13 bits). Several times faster than IEEE products on the CUDA cores, and `tf32_high`'s split is cheaper
    than Triton's tf32x3."""
    x_hi, y_hi = tf32_high(x), tf32_high(y)
    product = tl.dot(x - x_hi, y_hi, input_precision="tf32")
    product = tl.dot(x_hi, y - y_hi, product, input_precision="tf32")
    return tl.dot(x_hi, y_hi, product, input_precision="tf32")


@triton.jit
def _dot_hi_lo_pairs(x, pairs):
    """x @ (hi + lo) for 16-bit x and a [K, N] tile of `_hi_lo_pairs` words, float32 result [M, N]."""
    hi, lo = pairs.to(tl.int16), (pairs >> 16).to(tl.int16)
    return _dot_hi_lo(x, hi.to(x.dtype, bitcast=True), lo.to(x.dtype, bitcast=True))


@triton.jit
def _dot_hi_lo(x, hi, lo):
    """x @ (hi + lo) for 16-bit x and [K, N] halves hi, lo in x's dtype, float32 result [M, N].

    hi and lo are interleaved as the columns of one [K, 2N] operand, so that one MMA reads x once for both
    and the two products of a column are neighbours in the result (a thread's pair in the accumulator);
    faster than two MMAs."""
    K: tl.constexpr = hi.shape[0]
    N: tl.constexpr = hi.shape[1]
    both = tl.dot(x, tl.reshape(tl.join(hi, lo), [K, 2 * N]))
    from_hi, from_lo = tl.split(tl.reshape(both, [x.shape[0], N, 2]))
    return from_hi + from_lo


@triton.jit
def _dot_values(x, y):
    """x @ y of two value-dtype tiles with a float32 result, for the backward: exact products for bf16/fp16, IEEE
    for float32. Three TF32 products (`_dot_3xtf32`) here give a wrong float32 backward at 113 taps and an illegal
    memory access on the H200."""
    if x.dtype == tl.float32:
        return tl.dot(x, y, input_precision="ieee")
    else:
        return tl.dot(x, y)


@triton.jit
def _load_logits(a_rows, t0, frames, ok, T):
    """[BLOCK_W, N] logits of frames t0 .. t0 + N (rows a_rows are the taps); zero where not ok or past T."""
    t = t0 + frames
    return tl.load(a_rows + t[None, :], mask=ok & (t[None, :] < T), other=0.0)


@triton.jit
def _load_span(v_base, row, ok, s, T):
    """[BLOCK_D, K] values at positions s of the channel rows `row`; zero where not ok or outside [0, T)."""
    return tl.load(v_base + row + s[None, :], mask=ok & (s[None, :] >= 0) & (s[None, :] < T), other=0.0)


@triton.jit
def _band_weights(logits, tap_ok, band_tap, in_band):
    """The chunk's [K, N] band tile: the window softmax of `logits`, skewed so row j feeds frame i by tap j - i."""
    weights = _window_softmax(logits, tap_ok, 0)  # [BLOCK_W, N]
    return tl.where(in_band, tl.gather(weights, band_tap, 0), 0.0)


@triton.jit
def _ldsa_forward_kernel(
    a_ptr, v_ptr, out_ptr,
    T, Dh, W, left, lead, n_ttiles,
    N: tl.constexpr, K: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_D: tl.constexpr,
    D_TILES: tl.constexpr, CHUNKS: tl.constexpr, T_ALIGN: tl.constexpr, SPAN_ALIGN: tl.constexpr,
    PREFETCH: tl.constexpr,
):  # fmt: skip
    T = _aligned(T, T_ALIGN)
    lead = _aligned(lead, SPAN_ALIGN)
    pid = tl.program_id(0)
    bh = (pid // n_ttiles).to(tl.int64)  # int64: B*H*Dh*T may pass 2^31
    first_frame = (pid % n_ttiles) * (CHUNKS * N)
    a_base = a_ptr + bh * W * T
    v_base = v_ptr + bh * Dh * T
    out_base = out_ptr + bh * Dh * T

    taps = tl.arange(0, BLOCK_W)
    frames = tl.arange(0, N)
    span = tl.arange(0, K)
    tap_ok = taps[:, None] < W
    a_rows = a_base + taps.to(tl.int64)[:, None] * T
    # Band tile [K, N]: span position j (value index t0 - lead + j) feeds frame i (t0 + i) by tap
    # j - i - (lead - left).
    band_tap = span[:, None] - frames[None, :] - (lead - left)
    in_band = (band_tap >= 0) & (band_tap < W)
    gather_tap = tl.minimum(tl.maximum(band_tap, 0), BLOCK_W - 1)

    if PREFETCH:
        # One channel tile (D_TILES == 1): the next chunk's logits (with the gather) and values are loaded
        # before this chunk is computed, so their latency overlaps the softmax, the gather and the MMAs.
        d = tl.arange(0, BLOCK_D)
        d_ok = d[:, None] < Dh
        row = d.to(tl.int64)[:, None] * T
        logits_next = _load_logits(a_rows, first_frame, frames, tap_ok, T)
        vals_next = _load_span(v_base, row, d_ok, first_frame - lead + span, T)
        for c in range(CHUNKS):
            t0 = first_frame + c * N
            t = t0 + frames
            vals = vals_next
            more = c + 1 < CHUNKS
            vals_next = _load_span(v_base, row, d_ok & more, t0 + N - lead + span, T)
            logits = logits_next
            logits_next = _load_logits(a_rows, t0 + N, frames, tap_ok & more, T)
            band = _band_weights(logits, tap_ok, gather_tap, in_band)
            out = _dot_float32_weights(vals, band, True)  # [BLOCK_D, N]
            tl.store(out_base + row + t[None, :], out.to(out_ptr.dtype.element_ty), mask=d_ok & (t[None, :] < T))
    else:
        for c in range(CHUNKS):
            t0 = first_frame + c * N
            t = t0 + frames
            band = _band_weights(_load_logits(a_rows, t0, frames, tap_ok, T), tap_ok, gather_tap, in_band)
            for dt in tl.static_range(D_TILES):
                d = dt * BLOCK_D + tl.arange(0, BLOCK_D)
                d_ok = d[:, None] < Dh
                row = d.to(tl.int64)[:, None] * T
                vals = _load_span(v_base, row, d_ok, t0 - lead + span, T)
                out = _dot_float32_weights(vals, band, True)  # [BLOCK_D, N]
                tl.store(out_base + row + t[None, :], out.to(out_ptr.dtype.element_ty), mask=d_ok & (t[None, :] < T))


@triton.jit
def _band_operand(weights, gather_tap, dtype: tl.constexpr):
    """The band [K, N] that gather_tap skews out of the window weights [BLOCK_W, N], as the product with
    values of `dtype` takes it: float32 weights, or `_hi_lo_pairs` words for 16-bit values."""
    if dtype == tl.float32:
        band = tl.gather(weights, gather_tap, 0)
    else:
        band = tl.gather(_hi_lo_pairs(weights, dtype), gather_tap, 0)
    return band


@triton.jit
def _band_product(vals, band):
    """vals [BLOCK_D, K] @ a `_band_operand` band [K, N]."""
    if vals.dtype == tl.float32:
        product = _dot_float32_weights(vals, band, True)
    else:
        product = _dot_hi_lo_pairs(vals, band)
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
        weights = _window_softmax(a_desc.load([bh * W, t0]), tap_ok, 0)  # [BLOCK_W, PARTS * N]
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
def _ldsa_backward_kernel(
    a_ptr, v_ptr, go_ptr, dlogits_ptr, dv_ptr,
    T, Dh, W, left, lead, lead_right, n_ttiles,
    N: tl.constexpr, K: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_D: tl.constexpr,
    D_TILES: tl.constexpr, CHUNKS: tl.constexpr, T_ALIGN: tl.constexpr, SPAN_ALIGN: tl.constexpr,
):  # fmt: skip
    T = _aligned(T, T_ALIGN)
    lead = _aligned(lead, SPAN_ALIGN)
    lead_right = _aligned(lead_right, SPAN_ALIGN)
    pid = tl.program_id(0)
    bh = (pid // n_ttiles).to(tl.int64)
    first_frame = (pid % n_ttiles) * (CHUNKS * N)
    right = W - 1 - left
    a_base = a_ptr + bh * W * T
    dl_base = dlogits_ptr + bh * W * T
    v_base = v_ptr + bh * Dh * T
    go_base = go_ptr + bh * Dh * T
    dv_base = dv_ptr + bh * Dh * T

    taps = tl.arange(0, BLOCK_W)
    frames = tl.arange(0, N)
    span = tl.arange(0, K)
    tap_row = taps.to(tl.int64) * T
    tap_ok = taps[:, None] < W
    # da: tap k of frame i read value index t0 - left + i + k, row i + k + (lead - left) of the [K, N]
    # tile V^T G.
    da_row = tl.minimum(frames[None, :] + taps[:, None] + (lead - left), K - 1)  # [BLOCK_W, N]
    # dv: the value at t0 + i is read by frame u = t0 - lead_right + j through tap
    # i - j + (lead_right - right) + W - 1.
    dv_tap = frames[None, :] - span[:, None] + (lead_right - right) + (W - 1)  # [K, N]
    in_band = (dv_tap >= 0) & (dv_tap < W)
    dv_tap = tl.minimum(tl.maximum(dv_tap, 0), BLOCK_W - 1)

    for c in range(CHUNKS):
        t0 = first_frame + c * N
        t = t0 + frames  # this chunk's frames, and the value positions whose dv it writes
        s = t0 - lead + span  # value positions read by the chunk's frames
        u = t0 - lead_right + span  # frames whose windows read the chunk's value positions
        t_ok = t[None, :] < T
        s_ok = (s[:, None] >= 0) & (s[:, None] < T)  # [K, 1]
        u_ok = (u >= 0) & (u < T)  # [K]

        logits = tl.load(a_base + tap_row[:, None] + t[None, :], mask=tap_ok & t_ok, other=0.0)
        weights = _window_softmax(logits, tap_ok, 0)  # [BLOCK_W, N]
        tap_ok_u = taps[None, :] < W
        logits_u = tl.load(a_base + tap_row[None, :] + u[:, None], mask=tap_ok_u & u_ok[:, None], other=0.0)
        weights_u = _window_softmax(logits_u, tap_ok_u, 1)  # [K, BLOCK_W]
        band_t = tl.where(in_band, tl.gather(weights_u, dv_tap, 1), 0.0)  # [K, N]: Y^T on this chunk

        vg = tl.zeros([K, N], dtype=tl.float32)
        for dt in tl.static_range(D_TILES):
            d = dt * BLOCK_D + tl.arange(0, BLOCK_D)
            d_ok = d < Dh
            row = d.to(tl.int64) * T
            # Grad-out outside [0, T) is zero, so frames past the ends add nothing to dv.
            g_u = tl.load(go_base + row[:, None] + u[None, :], mask=d_ok[:, None] & u_ok[None, :], other=0.0)
            dv = _dot_float32_weights(g_u, band_t, False)  # [BLOCK_D, N]
            tl.store(dv_base + row[:, None] + t[None, :], dv.to(dv_ptr.dtype.element_ty), mask=d_ok[:, None] & t_ok)
            vals_t = tl.load(v_base + row[None, :] + s[:, None], mask=d_ok[None, :] & s_ok, other=0.0)
            g_t = tl.load(go_base + row[:, None] + t[None, :], mask=d_ok[:, None] & t_ok, other=0.0)
            vg += _dot_values(vals_t, g_t)  # [K, N]: sum_d v[d, s_j] g[d, t_i]

        da = tl.gather(vg, da_row, 0)  # [BLOCK_W, N]
        dlogits = weights * (da - tl.sum(weights * da, 0)[None, :])
        tl.store(dl_base + tap_row[:, None] + t[None, :], dlogits.to(dlogits_ptr.dtype.element_ty), mask=tap_ok & t_ok)


@triton.jit
def _ldsa_backward_tma_kernel(
    a_n, a_k, v_k, g_k, g_n, dv_n, dlogits_ptr, T, W, left, lead, lead_right, n_chunks, all_chunks,
    N: tl.constexpr, K: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_D: tl.constexpr, STAGES: tl.constexpr,
):  # fmt: skip
    """The backward of `_ldsa_backward_kernel` (one channel tile) fed by TMA on a persistent grid, as the
    TMA forward. Descriptors over a_logits ([B*H*W, T]: blocks of N and K frames), v ([B*H*Dh, T]: K
    positions), grad_out (K and N positions) and dv (N); dlogits is stored through a pointer, since a block
    of BLOCK_W rows would overwrite the next head's taps."""
    right = W - 1 - left
    taps = tl.arange(0, BLOCK_W)
    frames = tl.arange(0, N)
    span = tl.arange(0, K)
    tap_ok = taps[:, None] < W
    tap_ok_u = taps[None, :] < W
    da_row = tl.minimum(frames[None, :] + taps[:, None] + (lead - left), K - 1)  # as in _ldsa_backward_kernel
    dv_tap = frames[None, :] - span[:, None] + (lead_right - right) + (W - 1)
    in_band = (dv_tap >= 0) & (dv_tap < W)
    dv_tap = tl.minimum(tl.maximum(dv_tap, 0), BLOCK_W - 1)
    for i in tl.range(tl.program_id(0), all_chunks, tl.num_programs(0), num_stages=STAGES):
        bh = i // n_chunks
        t0 = (i % n_chunks) * N
        weights = _window_softmax(a_n.load([bh * W, t0]), tap_ok, 0)  # [BLOCK_W, N]
        # Frames t0 - lead_right + j, whose windows read the chunk's values; outside [0, T) their logits are
        # zero-filled and their grad_out too, so they add nothing.
        weights_u = _window_softmax(tl.trans(a_k.load([bh * W, t0 - lead_right])), tap_ok_u, 1)  # [K, BLOCK_W]
        band_t = tl.where(in_band, tl.gather(weights_u, dv_tap, 1), 0.0)  # [K, N]
        dv = _dot_float32_weights(g_k.load([bh * BLOCK_D, t0 - lead_right]), band_t, False)
        dv_n.store([bh * BLOCK_D, t0], dv.to(dv_n.dtype))
        vals_t = tl.trans(v_k.load([bh * BLOCK_D, t0 - lead]))  # [K, Dh]
        da = tl.gather(_dot_values(vals_t, g_n.load([bh * BLOCK_D, t0])), da_row, 0)  # [BLOCK_W, N]
        dlogits = weights * (da - tl.sum(weights * da, 0)[None, :])
        t = t0 + frames
        rows = (bh * W + taps).to(tl.int64) * T
        tl.store(dlogits_ptr + rows[:, None] + t[None, :], dlogits.to(dlogits_ptr.dtype.element_ty),
                 mask=tap_ok & (t[None, :] < T))


def _pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


# The backward gathers from a [K, BLOCK_W] float32 tile through shared memory; 128 x 128 (64 KiB) is the
# largest it takes. That admits every window up to W = 113 taps; wider windows run the eager reference.
MAX_GATHER_TILE = 128 * 128


@functools.cache
def _band(W: int) -> tuple[int, int, int]:
    """(N frames per chunk, K band rows, BLOCK_W padded taps) for a window of W taps.

    N is the smallest power of two >= W - 1 in [16, 64], so the band K >= N + W - 1 wastes at most about
    half of the MMA; N shrinks while the [K, N] band tile would pass 8192 elements or the backward's
    [K, BLOCK_W] gather tile would pass MAX_GATHER_TILE. BLOCK_W is at least 8: logits tiles of 2 or 4 rows
    (W = 2 to 4) fail Triton 3.6's thread-locality pass for sm_90 in the band kernels and the TMA forward."""
    block_w = max(8, _pow2(W))
    N = min(max(16, _pow2(W - 1)), 64)
    K = _pow2(N + W - 1)
    while N > 16 and (K * N > 8192 or K * block_w > MAX_GATHER_TILE):
        N //= 2
        K = _pow2(N + W - 1)
    return N, K, block_w


@functools.cache
def supports_window(W: int) -> bool:
    """Windows of 2 to 113 taps. A one-tap window (its softmax is 1, the op a copy) fails its float64 check
    on the H200, forward and backward, while passing in the interpreter, so it runs the reference."""
    _, K, block_w = _band(W)
    return W >= 2 and K * block_w <= MAX_GATHER_TILE


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


@functools.cache
def _span_leads(W: int, left: int, T: int, itemsize: int) -> tuple[int, int, int]:
    """(SPAN_ALIGN, lead, lead_right): a chunk's value span starts `lead` >= left positions before its first
    frame (the backward's second span, of the frames reading the chunk's values, `lead_right` >= right),
    rounded up to SPAN_ALIGN so that every row of a span is whole aligned vectors. Triton vectorizes only
    what it can prove aligned: spans starting at t0 - left compile to a 2-byte load per bf16 value and a
    2-byte store per output, aligned ones to pipelined 16-byte cp.async loads. SPAN_ALIGN is the largest power
    of two up to 16 bytes that divides T and keeps the shifted band within the window's K rows."""
    N, K, _ = _band(W)
    right = W - 1 - left
    align = min(_t_align(T), 16 // itemsize)
    while align > 1 and N + W - 1 + max(_round_up(left, align) - left, _round_up(right, align) - right) > K:
        align //= 2
    return align, _round_up(left, align), _round_up(right, align)


@functools.cache
def _tma_tiles(
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
    lead, lead_right = _round_up(left, 8), _round_up(right, 8)
    if T % 8 or Dh not in (16, 32, 64, 128) or BH * max(Dh, _pow2(W)) >= 2**31:
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


@functools.cache
def _band_plan(W: int, left: int, Dh: int, T: int, BH: int, itemsize: int) -> tuple[int, tuple, dict, int]:
    """(programs per (b, h), the span leads, meta-parameters, num_warps) for W taps of which `left` before
    the frame, Dh channels, T frames, B*H sequences and values of `itemsize` bytes."""
    if not supports_window(W):
        raise ValueError(f"the band design does not take a {W}-tap window (see supports_window)")
    N, K, block_w = _band(W)
    span_align, *leads = _span_leads(W, left, T, itemsize)
    block_d = max(16, min(_pow2(Dh), 128, 16384 // K))  # a [BLOCK_D, K] value tile stays in registers
    all_chunks = BH * triton.cdiv(T, N)
    chunks = max(1, min(FRAMES_PER_PROGRAM // N, triton.cdiv(T, N), all_chunks // MIN_PROGRAMS))
    n_ttiles = triton.cdiv(T, chunks * N)
    num_warps = 4 if K * max(block_d, block_w, N) <= 4096 else 8
    meta = dict(N=N, K=K, BLOCK_W=block_w, BLOCK_D=block_d, D_TILES=triton.cdiv(Dh, block_d), CHUNKS=chunks,
                T_ALIGN=_t_align(T), SPAN_ALIGN=span_align)
    return n_ttiles, tuple(leads), meta, num_warps


# ---- Candidate configurations and the default table ----

BAND = "band"  # the banded tensor-core product above; its tiles follow from the window (`_band_plan`)
# The same forward with the next chunk's loads issued before the current chunk's compute (one channel tile
# only; with several it runs as "band"): the band forward waits on L1 loads.
BAND_PREFETCH = "band-prefetch"
# The band kernels with their tiles copied by the tensor memory accelerator (`_ldsa_forward_tma_kernel`,
# `_ldsa_backward_tma_kernel`) on a persistent grid. They take calls whose rows TMA can address
# (`_tma_tiles`); others run as band-prefetch (forward) and band (backward).
BAND_TMA = "band-tma"
# The forward in Gluon (`ldsa_gluon`) on Hopper, its band built in the MMA's registers: windows of up to 15 taps
# (`ldsa_gluon.takes`); the backward in Gluon (`ldsa_gluon_backward`), its bands read from skewed shared-memory
# views (`ldsa_gluon_backward.takes`). The calls they do not take run as band-tma (or band where it cannot).
BAND_GLUON = "band-gluon"
FORWARD_CONFIGS = (BAND, BAND_PREFETCH, BAND_TMA, BAND_GLUON)
BACKWARD_CONFIGS = (BAND, BAND_TMA, BAND_GLUON)

# The configuration a call takes below band-tma's reach (`default_config`): (pass, window of at most 32 taps,
# float32 values) -> config name. Wider windows keep the band design, whose tiles are sized for them.
# Prefetching the next chunk is faster for 16-bit forward windows up to 32 taps, measured on the H200 (though
# not for small causal calls). Float32 takes `band`: with TF32 products it beats band-prefetch.
DEFAULT_CONFIG = {
    ("forward", True, False): BAND_PREFETCH,
    ("forward", True, True): BAND,
    ("forward", False, False): BAND,
    ("forward", False, True): BAND,
    ("backward", True, False): BAND,
    ("backward", True, True): BAND,
    ("backward", False, False): BAND,
    ("backward", False, True): BAND,
}


# Calls that `_tma_tiles` takes run band-tma from this many frames (B * H * T) up (`_tma_by_default`).
# Below, calls are launch-bound, and band-tma's host time is longer: its tensor descriptors are encoded every
# call.
TMA_MIN_FRAMES = 1 << 18
# Persistent programs an SM, and pipeline depth (chunks in flight a program, the one computed included): the
# best measured on the H200. Deeper pipelines leave shared memory for fewer programs: 4 forward programs of
# 3 stages, or 3 backward programs (five tiles a stage) of 3 stages, do not fit an SM.
TMA_PROGRAMS_PER_SM = {"forward": 3, "backward": 3}
TMA_STAGES = {"forward": 3, "backward": 2}


def default_config(direction: str, W: int, dtype: torch.dtype, tma: bool = False) -> str:
    """The configuration a call takes; `tma`: band-tma takes the call by default (`_tma_by_default`)."""
    if tma:
        return BAND_TMA
    return DEFAULT_CONFIG[(direction, W <= 32, dtype == torch.float32)]


def _tma_by_default(tiles, Dh: int, dtype: torch.dtype, frames: int) -> bool:
    """Whether the default runs band-tma for a call of `frames` frames (B * H * T) whose TMA tiles are `tiles`
    (None where TMA cannot take it): from TMA_MIN_FRAMES frames up, and for float32 values only with value
    tiles of at most 16 KB, where it beats `band`. Larger float32 tiles leave shared memory for one program
    an SM."""
    if tiles is None or frames < TMA_MIN_FRAMES:
        return False
    return dtype != torch.float32 or Dh * tiles[1] * 4 <= 16384


def _t_align(T: int) -> int:
    """The largest power of two up to 16 dividing T: the kernels' T_ALIGN."""
    return min(16, T & -T)


# ---- Launching ----


class _Launch:
    """One kernel launch of a call shape: the kernel, its grid (programs), its integer arguments (they follow
    its tensor arguments), meta-parameters and warps. Built once per shape by the cached plan functions below
    and compared by identity, so the compiled-kernel cache keys on the object itself (and keeps it alive)."""

    __slots__ = ("kernel", "programs", "ints", "meta", "num_warps", "config", "arguments", "fast_path")

    def __init__(self, kernel, programs: int, ints: tuple, meta: dict, num_warps: int, config: str,
                 arguments: tuple | None = None, fast_path: str | None = None):  # fmt: skip
        self.kernel, self.programs, self.ints, self.meta, self.num_warps = kernel, programs, ints, meta, num_warps
        # The configuration that runs, and for a TMA kernel its tensor arguments: each the index of a tensor
        # handed to `_launch`, or (index, shape, block[, shared layout]) for a descriptor of that tensor viewed
        # as the row-major `shape`; for a fast path, its row in `dispatch.FAST_PATHS`.
        self.config, self.arguments, self.fast_path = config, arguments, fast_path


# Launchers of compiled kernels by (_Launch, device, each tensor's dtype and 16-byte alignment): see `_launch`.
_compiled: dict = {}


def _launch(launch: _Launch, tensors: tuple) -> bool:
    """launch.kernel[(launch.programs,)](*tensors, *launch.ints, **launch.meta, num_warps=launch.num_warps),
    minus Triton's per-call binding (host time that launch-bound calls cannot spare). False where a fast path's
    first launch of a specialization fails to compile: the path is then switched off (`FAST_PATHS.failed`) and
    the plans forgotten, so that `_run` plans the portable launch.

    The first launch of a specialization (the tensors' dtypes and 16-byte alignment; the _Launch fixes the
    integers) goes through the JIT and keeps its CompiledKernel; later ones call its launcher directly, the
    arguments in the kernel's parameter order. While a launch hook is registered (Triton's profiler) every
    launch takes the JIT path; under the interpreter nothing is kept. TMA descriptors hold the data pointers,
    so they are built each call: checked ones for the JIT, `_HostDescriptor`s for the launcher."""
    device = tensors[0].device.index
    key = (launch, device, *[(t.dtype, t.data_ptr() % 16 == 0) for t in tensors])
    hit = _compiled.get(key)
    fast = hit is not None and not triton.knobs.runtime.launch_enter_hook.calls
    if launch.arguments is not None:
        tensors = tuple(tensors[a] if type(a) is int else _descriptor(tensors[a[0]], *a[1:], checked=not fast)
                        for a in launch.arguments)
    if fast:
        run, function, metadata, stream_of, trailing = hit
        run(launch.programs, 1, 1, stream_of(device), function, metadata, None, None, None, *tensors, *trailing)
        return True
    try:
        compiled = launch.kernel[(launch.programs,)](*tensors, *launch.ints, **launch.meta, num_warps=launch.num_warps)
    except Exception as error:
        if launch.fast_path is None or not falls_back(error):
            raise
        FAST_PATHS.failed(launch.fast_path, error)
        _clear_plans()
        return False
    if isinstance(compiled, CompiledKernel):
        constexprs = tuple(launch.meta[name] for name in launch.kernel.arg_names[len(tensors) + len(launch.ints) :])
        stream_of = triton.runtime.driver.active.get_current_stream
        trailing = (*launch.ints, *constexprs)
        _compiled[key] = (compiled.run, compiled.function, compiled.packed_metadata, stream_of, trailing)
    return True


def _run(plan, tensors: tuple) -> None:
    """Launch `plan()`'s kernel on `tensors`, planning again after a fast path failed to compile (each failure
    switches one path off, and the portable launches are not caught, so this ends)."""
    while not _launch(plan(), tensors):
        pass


class _HostDescriptor(NamedTuple):
    """What a compiled kernel's launcher reads of a TMA descriptor argument, Triton's or Gluon's (the box and
    the layout are compiled in): from Triton 3.7 on it reads `round_f32_to_tf32` too."""

    base: torch.Tensor
    shape: tuple
    strides: tuple
    padding: str = "zero"
    round_f32_to_tf32: bool = False


@functools.cache
def _row_major_strides(shape: tuple) -> tuple:
    """The strides of a contiguous tensor of `shape` (computed once a shape: descriptors are built every call)."""
    return tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))


def _descriptor(x: torch.Tensor, shape: tuple, block: tuple, layout=None, checked: bool = True):
    """A TMA descriptor of the contiguous x viewed as the row-major `shape`, copied in `block` boxes: Triton's, or
    with a shared-memory `layout` Gluon's. Not `checked`: a `_HostDescriptor`, several times cheaper to build, for
    a launch whose specialization the JIT has already taken (band-gluon builds four a call forward, seven
    backward)."""
    strides = _row_major_strides(shape)
    if not checked:
        return _HostDescriptor(x, shape, strides)
    if layout is None:
        return TensorDescriptor(x, shape, strides, block)
    return ldsa_gluon.descriptor(x, shape, strides, block, layout)


_SAME_DEVICE = contextlib.nullcontext()


def _device_of(x: torch.Tensor):
    """Triton launches on the current CUDA device: switch to x's device when it is another one."""
    if x.is_cuda and x.device.index != torch.cuda.current_device():
        return torch.cuda.device(x.device)
    return _SAME_DEVICE


def _clear_plans() -> None:
    """Forget the cached plans and launches that depend on the tunables (DEFAULT_CONFIG, FRAMES_PER_PROGRAM,
    MIN_PROGRAMS, the TMA_ constants, ldsa_gluon's PROGRAMS_PER_SM and STAGES, ldsa_gluon_backward's
    PROGRAMS_PER_SM): for tests and benchmarks that change those."""
    for plan in (_band_plan, _forward_launch, _backward_launch):
        plan.cache_clear()
    _signature_launches.clear()


def _tma_plan(
    direction: str, N: int, K: int, W: int, Dh: int, T: int, BH: int, dtype: torch.dtype, device: int
) -> tuple:  # fmt: skip
    """(programs, (chunks a head, all chunks), meta-parameters, num_warps) of a TMA kernel with N-frame parts
    and K-position spans: a persistent grid of TMA_PROGRAMS_PER_SM programs an SM, or one a chunk when there
    are fewer chunks.

    The forward's chunks are two parts where the tiles are N = 32, K = 64 with Dh <= 64 and 16-bit values
    (larger value tiles, two a stage, would leave shared memory for one program an SM), one part otherwise;
    its logits tiles have a row of zero weight past the window (BLOCK_W > W) for the band's out-of-band
    positions. The backward's chunks are one part, its logits tiles the band kernels'."""
    if direction == "forward":
        parts = 2 if (N, K) == (32, 64) and Dh <= 64 and dtype != torch.float32 else 1
        meta = dict(N=N, K=K, BLOCK_W=max(8, _pow2(W + 1)), BLOCK_D=Dh, PARTS=parts)
    else:
        parts = 1
        meta = dict(N=N, K=K, BLOCK_W=_band(W)[2], BLOCK_D=Dh)
    n_chunks = triton.cdiv(T, parts * N)
    programs = min(BH * n_chunks, _sm_count(device) * TMA_PROGRAMS_PER_SM[direction])
    meta["STAGES"] = TMA_STAGES[direction]
    return programs, (n_chunks, BH * n_chunks), meta, 4 if K * N <= 2048 else 8


def _chosen_config(direction: str, config: str | None, W: int, dtype: torch.dtype, tma: bool) -> str:
    """`config`, checked against the direction's configurations, or the default's choice for the call
    (`tma`: `_tma_by_default`)."""
    configs = FORWARD_CONFIGS if direction == "forward" else BACKWARD_CONFIGS
    config = config or default_config(direction, W, dtype, tma)
    if config not in configs:
        raise ValueError(f"unknown {direction} config {config!r}; the configs are {configs}")
    return config


def _sm_count(device: int) -> int:
    """Multiprocessors of CUDA device `device` (one for -1, the interpreter's CPU tensors), for persistent grids."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device >= 0 else 1


def _gluon_lead(W: int, left: int, Dh: int, T: int, BH: int, dtype: torch.dtype) -> int | None:
    """band-gluon's span lead for a call its rule takes (`ldsa_gluon.takes`), else None: left rounded up to 8,
    TMA's 16-byte column offsets, as band-tma's (`_tma_tiles`)."""
    lead = _round_up(left, 8)
    return lead if ldsa_gluon is not None and ldsa_gluon.takes(W, lead - left, Dh, T, BH, dtype) else None


def _gluon_runs(direction: str, aligned: bool, logits_dtype: torch.dtype | None, dtype: torch.dtype,
                device: int) -> bool:  # fmt: skip
    """Whether band-gluon can run a call in `direction`, whatever its window: tensors on 16 bytes (TMA), logits in
    the values' dtype (None: the same), and CUDA device `device` where `dispatch.FAST_PATHS` runs it (not the
    interpreter, -1)."""
    return (aligned and logits_dtype in (None, dtype) and device >= 0
            and FAST_PATHS.runs(f"{BAND_GLUON} {direction}", torch.device("cuda", device)))


def _tma_runs(direction: str, aligned: bool, device: int) -> bool:
    """Whether band-tma can run a call in `direction`: tensors on 16 bytes and CUDA device `device` where
    `dispatch.FAST_PATHS` runs it, or the interpreter's CPU tensors and meta tensors (-1) while it is not switched
    off."""
    name = f"{BAND_TMA} {direction}"
    if device < 0:
        return aligned and name not in FAST_PATHS.switched_off
    return aligned and FAST_PATHS.runs(name, torch.device("cuda", device))


def _gluon_forward_launch(W: int, left: int, lead: int, Dh: int, T: int, BH: int, dtype: torch.dtype,
                          device: int) -> _Launch:  # fmt: skip
    """band-gluon's launch: a persistent grid of ldsa_gluon.PROGRAMS_PER_SM programs an SM for the dtype's size (one
    a chunk when there are fewer chunks)."""
    g = ldsa_gluon
    box, taps, halo = g.box_frames(dtype), g.TAPS.value, g.HALO.value
    n_chunks = triton.cdiv(T, g.CHUNK.value)
    programs = min(BH * n_chunks, _sm_count(device) * g.PROGRAMS_PER_SM[dtype.itemsize])
    rows, values = (BH * W, T), (BH * Dh, T)
    layouts = g.layouts(dtype, Dh)
    arguments = ((0, rows, (taps, box), layouts[0]), (1, values, (Dh, box), layouts[1]),
                 (1, values, (Dh, halo), layouts[2]), (2, values, (Dh, box), layouts[3]))
    return _Launch(g._ldsa_forward_gluon_kernel, programs, (W, left, lead, n_chunks, BH * n_chunks),
                   dict(DH=Dh, STAGES=g.STAGES), g.WARPS.value, BAND_GLUON, arguments, f"{BAND_GLUON} forward")


@functools.cache
def _forward_launch(
    config: str | None, W: int, left: int, Dh: int, T: int, BH: int, dtype: torch.dtype, aligned: bool, device: int,
    logits_dtype: torch.dtype | None = None,
) -> _Launch:
    """The forward's launch for values of `dtype` (logits of `logits_dtype`, None: the same), built once per shape
    since small calls are host-bound. `aligned`: every tensor starts on 16 bytes (TMA's condition); `device`: the
    CUDA device's index (-1 for the interpreter's CPU tensors). config None takes band-gluon for the calls it
    takes (`_gluon_runs`, `_gluon_lead`) from TMA_MIN_FRAMES frames up, else the default table's choice;
    band-gluon asked for runs as band-tma where it cannot.

    band-gluon: `_gluon_forward_launch`. band-tma: `_tma_plan`. The others: `_band_plan` plus the PREFETCH flag."""
    gluon_runs = _gluon_runs("forward", aligned, logits_dtype, dtype, device)
    gluon_lead = _gluon_lead(W, left, Dh, T, BH, dtype) if gluon_runs else None
    if config == BAND_GLUON or (config is None and gluon_lead is not None and BH * T >= TMA_MIN_FRAMES):
        if gluon_lead is not None:
            return _gluon_forward_launch(W, left, gluon_lead, Dh, T, BH, dtype, device)
        config = BAND_TMA
    tiles = _tma_tiles("forward", W, left, Dh, T, BH, dtype) if _tma_runs("forward", aligned, device) else None
    config = _chosen_config("forward", config, W, dtype, _tma_by_default(tiles, Dh, dtype, BH * T))
    if config == BAND_TMA and tiles is not None:
        N, K, lead, _ = tiles
        programs, ints, meta, num_warps = _tma_plan("forward", N, K, W, Dh, T, BH, dtype, device)
        rows, values = (BH * W, T), (BH * Dh, T)
        chunk = meta["PARTS"] * N
        arguments = ((0, rows, (meta["BLOCK_W"], chunk)), (1, values, (Dh, K)), (2, values, (Dh, chunk)))
        return _Launch(_ldsa_forward_tma_kernel, programs, (W, left, lead, *ints), meta, num_warps, config, arguments,
                       f"{BAND_TMA} forward")
    if config == BAND_TMA:
        config = BAND_PREFETCH
    n_ttiles, (lead, _), meta, num_warps = _band_plan(W, left, Dh, T, BH, dtype.itemsize)
    meta = dict(meta, PREFETCH=config == BAND_PREFETCH and meta["D_TILES"] == 1)
    return _Launch(_ldsa_forward_kernel, BH * n_ttiles, (T, Dh, W, left, lead, n_ttiles), meta, num_warps, config)


def _gluon_backward_launch(W: int, left: int, Dh: int, T: int, BH: int, dtype: torch.dtype, device: int) -> _Launch:
    """The Gluon backward's launch: a persistent grid of ldsa_gluon_backward.PROGRAMS_PER_SM programs an SM for the
    dtype's size (one a chunk when there are fewer chunks). Its logits descriptors view a_logits as [B*H, W, T]."""
    g = ldsa_gluon_backward
    chunk, halo, rows = ldsa_gluon.CHUNK.value, ldsa_gluon.HALO.value, g.ROWS.value
    frames = ldsa_gluon.box_frames(dtype)
    n_chunks = triton.cdiv(T, chunk)
    programs = min(BH * n_chunks, _sm_count(device) * g.PROGRAMS_PER_SM[dtype.itemsize])
    logits, values = (BH, W, T), (BH * Dh, T)
    tile, tile_halo, box, box_halo = g.layouts(dtype, Dh)
    # a_logits 0, values 1, grad_out 2, dlogits 3, dv 4
    arguments = ((0, logits, (1, rows, frames), tile), (0, logits, (1, rows, halo), tile_halo),
                 (1, values, (Dh, frames), box), (1, values, (Dh, halo), box_halo), (2, values, (Dh, frames), box),
                 (2, values, (Dh, halo), box_halo), (4, values, (Dh, frames), box), 3)
    ints = (T, W, left, _round_up(left, 8), _round_up(W - 1 - left, 8), n_chunks, BH * n_chunks)
    box_view, halo_view = g.p_operand_views(dtype, Dh)
    return _Launch(g._ldsa_backward_gluon_kernel, programs, ints, dict(DH=Dh, BOX_VIEW=box_view, HALO_VIEW=halo_view),
                   ldsa_gluon.WARPS.value, BAND_GLUON, arguments, f"{BAND_GLUON} backward")


@functools.cache
def _backward_launch(
    config: str | None, W: int, left: int, Dh: int, T: int, BH: int, dtype: torch.dtype, aligned: bool, device: int,
    logits_dtype: torch.dtype | None = None,
) -> _Launch:
    """The backward's launch for values (and grad_out) of `dtype` and logits of `logits_dtype` (None: the same), as
    `_forward_launch`: band-gluon for the calls `ldsa_gluon_backward.takes` on Hopper from TMA_MIN_FRAMES frames
    up (asked for elsewhere, it runs as band-tma, or band where that cannot), band-tma where `_tma_tiles` takes
    the call (band otherwise), band."""
    gluon = (_gluon_runs("backward", aligned, logits_dtype, dtype, device) and ldsa_gluon_backward is not None
             and ldsa_gluon_backward.takes(W, left, Dh, T, BH, dtype))
    if config == BAND_GLUON or (config is None and gluon and BH * T >= TMA_MIN_FRAMES):
        if gluon:
            return _gluon_backward_launch(W, left, Dh, T, BH, dtype, device)
        config = BAND_TMA
    tiles = _tma_tiles("backward", W, left, Dh, T, BH, dtype) if _tma_runs("backward", aligned, device) else None
    config = _chosen_config("backward", config, W, dtype, _tma_by_default(tiles, Dh, dtype, BH * T))
    if config == BAND_TMA and tiles is not None:
        N, K, lead, lead_right = tiles
        programs, ints, meta, num_warps = _tma_plan("backward", N, K, W, Dh, T, BH, dtype, device)
        rows, values, block_w = (BH * W, T), (BH * Dh, T), meta["BLOCK_W"]
        # a_logits 0, values 1, grad_out 2, dlogits 3, dv 4
        arguments = ((0, rows, (block_w, N)), (0, rows, (block_w, K)), (1, values, (Dh, K)), (2, values, (Dh, K)),
                     (2, values, (Dh, N)), (4, values, (Dh, N)), 3)  # fmt: skip
        return _Launch(_ldsa_backward_tma_kernel, programs, (T, W, left, lead, lead_right, *ints), meta, num_warps,
                       config, arguments, f"{BAND_TMA} backward")  # fmt: skip
    config = BAND
    n_ttiles, leads, meta, num_warps = _band_plan(W, left, Dh, T, BH, dtype.itemsize)
    return _Launch(_ldsa_backward_kernel, BH * n_ttiles, (T, Dh, W, left, *leads, n_ttiles), meta, num_warps, config)


def forward_launch(a_logits: torch.Tensor, v: torch.Tensor, left: int, right: int, config: str | None = None):
    """The launch `ldsa_forward` makes for these inputs (its `.config` names the configuration that runs).
    The output, a fresh allocation, starts on 16 bytes like every block of torch's allocators."""
    B, H, Dh, T = v.shape
    aligned = a_logits.data_ptr() % 16 == 0 and v.data_ptr() % 16 == 0
    return _forward_launch(config, left + right + 1, left, Dh, T, B * H, v.dtype, aligned, v.get_device(),
                           a_logits.dtype)


def backward_launch(a_logits, v, grad_out, left: int, right: int, config: str | None = None) -> _Launch:
    """The launch `ldsa_backward` makes for these inputs (v and grad_out of one dtype), as `forward_launch`."""
    B, H, Dh, T = v.shape
    aligned = a_logits.data_ptr() % 16 == 0 and v.data_ptr() % 16 == 0 and grad_out.data_ptr() % 16 == 0
    return _backward_launch(config, left + right + 1, left, Dh, T, B * H, v.dtype, aligned, v.get_device(),
                            a_logits.dtype)


def ldsa_forward(a_logits: torch.Tensor, v: torch.Tensor, left: int, right: int, config: str | None = None):
    """Fused forward on contiguous a_logits [B,H,W,T] and v [B,H,Dh,T] (validated by the caller).

    `config` names one of FORWARD_CONFIGS; None takes the default table's choice."""
    return _run_forward(lambda: forward_launch(a_logits, v, left, right, config), a_logits, v)


# The default forward launches of the public op's direct calls, by (call signature, inputs on 16 bytes): see
# `ldsa_forward_of_signature`. Bounded like the op's set of checked signatures.
_signature_launches: dict = {}
MAX_SIGNATURE_LAUNCHES = 8192


def ldsa_forward_of_signature(signature: tuple, a_logits: torch.Tensor, v: torch.Tensor, left: int, right: int):
    """`ldsa_forward` with the default launch, found by the public op's call signature (the shapes, dtypes and
    devices of both tensors and the window: everything `forward_launch` reads of a call but the alignment). The
    op has built the signature for its argument checks; one lookup by it and the alignment replaces
    `forward_launch`'s derivation of its cache key at about half the host time."""
    key = (signature, a_logits.data_ptr() % 16 == 0 and v.data_ptr() % 16 == 0)

    def plan() -> _Launch:
        launch = _signature_launches.get(key)
        if launch is None:
            if len(_signature_launches) >= MAX_SIGNATURE_LAUNCHES:
                _signature_launches.clear()
            launch = _signature_launches[key] = forward_launch(a_logits, v, left, right)
        return launch

    return _run_forward(plan, a_logits, v)


def _run_forward(plan, a_logits: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(v)
    with _device_of(v):
        _run(plan, (a_logits, v, out))
    return out


def ldsa_backward(
    a_logits: torch.Tensor, v: torch.Tensor, grad_out: torch.Tensor, left: int, right: int, config: str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused backward: (dlogits in a_logits' dtype, dv in v's dtype) from contiguous saved inputs.

    `config` names one of BACKWARD_CONFIGS; None takes the default table's choice. Autograd hands grad_out
    in v's dtype; with another dtype both run in float32 (exact upcasts, since the V^T G product needs one
    operand dtype)."""
    vals = v
    if grad_out.dtype != v.dtype:
        vals, grad_out = v.float(), grad_out.float()
    dlogits = torch.empty_like(a_logits)
    dv = torch.empty_like(v)
    with _device_of(v):
        _run(lambda: backward_launch(a_logits, vals, grad_out, left, right, config),
             (a_logits, vals, grad_out, dlogits, dv))
    return dlogits, dv
