"""Tile helpers the stage kernels share: row-tile loads and stores of (B, T, H, D) tensors, the sequence offset
of a (b, h) program, the matmul in the kernels' operand type (and that type for an input dtype), the guard of a
causal product against non-finite values, and the normaliser's epsilon.

A causal product A @ x over a chunk (A zero above its diagonal, row i reading the rows j <= i of x; REVERSE: zero
below it, row i reading the rows j >= i) must not carry a non-finite x_j to the rows that do not read it, as a
masked weight of 0 times inf is NaN (`reference.py` states the rule). Its operand is x with the non-finite entries
zeroed (`_finite_part`, applied where x is loaded, so that the operand goes to shared memory as an unguarded one
would), and the finished sum is NaN in every row that reads one: from the chunk's first row holding a non-finite
entry on (REVERSE: up to its last), in every column (`_reached`, applied to the sum after the product accumulates
into it, so that the product keeps accumulating in place). The reference's product is non-finite only in the
columns that hold one; a per-column edge would hold a vector in the accumulator's layout (32 registers a thread
at 128 columns on 4 warps), the row edge holds one. On a clean chunk the guard is an isfinite select on the
operand, a reduction of it to one row index, and a select on the sum.
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
def _finite_part(x, C: tl.constexpr, REVERSE: tl.constexpr):
    """(x [C, W] with its non-finite entries zeroed, the first of its rows holding one (C if none; REVERSE: the
    last, -1 if none)): the operand of a causal product, and the edge `_reached` takes."""
    finite = tl.abs(x.to(tl.float32)) < float("inf")  # false for NaN
    rows = tl.arange(0, C)[:, None]
    if REVERSE:
        edge = tl.max(tl.max(tl.where(finite, -1, rows), 1), 0)
    else:
        edge = tl.min(tl.min(tl.where(finite, C, rows), 1), 0)
    return tl.where(finite, x, 0.0), edge


@triton.jit
def _reached(y, edge, C: tl.constexpr, REVERSE: tl.constexpr):
    """y [C, W], a sum holding a causal product of `_finite_part`'s operand, NaN in the rows that read the
    operand's non-finite entries: rows >= edge (REVERSE: rows <= edge)."""
    rows = tl.arange(0, C)
    if REVERSE:
        reached = rows <= edge
    else:
        reached = rows >= edge
    return tl.where(reached[:, None], float("nan"), y)


@triton.jit
def _sequence_row(pid_bh, T, H):
    """The row of position 0 of sequence pid_bh = b H + h in a (B, T, H, .) tensor, in int64."""
    return (pid_bh // H).to(tl.int64) * T * H + pid_bh % H
