"""The tap-loop design of the LDSA window op: plain float32 multiply-adds, one window tap at a time.

A forward program owns one (b, h), BLOCK_T consecutive frames and BLOCK_D channels. It takes the
window's log-sum-exp per frame from the logits rows (two light passes over W rows of BLOCK_T), then for
each tap k (W and LEFT are compile-time constants)

    acc[d, t] += exp(a_logits[k, t] - lse[t]) * v[d, t - LEFT + k]

with the value tile loaded at a shift of k - LEFT frames. The shifted tiles overlap, so beyond the first
they come from L1/L2 and each value is read from HBM about once. No tensor cores, no shared-memory
gathers: the cost is W float32 FMAs and W (partly vectorized) loads per output element.

The taps run in groups of TAP_GROUP (8 forward, 4 backward): a runtime loop over groups, unrolled within
a group. Unrolling lets a group's loads issue together; a full unroll would have all W tiles' loads in
flight and run out of registers. With k = TAP_GROUP * group + j, the shift's alignment (its power-of-two
part, up to TAP_GROUP elements) is still known at compile time, so the loads keep the vector width it
allows. Taps past W (the last group's tail) are masked off.

The backward needs the weights of the frames that read a value position, t + LEFT - k for tap k, which
lie outside the program's own frames; a first kernel writes every frame's log-sum-exp (4 bytes a frame)
so the main kernel can load them shifted like the values. Its program owns one (b, h) and BLOCK_T frames,
walks all channels in tiles, and per tap forms

    da[k, t]  = sum_d grad_out[d, t] * v[d, t - LEFT + k]          (kept as a [BLOCK_W, BLOCK_T] tile)
    dv[d, t] += a[k, t + LEFT - k] * grad_out[d, t + LEFT - k]      (the transposed window)

then applies the softmax Jacobian to da for dlogits.

T arrives with a compile-time power-of-two divisor (T_ALIGN), rebuilt as (T // T_ALIGN) * T_ALIGN so the
compiler knows that row starts d * T and the `< T` masks keep the loads' vector width (Triton only learns
divisibility by 16 from an argument on its own, and T = 3000 is not).
"""

import triton
import triton.language as tl


