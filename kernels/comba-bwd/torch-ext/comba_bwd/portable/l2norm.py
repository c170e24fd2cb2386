"""The L2 normalisation of q, k and p of a model's call (fla's `use_qk_l2norm_in_kernel`) in Triton, and the last step
of its backward: one launch each way for the three tensors.

Forward (`launch_forward`): y = x rsqrt(sum(x^2) + L2NORM_EPS) over K, computed in fp32, y in x's dtype
(`reference.l2_normalised`). Each program takes ROW_BLOCK[K] rows (a row: one step of one key head) of q, k and p.

Backward (`launch_backward`): the stages leave the gradients of the normalised q, k and p one per value head in fp32,
(B, T, HV, K) with HV = GROUP H. One launch sums each key head's group of GROUP value heads (value head h GROUP + j
reads key head h, so the group's rows lie next to each other) and, where the call normalised, applies the
normalisation's backward, dx = r (dy - y (dy . y)) with r = rsqrt(sum(x^2) + L2NORM_EPS) and y = x r made again
from x in fp32 (`reference.l2_normalised_backward`); dq, dk and dp come out in q's dtype. A call with grouped heads
that does not normalise takes the group sum alone. A zero row has y = 0 and dx = dy / sqrt(L2NORM_EPS): finite.

Inputs contiguous; rows are counted in 64 bits. The launches are planned once per call shape (`plan_forward`,
`plan_backward`) and run through the kept launcher of `common.launch`.
"""

import functools

import torch
import triton
import triton.language as tl

from ..common.launch import Launch, launch as run
from ..reference import L2NORM_EPS

EPS = tl.constexpr(L2NORM_EPS)

# Rows a program: ROW_BLOCK[K] K = 4096 values of each tensor, 32 a thread at L2NORM_WARPS warps, so that a program
# keeps a few tiles of loads in flight without spilling (the backward holds dy, x and y of one tensor at a time).
ROW_BLOCK = {64: 64, 128: 32, 256: 16}
L2NORM_WARPS = 4


@triton.jit
def _normalised_rows(x, y, rows, R, K: tl.constexpr):
    """y = x rsqrt(sum(x^2) + eps) on `rows` (int64 [BR], masked to R) of the (R, K) tensors x and y."""
    at = rows[:, None] * K + tl.arange(0, K)[None, :]
    inside = (rows < R)[:, None]
    xv = tl.load(x + at, mask=inside, other=0.0).to(tl.float32)
    r = tl.rsqrt(tl.sum(xv * xv, axis=1) + EPS)
    tl.store(y + at, (xv * r[:, None]).to(y.dtype.element_ty), mask=inside)


@triton.jit
def _l2norm_forward_kernel(q, k, p, qn, kn, pn, R, K: tl.constexpr, BR: tl.constexpr):
    """qn, kn, pn: q, k, p normalised, BR rows of each a program."""
    rows = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    _normalised_rows(q, qn, rows, R, K)
    _normalised_rows(k, kn, rows, R, K)
    _normalised_rows(p, pn, rows, R, K)


@triton.jit
def _key_gradient_rows(x, dy_heads, dx, rows, R, K: tl.constexpr, BR: tl.constexpr, GROUP: tl.constexpr,
                       L2NORM: tl.constexpr):
    """dx on `rows` (int64 [BR], masked to R) of the (R, K) tensors x and dx: the sum of dy_heads' (R GROUP, K) rows
    over each group of GROUP, in fp32, through the normalisation's backward at x where L2NORM."""
    cols = tl.arange(0, K)[None, :]
    inside = (rows < R)[:, None]
    dy = tl.zeros([BR, K], dtype=tl.float32)
    for j in tl.static_range(GROUP):
        dy += tl.load(dy_heads + (rows[:, None] * GROUP + j) * K + cols, mask=inside, other=0.0).to(tl.float32)
    if L2NORM:
        xv = tl.load(x + rows[:, None] * K + cols, mask=inside, other=0.0).to(tl.float32)
        r = tl.rsqrt(tl.sum(xv * xv, axis=1) + EPS)[:, None]
        y = xv * r
        dy = r * (dy - y * tl.sum(dy * y, axis=1)[:, None])
    tl.store(dx + rows[:, None] * K + cols, dy.to(dx.dtype.element_ty), mask=inside)


@triton.jit
def _l2norm_backward_kernel(q, k, p, dq_heads, dk_heads, dp_heads, dq, dk, dp, R, K: tl.constexpr, BR: tl.constexpr,
                            GROUP: tl.constexpr, L2NORM: tl.constexpr):
    """dq, dk, dp of the call's q, k, p from the gradients per value head, BR rows of each a program."""
    rows = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    _key_gradient_rows(q, dq_heads, dq, rows, R, K, BR, GROUP, L2NORM)
    _key_gradient_rows(k, dk_heads, dk, rows, R, K, BR, GROUP, L2NORM)
    _key_gradient_rows(p, dp_heads, dp, rows, R, K, BR, GROUP, L2NORM)


def launch_forward(q, k, p) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(qn, kn, pn), new tensors: contiguous q, k, p (B, T, H, K), K in ROW_BLOCK, normalised over K."""
    normalised = tuple(torch.empty_like(x) for x in (q, k, p))
    R = q.numel() // q.shape[-1]
    run(plan_forward(R, q.shape[-1]), (q, k, p, *normalised))
    return normalised


def launch_backward(q, k, p, dq_heads, dk_heads, dp_heads, l2norm: bool) -> tuple[torch.Tensor, ...]:
    """(dq, dk, dp) like q, k, p (B, T, H, K), new tensors, from the contiguous gradients of the stages' q, k, p one
    per value head, (B, T, HV, K) with HV a multiple of H: summed over each group, through the normalisation's
    backward at q, k, p where `l2norm` (q, k, p are read only then)."""
    grads = tuple(torch.empty_like(x) for x in (q, k, p))
    R = q.numel() // q.shape[-1]
    run(plan_backward(R, q.shape[-1], dq_heads.shape[2] // q.shape[2], l2norm),
        (q, k, p, dq_heads, dk_heads, dp_heads, *grads))
    return grads


@functools.cache
def plan_forward(R: int, K: int) -> Launch:
    """The forward launch for R rows of K, built once: R / ROW_BLOCK[K] programs."""
    BR = ROW_BLOCK[K]
    return Launch(_l2norm_forward_kernel, triton.cdiv(R, BR), (R,), dict(K=K, BR=BR, num_stages=1), L2NORM_WARPS,
                  f"BR={BR} warps={L2NORM_WARPS}")


@functools.cache
def plan_backward(R: int, K: int, group: int, l2norm: bool) -> Launch:
    """The backward launch for R rows of K, each the sum of `group` value heads' rows, built once."""
    BR = ROW_BLOCK[K]
    meta = dict(K=K, BR=BR, GROUP=group, L2NORM=l2norm, num_stages=1)
    return Launch(_l2norm_backward_kernel, triton.cdiv(R, BR), (R,), meta, L2NORM_WARPS,
                  f"BR={BR} warps={L2NORM_WARPS}")
