"""The TF32 split of the chunk transform's fp32-accurate products, shared by its Triton kernel (`triton_bwd._mm`)
and its Gluon kernel (`gluon_transform.mm`), which can call a Triton function."""

import triton
import triton.language as tl


@triton.jit
def tf32_high(x):
    """x rounded to TF32 (10 mantissa bits, ties away from zero, as cvt.rna.tf32) by integer arithmetic on its
    bits: an add and a mask, where cvt.rna.tf32.f32 is four instructions on sm_90 (Triton's tf32x3 splits with
    it). x - tf32_high(x) is exact, and the MMA's truncation of that residual costs 2^-21 relative. A NaN's
    high part may come out as -0, but its residual is NaN, so NaN still reaches the product."""
    return ((x.to(tl.int32, bitcast=True) + 0x1000) & -8192).to(tl.float32, bitcast=True)
