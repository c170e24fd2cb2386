"""The portable band kernels of the LDSA window op, forward and backward, fed by pointer loads: their tiles, their
plan for a call and their launches.

The op is a banded matrix product per (b, h): out[:, t] = sum_s v[:, s] * Y[s, t], where the band Y holds
the window softmax, Y[t - left + k, t] = a[k, t]. A program owns one (b, h) and a run of frames, walked in
chunks of N frames. For a chunk it loads the logits [W, N] and takes the window softmax in float32 registers,
skews the weights into the band tile [K, N] (K >= N + W - 1 span positions) with `tl.gather`, and multiplies
the value span [Dh, K] by it on the tensor cores (`products`). The halo K - N comes from L1/L2, so each v element
comes from HBM about once; a tap-by-tap loop would read it W times through L1 and stay far below the copy
bandwidth.

The backward is one kernel on the same grid. For the chunk's frames it forms V^T G on the span, gathers
da[k, t] from its band and applies the softmax Jacobian; for the chunk's value positions it recomputes the
weights of the frames whose windows reach them and forms dv = G Y^T like the forward. Each input is read
from HBM about once and each gradient written once: the minimal bytes.

The tiles of a window (N, K, BLOCK_W: `tiles`) bound the windows the kernels take (`supports_window`); the plan of
a call (`plan`) adds the channel tile, the chunks a program and the value spans' alignment (`span_leads`).
"""

import functools

import torch
import triton
import triton.language as tl

from ..common.launch import Launch
from .products import dot_float32_weights, dot_values
from .window_weights import window_softmax


