# Generated from common/tf32.py by `python -m tools.vendor`: edit that file, not this copy.
"""The TF32 split behind the float32-accurate tensor-core products (three TF32 MMAs of split operands, the residuals'
product left out): a Triton function, callable from Triton and Gluon kernels alike."""

import triton
import triton.language as tl


@triton.jit
def tf32_high(x):
    """float32 x rounded to TF32 (10 mantissa bits, ties away from zero, as cvt.rna.tf32) by integer arithmetic on
    its bits: an add and a mask, where cvt.rna.tf32.f32 (what Triton's tf32x3 splits with) is four instructions on
    sm_90. x - tf32_high(x) is exact, and the MMA's truncation of that residual to TF32 costs 2^-21 of x; rounding
    rather than truncating the high part keeps the residual half as large. A NaN's high part may come out as -0,
    but its residual is NaN, so NaN still reaches the product."""
    return ((x.to(tl.int32, bitcast=True) + 0x1000) & -8192).to(tl.float32, bitcast=True)