@triton.jit
def _aligned(T, T_ALIGN: tl.constexpr):
    """T, with its known divisor visible to the compiler's alignment analysis."""
    return (T // T_ALIGN) * T_ALIGN


@triton.jit
def _frame_lse(a_base, t, t_ok, T, W: tl.constexpr):
    """Log-sum-exp of each frame's window logits, float32 (two passes over the W rows: max, then sum)."""
    m = tl.full(t.shape, float("-inf"), tl.float32)
    for k in tl.static_range(W):
        m = tl.maximum(m, tl.load(a_base + k * T + t, mask=t_ok, other=0.0).to(tl.float32))
    total = tl.zeros(t.shape, tl.float32)
    for k in tl.static_range(W):
        total += tl.exp(tl.load(a_base + k * T + t, mask=t_ok, other=0.0).to(tl.float32) - m)
    return m + tl.log(total)


@triton.jit
def _taps_forward_kernel(
    a_ptr, v_ptr, out_ptr, T, Dh, n_ttiles, n_dtiles,
    W: tl.constexpr, LEFT: tl.constexpr, T_ALIGN: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
    TAP_GROUP: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    t_tile = pid % n_ttiles
    d_tile = (pid // n_ttiles) % n_dtiles
    bh = (pid // (n_ttiles * n_dtiles)).to(tl.int64)  # int64: B*H*Dh*T may pass 2^31
    T = _aligned(T, T_ALIGN)
    a_base = a_ptr + bh * W * T
    v_base = v_ptr + bh * Dh * T
    out_base = out_ptr + bh * Dh * T

    t = t_tile * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = t < T
    d = d_tile * BLOCK_D + tl.arange(0, BLOCK_D)
    rows = d[:, None] * T
    d_ok = d[:, None] < Dh
    lse = _frame_lse(a_base, t, t_ok, T, W)

    acc = tl.zeros([BLOCK_D, BLOCK_T], dtype=tl.float32)
    for group in range(tl.cdiv(W, TAP_GROUP)):
        for j in tl.static_range(TAP_GROUP):
            k = group * TAP_GROUP + j
            weight = tl.exp(tl.load(a_base + k * T + t, mask=t_ok & (k < W), other=0.0).to(tl.float32) - lse)
            s = t + (k - LEFT)  # the value position frame t reads through tap k
            s_ok = (s >= 0) & (s < T) & (k < W)
            vals = tl.load(v_base + rows + s[None, :], mask=d_ok & s_ok[None, :], other=0.0)
            acc += weight[None, :] * vals.to(tl.float32)
    tl.store(out_base + rows + t[None, :], acc.to(out_ptr.dtype.element_ty), mask=d_ok & t_ok[None, :])


@triton.jit
def _taps_lse_kernel(a_ptr, lse_ptr, T, n_ttiles, W: tl.constexpr, T_ALIGN: tl.constexpr, BLOCK_T: tl.constexpr):
    """lse[bh, t]: every frame's window log-sum-exp, for the backward's shifted weights."""
    pid = tl.program_id(0)
    bh = (pid // n_ttiles).to(tl.int64)
    T = _aligned(T, T_ALIGN)
    t = (pid % n_ttiles) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = t < T
    tl.store(lse_ptr + bh * T + t, _frame_lse(a_ptr + bh * W * T, t, t_ok, T, W), mask=t_ok)


@triton.jit
def _taps_backward_kernel(
    a_ptr, v_ptr, go_ptr, lse_ptr, dlogits_ptr, dv_ptr, T, Dh, n_ttiles,
    W: tl.constexpr, LEFT: tl.constexpr, T_ALIGN: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_W: tl.constexpr, D_TILES: tl.constexpr, TAP_GROUP: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    bh = (pid // n_ttiles).to(tl.int64)
    T = _aligned(T, T_ALIGN)
    a_base = a_ptr + bh * W * T
    lse_base = lse_ptr + bh * T
    v_base = v_ptr + bh * Dh * T
    go_base = go_ptr + bh * Dh * T
    dv_base = dv_ptr + bh * Dh * T

    t = (pid % n_ttiles) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = t < T
    taps = tl.arange(0, BLOCK_W)[:, None]
    da = tl.zeros([BLOCK_W, BLOCK_T], dtype=tl.float32)
    for d_tile in range(D_TILES):  # a runtime loop: unrolled, two tiles' loads interleave and spill
        d = d_tile * BLOCK_D + tl.arange(0, BLOCK_D)
        rows = d[:, None] * T
        d_ok = d[:, None] < Dh
        g = tl.load(go_base + rows + t[None, :], mask=d_ok & t_ok[None, :], other=0.0).to(tl.float32)
        dv = tl.zeros([BLOCK_D, BLOCK_T], dtype=tl.float32)
        for group in range(tl.cdiv(W, TAP_GROUP)):
            for j in tl.static_range(TAP_GROUP):
                k = group * TAP_GROUP + j
                s = t + (k - LEFT)  # value read by frame t through tap k
                s_ok = (s >= 0) & (s < T) & (k < W)
                vals = tl.load(v_base + rows + s[None, :], mask=d_ok & s_ok[None, :], other=0.0)
                da += tl.where(taps == k, tl.sum(g * vals.to(tl.float32), 0)[None, :], 0.0)
                u = t + (LEFT - k)  # frame that reads value t through tap k
                u_ok = (u >= 0) & (u < T) & (k < W)
                # Masked frames (outside [0, T) or past the window) load zero grad_out: their weight adds nothing.
                weight = tl.exp(
                    tl.load(a_base + k * T + u, mask=u_ok, other=0.0).to(tl.float32)
                    - tl.load(lse_base + u, mask=u_ok, other=0.0)
                )
                g_u = tl.load(go_base + rows + u[None, :], mask=d_ok & u_ok[None, :], other=0.0)
                dv += weight[None, :] * g_u.to(tl.float32)
        tl.store(dv_base + rows + t[None, :], dv.to(dv_ptr.dtype.element_ty), mask=d_ok & t_ok[None, :])

    tile_ok = (taps < W) & t_ok[None, :]
    logits = tl.load(a_base + taps * T + t[None, :], mask=tile_ok, other=0.0).to(tl.float32)
    lse = tl.load(lse_base + t, mask=t_ok, other=0.0)
    weights = tl.where(taps < W, tl.exp(logits - lse[None, :]), 0.0)
    dlogits = weights * (da - tl.sum(weights * da, 0)[None, :])
    tl.store(dlogits_ptr + bh * W * T + taps * T + t[None, :], dlogits.to(dlogits_ptr.dtype.element_ty), mask=tile_ok)