@triton.jit
def _aligned(T, T_ALIGN: tl.constexpr):
    """T, with its known divisor T_ALIGN visible to the compiler's alignment analysis: Triton vectorizes
    loads and stores only where it can prove the row starts aligned."""
    return (T // T_ALIGN) * T_ALIGN


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
    weights = window_softmax(logits, tap_ok, 0)  # [BLOCK_W, N]
    return tl.where(in_band, tl.gather(weights, band_tap, 0), 0.0)


@triton.jit
def _band_forward_kernel(
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
            out = dot_float32_weights(vals, band, True)  # [BLOCK_D, N]
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
                out = dot_float32_weights(vals, band, True)  # [BLOCK_D, N]
                tl.store(out_base + row + t[None, :], out.to(out_ptr.dtype.element_ty), mask=d_ok & (t[None, :] < T))


@triton.jit
def _band_backward_kernel(
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
        weights = window_softmax(logits, tap_ok, 0)  # [BLOCK_W, N]
        tap_ok_u = taps[None, :] < W
        logits_u = tl.load(a_base + tap_row[None, :] + u[:, None], mask=tap_ok_u & u_ok[:, None], other=0.0)
        weights_u = window_softmax(logits_u, tap_ok_u, 1)  # [K, BLOCK_W]
        band_t = tl.where(in_band, tl.gather(weights_u, dv_tap, 1), 0.0)  # [K, N]: Y^T on this chunk

        vg = tl.zeros([K, N], dtype=tl.float32)
        for dt in tl.static_range(D_TILES):
            d = dt * BLOCK_D + tl.arange(0, BLOCK_D)
            d_ok = d < Dh
            row = d.to(tl.int64) * T
            # Grad-out outside [0, T) is zero, so frames past the ends add nothing to dv.
            g_u = tl.load(go_base + row[:, None] + u[None, :], mask=d_ok[:, None] & u_ok[None, :], other=0.0)
            dv = dot_float32_weights(g_u, band_t, False)  # [BLOCK_D, N]
            tl.store(dv_base + row[:, None] + t[None, :], dv.to(dv_ptr.dtype.element_ty), mask=d_ok[:, None] & t_ok)
            vals_t = tl.load(v_base + row[None, :] + s[:, None], mask=d_ok[None, :] & s_ok, other=0.0)
            g_t = tl.load(go_base + row[:, None] + t[None, :], mask=d_ok[:, None] & t_ok, other=0.0)
            vg += dot_values(vals_t, g_t)  # [K, N]: sum_d v[d, s_j] g[d, t_i]

        da = tl.gather(vg, da_row, 0)  # [BLOCK_W, N]
        dlogits = weights * (da - tl.sum(weights * da, 0)[None, :])
        tl.store(dl_base + tap_row[:, None] + t[None, :], dlogits.to(dlogits_ptr.dtype.element_ty), mask=tap_ok & t_ok)


# ---- Tiles and plan ----

# Frames per program: at most this many (faster than 256 or 512 in both dtypes), to amortize the per-program setup
# over several chunks ...
FRAMES_PER_PROGRAM = 128
# ... but fewer when the grid would drop below this many programs (about 8 per SM on an H200's 132), so
# that small, launch-bound shapes run their chunks side by side rather than one after another.
MIN_PROGRAMS = 1024
# The backward gathers from a [K, BLOCK_W] float32 tile through shared memory; 128 x 128 (64 KiB) is the
# largest it takes. That admits every window up to W = 113 taps; wider windows run the eager reference.
MAX_GATHER_TILE = 128 * 128


def pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def t_align(T: int) -> int:
    """The largest power of two up to 16 dividing T: the kernels' T_ALIGN."""
    return min(16, T & -T)


@functools.cache
def tiles(W: int) -> tuple[int, int, int]:
    """(N frames per chunk, K band rows, BLOCK_W padded taps) for a window of W taps.

    N is the smallest power of two >= W - 1 in [16, 64], so the band K >= N + W - 1 wastes at most about
    half of the MMA; N shrinks while the [K, N] band tile would pass 8192 elements or the backward's
    [K, BLOCK_W] gather tile would pass MAX_GATHER_TILE. BLOCK_W is at least 8: logits tiles of 2 or 4 rows
    (W = 2 to 4) fail Triton 3.6's thread-locality pass for sm_90 in the band kernels and the TMA forward."""
    block_w = max(8, pow2(W))
    N = min(max(16, pow2(W - 1)), 64)
    K = pow2(N + W - 1)
    while N > 16 and (K * N > 8192 or K * block_w > MAX_GATHER_TILE):
        N //= 2
        K = pow2(N + W - 1)
    return N, K, block_w


@functools.cache
def supports_window(W: int) -> bool:
    """Windows of 2 to 113 taps. A one-tap window (its softmax is 1, the op a copy) fails its float64 check
    on the H200, forward and backward, while passing in the interpreter, so it runs the reference."""
    _, K, block_w = tiles(W)
    return W >= 2 and K * block_w <= MAX_GATHER_TILE


@functools.cache
def span_leads(W: int, left: int, T: int, itemsize: int) -> tuple[int, int, int]:
    """(SPAN_ALIGN, lead, lead_right): a chunk's value span starts `lead` >= left positions before its first
    frame (the backward's second span, of the frames reading the chunk's values, `lead_right` >= right),
    rounded up to SPAN_ALIGN so that every row of a span is whole aligned vectors. Triton vectorizes only
    what it can prove aligned: spans starting at t0 - left compile to a 2-byte load per bf16 value and a
    2-byte store per output, aligned ones to pipelined 16-byte cp.async loads. SPAN_ALIGN is the largest power
    of two up to 16 bytes that divides T and keeps the shifted band within the window's K rows."""
    N, K, _ = tiles(W)
    right = W - 1 - left
    align = min(t_align(T), 16 // itemsize)
    while align > 1 and N + W - 1 + max(round_up(left, align) - left, round_up(right, align) - right) > K:
        align //= 2
    return align, round_up(left, align), round_up(right, align)


@functools.cache
def plan(W: int, left: int, Dh: int, T: int, BH: int, itemsize: int) -> tuple[int, tuple, dict, int]:
    """(programs per (b, h), the span leads, meta-parameters, num_warps) for W taps of which `left` before
    the frame, Dh channels, T frames, B*H sequences and values of `itemsize` bytes."""
    if not supports_window(W):
        raise ValueError(f"the band design does not take a {W}-tap window (see supports_window)")
    N, K, block_w = tiles(W)
    span_align, *leads = span_leads(W, left, T, itemsize)
    block_d = max(16, min(pow2(Dh), 128, 16384 // K))  # a [BLOCK_D, K] value tile stays in registers
    all_chunks = BH * triton.cdiv(T, N)
    chunks = max(1, min(FRAMES_PER_PROGRAM // N, triton.cdiv(T, N), all_chunks // MIN_PROGRAMS))
    n_ttiles = triton.cdiv(T, chunks * N)
    num_warps = 4 if K * max(block_d, block_w, N) <= 4096 else 8
    meta = dict(N=N, K=K, BLOCK_W=block_w, BLOCK_D=block_d, D_TILES=triton.cdiv(Dh, block_d), CHUNKS=chunks,
                T_ALIGN=t_align(T), SPAN_ALIGN=span_align)
    return n_ttiles, tuple(leads), meta, num_warps


# ---- Launches ----


def launch_forward(W: int, left: int, Dh: int, T: int, BH: int, dtype: torch.dtype, prefetch: bool,
                   config: str) -> Launch:  # fmt: skip
    """The forward's launch on the call's `plan`: one program a (b, h) and run of frames; `prefetch` loads the next
    chunk ahead where there is one channel tile."""
    n_ttiles, (lead, _), meta, num_warps = plan(W, left, Dh, T, BH, dtype.itemsize)
    meta = dict(meta, PREFETCH=prefetch and meta["D_TILES"] == 1)
    return Launch(_band_forward_kernel, BH * n_ttiles, (T, Dh, W, left, lead, n_ttiles), meta, num_warps, config)


def launch_backward(W: int, left: int, Dh: int, T: int, BH: int, dtype: torch.dtype, config: str) -> Launch:
    """The backward's launch on the call's `plan`, the forward's grid."""
    n_ttiles, leads, meta, num_warps = plan(W, left, Dh, T, BH, dtype.itemsize)
    return Launch(_band_backward_kernel, BH * n_ttiles, (T, Dh, W, left, *leads, n_ttiles), meta, num_warps, config)
