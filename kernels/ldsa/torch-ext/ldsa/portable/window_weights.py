"""The window weights of a frame and the operand splits of the tensor-core products, shared by the Triton kernels
(`band`, `hopper.band_tma`) and the Gluon kernels (`hopper.band_forward`, `hopper.band_backward`), whose Gluon code
calls these Triton functions: the softmax over the window and its split into high and low halves in a 16-bit dtype
(the TF32 split of float32 operands is `common.tf32.tf32_high`)."""

import triton
import triton.language as tl


@triton.jit
def window_softmax(logits, tap_ok, axis: tl.constexpr):
    """Softmax over the window axis in float32; padded taps (tap_ok false) get weight 0.

    exp2, and the normalization as a product with 1 / sum taken as rsqrt(sum^2): one hardware approximation
    (about 2e-7 relative; the sum lies in [1, W], its largest term being 1), where the IEEE division and even
    the 2-ulp div.full cost about ten instructions a weight in range handling."""
    x = tl.where(tap_ok, logits.to(tl.float32), float("-inf"))
    e = tl.exp2((x - tl.expand_dims(tl.max(x, axis), axis)) * 1.4426950408889634)
    total = tl.sum(e, axis)
    return e * tl.expand_dims(tl.math.rsqrt(total * total), axis)


@triton.jit
def split_hi_lo(w, dtype: tl.constexpr):
    """float32 w as hi + lo in the 16-bit `dtype`, lo the residual of the first rounding (about 16 bits of
    w's mantissa together)."""
    hi = w.to(dtype)
    return hi, (w - hi.to(tl.float32)).to(dtype)


@triton.jit
def hi_lo_pairs(w, dtype: tl.constexpr):
    """`split_hi_lo` of w packed into one int32 word an element (hi in the low half), so that the TMA
    forward skews both halves into the band with one gather and splits only the [BLOCK_W, N] weights rather
    than the larger [K, N] band."""
    hi, lo = split_hi_lo(w, dtype)
    return (hi.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF) | (lo.to(tl.int16, bitcast=True).to(tl.int32) << 16)
