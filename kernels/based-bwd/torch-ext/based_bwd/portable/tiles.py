"""Tile helpers the stage kernels share: row-tile loads and stores of (B, T, H, D) tensors, the sequence offset
of a (b, h) program, the matmul in the kernels' operand type (and that type for an input dtype), and the
normaliser's epsilon. The guard of a causal product against non-finite values is `common.finite`'s (`reference.py`
states the rule); the reference's product is non-finite only in the columns that hold one, the guard's in the whole
row.
"""


import torch
import triton
import triton.language as tl

from ..reference import EPS

_EPS = tl.constexpr(EPS)  # a jit function reads a module global only as a constexpr (the compiler checks this)


def operand_type(dtype: torch.dtype):
    """The kernels' matmul operand type for inputs of `dtype`: IEEE fp32 for fp32, bf16 otherwise."""
    return tl.float32 if dtype == torch.float32 else tl.bfloat16


@triton.jit
def _load_rows(base, t0, T, row_stride, ncols, R: tl.constexpr, W: tl.constexpr):
    """[R, W]: positions t0 .. t0 + R down, features 0 .. W across; zero past T or past ncols."""
    rows = t0 + tl.arange(0, R)
    cols = tl.arange(0, W)
    ptrs = base + rows.to(tl.int64)[:, None] * row_stride + cols[None, :]
    return tl.load(ptrs, mask=(rows[:, None] < T) & (cols[None, :] < ncols), other=0.0)


@triton.jit
def _store_rows(base, x, t0, T, row_stride, ncols, R: tl.constexpr, W: tl.constexpr):
    rows = t0 + tl.arange(0, R)
    cols = tl.arange(0, W)
    ptrs = base + rows.to(tl.int64)[:, None] * row_stride + cols[None, :]
    tl.store(ptrs, x.to(base.dtype.element_ty), mask=(rows[:, None] < T) & (cols[None, :] < ncols))


@triton.jit
def _dot(DOT: tl.constexpr, a, b):
    """a @ b with both operands in DOT (bf16: tensor cores; fp32: exact IEEE fp32), fp32 accumulation."""
    if DOT == tl.float32:
        return tl.dot(a.to(DOT), b.to(DOT), input_precision="ieee")
    return tl.dot(a.to(DOT), b.to(DOT))


@triton.jit
def _sequence_row(pid_bh, T, H):
    """The row of position 0 of sequence pid_bh = b H + h in a (B, T, H, .) tensor, in int64."""
    return (pid_bh // H).to(tl.int64) * T * H + pid_bh % H
