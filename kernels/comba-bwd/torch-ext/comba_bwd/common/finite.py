# Generated from common/finite.py by `python -m tools.vendor`: edit that file, not this copy.
"""The guard of a causal product against non-finite values, in Triton (imported by stage modules only: it needs
triton, which the CPU wheels lack).

A causal product A @ x over a chunk (A zero above its diagonal, row i reading the rows j <= i of x; REVERSE: zero
below it, row i reading the rows j >= i) must not carry a non-finite x_j to the rows that do not read it, as a
masked weight of 0 times inf is NaN. Its operand is x with the non-finite entries zeroed (`finite_part`, applied
where x is loaded, so that the operand goes to shared memory as an unguarded one would), and the finished sum is NaN
in every row that reads one: from the chunk's first row holding a non-finite entry on (REVERSE: up to its last), in
every column (`reached`, applied to the sum after the product accumulates into it, so that the product keeps
accumulating in place). A per-column edge would hold a vector in the accumulator's layout, the row edge holds one
scalar. On a clean chunk the guard is an isfinite select on the operand, a reduction of it to one row index, and a
select on the sum.
"""

import triton
import triton.language as tl


@triton.jit
def finite_part(x, C: tl.constexpr, REVERSE: tl.constexpr, TRANSPOSED: tl.constexpr = False):
    """(x [C, W] with its non-finite entries zeroed, the first of its rows holding one (C if none; REVERSE: the
    last, -1 if none)): the operand of a causal product, and the edge `reached` takes. TRANSPOSED: x is [W, C], the
    chunk's rows along its second axis (an operand loaded transposed)."""
    finite = tl.abs(x.to(tl.float32)) < float("inf")  # false for NaN
    if TRANSPOSED:
        rows = tl.arange(0, C)[None, :]
    else:
        rows = tl.arange(0, C)[:, None]
    if REVERSE:
        edge = tl.max(tl.max(tl.where(finite, -1, rows), 1), 0)
    else:
        edge = tl.min(tl.min(tl.where(finite, C, rows), 1), 0)
    return tl.where(finite, x, 0.0), edge


@triton.jit
def reached(y, edge, C: tl.constexpr, REVERSE: tl.constexpr):
    """y [C, W], a sum holding a causal product of `finite_part`'s operand, NaN in the rows that read the
    operand's non-finite entries: rows >= edge (REVERSE: rows <= edge)."""
    rows = tl.arange(0, C)
    if REVERSE:
        is_reached = rows <= edge
    else:
        is_reached = rows >= edge
    return tl.where(is_reached[:, None], float("nan"), y)
