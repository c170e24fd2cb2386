"""What the Gluon band forward and backward (`band_forward`, `band_backward`) share: the chunk geometry, the TMA box
width, the dtypes they take, the 32-bit words the band is built of and the band products on mma.sync, as accurate as
float32 products."""

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from ..common.tf32 import tf32_high
from ..portable.window_weights import hi_lo_pairs

# Tile sizes, constexprs for the kernels (the host reads their .value).
CHUNK = gl.constexpr(64)  # frames a chunk (the logits, value and output tiles)
BLOCK = gl.constexpr(32)  # frames a block: a band product
HALO = gl.constexpr(16)  # span positions past the chunk, the last value box
WARPS = gl.constexpr(4)  # warps a program
# The value dtypes the kernels take, in Gluon's terms.
GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float32: gl.float32}


def box_frames(dtype: torch.dtype) -> int:
    """Frames a TMA box of logits, values or output: 128 bytes a row, the widest row of the 128-byte swizzle that
    the default shared-memory layout of these boxes takes."""
    return 128 // dtype.itemsize


@gluon.jit
def weight_words(w, dtype: gl.constexpr):
    """The float32 window weights w as the 32-bit words the band is built of: hi|lo pairs in a 16-bit `dtype`,
    float32's own bits."""
    if dtype == gl.float32:
        words = w.to(gl.int32, bitcast=True)
    else:
        words = hi_lo_pairs(w, dtype)
    return words


@gluon.jit
def precise_product(x, y, acc):
    """acc + x @ y as accurate as float32 products: one MMA for 16-bit operands (their products are exact);
    for float32 ones three TF32 MMAs of operands split into a TF32 high part and the residual (`tf32_high`;
    the residual's low bits fall to the MMA's truncation, 2^-21 relative)."""
    if x.dtype == gl.float32:
        x_hi, y_hi = tf32_high(x), tf32_high(y)
        acc = mma_v2(x - x_hi, y_hi, acc, input_precision="tf32")
        acc = mma_v2(x_hi, y - y_hi, acc, input_precision="tf32")
        acc = mma_v2(x_hi, y_hi, acc, input_precision="tf32")
    else:
        acc = mma_v2(x, y, acc)
    return acc


@gluon.jit
def band_product(vals, band, acc):
    """acc + vals @ band for a band of `weight_words`, as accurate as float32 products: 16-bit values times the
    weights' hi and lo halves, two MMAs; float32 values by `precise_product`."""
    dtype: gl.constexpr = vals.dtype
    if dtype == gl.float32:
        acc = precise_product(vals, band.to(gl.float32, bitcast=True), acc)
    else:
        acc = mma_v2(vals, band.to(gl.int16).to(dtype, bitcast=True), acc)
        acc = mma_v2(vals, (band >> 16).to(gl.int16).to(dtype, bitcast=True), acc)
    return acc

