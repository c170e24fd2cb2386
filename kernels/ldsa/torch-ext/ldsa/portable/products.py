"""The tensor-core products of the Triton band kernels (`band`, `hopper.band_tma`), as accurate as float32 products
whatever the values' dtype: 16-bit values take the float32 weights as a high and a low part in their dtype
(`dot_hi_lo`, or two MMAs in the backward), float32 values three TF32 products of split operands (`dot_3xtf32`),
except in the backward's V^T G product (IEEE, `dot_values`)."""

import triton
import triton.language as tl

from ..common.tf32 import tf32_high
from .window_weights import split_hi_lo


@triton.jit
def dot_float32_weights(x, w, FORWARD: tl.constexpr):
    """x @ w for values x (input dtype) and float32 weights w, products as accurate as in float32, in the
    forward's way or the backward's (FORWARD).

    Tensor-core operands share one dtype, so 16-bit values take w as hi + lo in that dtype (`split_hi_lo`);
    the forward multiplies both in one MMA (`dot_hi_lo`), the backward in two: one MMA gives wrong gradients
    at 21 and 113 taps on Triton 3.6's Hopper backend. Float32 values take three TF32 products (`dot_3xtf32`),
    which are faster than IEEE products in the backward too."""
    if x.dtype == tl.float32:
        product = dot_3xtf32(x, w)
    else:
        hi, lo = split_hi_lo(w, x.dtype)
        if FORWARD:
            product = dot_hi_lo(x, hi, lo)
        else:
            product = tl.dot(x, lo, tl.dot(x, hi))
    return product


@triton.jit
def dot_3xtf32(x, y):
    """x @ y for float32 x and y, about 1e-7 relative, by three TF32 tensor-core products: each operand split in
    a TF32 high part (`tf32_high`) and a residual, the residuals' product left out (one TF32 product would lose
    13 bits). Several times faster than IEEE products on the CUDA cores, and `tf32_high`'s split is cheaper
    than Triton's tf32x3."""
    x_hi, y_hi = tf32_high(x), tf32_high(y)
    product = tl.dot(x - x_hi, y_hi, input_precision="tf32")
    product = tl.dot(x_hi, y - y_hi, product, input_precision="tf32")
    return tl.dot(x_hi, y_hi, product, input_precision="tf32")


@triton.jit
def dot_hi_lo_pairs(x, pairs):
    """x @ (hi + lo) for 16-bit x and a [K, N] tile of `hi_lo_pairs` words, float32 result [M, N]."""
    hi, lo = pairs.to(tl.int16), (pairs >> 16).to(tl.int16)
    return dot_hi_lo(x, hi.to(x.dtype, bitcast=True), lo.to(x.dtype, bitcast=True))


@triton.jit
def dot_hi_lo(x, hi, lo):
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
def dot_values(x, y):
    """x @ y of two value-dtype tiles with a float32 result, for the backward: exact products for bf16/fp16, IEEE
    for float32. Three TF32 products (`dot_3xtf32`) here give a wrong float32 backward at 113 taps and an illegal
    memory access on the H200."""
    if x.dtype == tl.float32:
        return tl.dot(x, y, input_precision="ieee")
    else:
        return tl.dot(x, y)

