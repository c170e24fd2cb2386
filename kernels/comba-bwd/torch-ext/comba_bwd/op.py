"""The registered ops (backward, forward, autograd link) and the public functions.

`comba_forward_op` runs the fused forward on CUDA tensors and returns, beside o, the chunk transform A, the
chunk-start states S_n and the corrected values Vn it made (`dispatch.saved_like`); on CPU tensors it runs the eager
chunked reference and returns empty tensors in their place. `comba_backward_op` runs the fused backward on CUDA
tensors, from the forward's A, S_n and Vn where it is given them, and the eager analytic backward on CPU tensors. The
autograd link keeps the forward's A, S_n and Vn for the backward, so that a training step makes them once. Every op
name goes through `add_op_namespace_prefix`, so two versions of this kernel can be loaded side by side.
"""

from typing import Optional

import torch

from . import dispatch
from ._ops import add_op_namespace_prefix
from .reference import comba_backward_reference, comba_forward_reference, pad_time
from .validation import check_comba_args

Grads = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def kernel_path(x: torch.Tensor) -> str:
    """Which implementation `comba_attention` and `comba_backward` take for tensors on `x`'s device: "triton" or
    "reference"."""
    return "triton" if x.is_cuda else "reference"


def _as_input_dtypes(grads, q, beta):
    """Gradients in their inputs' dtypes: dq, dk, dv, dp like q, dbeta like beta, dg float32 (like g)."""
    dq, dk, dv, dp, dbeta, dg = grads
    return dq.to(q.dtype), dk.to(q.dtype), dv.to(q.dtype), dp.to(q.dtype), dbeta.to(beta.dtype), dg.float()


def _no_saved(q):
    """What the CPU forward returns in place of A, S_n and Vn: three empty tensors."""
    return tuple(q.new_empty(0, dtype=torch.bfloat16) for _ in range(3))


@torch.library.custom_op(add_op_namespace_prefix("comba_backward"), mutates_args=(), device_types="cuda")
def comba_backward_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: torch.Tensor, beta: torch.Tensor, g: torch.Tensor,
    do: torch.Tensor, scale: float, A: Optional[torch.Tensor] = None, S: Optional[torch.Tensor] = None,
    Vn: Optional[torch.Tensor] = None,
) -> Grads:
    from .backward import fused_backward  # imported here: the package must import without triton

    return fused_backward(q, k, v, p, beta, g, do, scale, None if A is None else (A, S, Vn))


@torch.library.register_kernel(add_op_namespace_prefix("comba_backward"), "cpu")
def _(q, k, v, p, beta, g, do, scale, A=None, S=None, Vn=None):
    return _as_input_dtypes(comba_backward_reference(q, k, v, p, beta, g, do, scale), q, beta)


@torch.library.register_fake(add_op_namespace_prefix("comba_backward"))
def _(q, k, v, p, beta, g, do, scale, A=None, S=None, Vn=None):
    like = (q, k, v, p, beta)
    return (*(torch.empty_like(x) for x in like), torch.empty_like(g, dtype=torch.float32))


@torch.library.custom_op(add_op_namespace_prefix("comba_forward"), mutates_args=(), device_types="cuda")
def comba_forward_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: torch.Tensor, beta: torch.Tensor, g: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    from .forward import fused_forward  # imported here: the package must import without triton

    return fused_forward(q, k, v, p, beta, g, scale)


@torch.library.register_kernel(add_op_namespace_prefix("comba_forward"), "cpu")
def _(q, k, v, p, beta, g, scale):
    return comba_forward_reference(q, k, v, p, beta, g, scale), *_no_saved(q)


@torch.library.register_fake(add_op_namespace_prefix("comba_forward"))
def _(q, k, v, p, beta, g, scale):
    if q.device.type == "cpu":
        return torch.empty_like(v), *_no_saved(q)
    return torch.empty_like(v), *dispatch.saved_like(pad_time(q), v.shape[-1])


def _setup_context(ctx, inputs, output):
    *tensors, scale = inputs
    _, A, S, Vn = output
    ctx.mark_non_differentiable(A, S, Vn)
    ctx.save_for_backward(*tensors, A, S, Vn)
    ctx.scale = scale


def _backward(ctx, do, *_):
    q, k, v, p, beta, g, A, S, Vn = ctx.saved_tensors
    saved = (A, S, Vn) if A.numel() else ()  # none from the CPU forward
    grads = comba_backward_op(q, k, v, p, beta, g, do.contiguous(), ctx.scale, *saved)
    return (*grads, None)


torch.library.register_autograd(add_op_namespace_prefix("comba_forward"), _backward, setup_context=_setup_context)


def _prepare(tensors, scale, K):
    return [x.contiguous() for x in tensors], (K**-0.5 if scale is None else float(scale))


def comba_backward(q, k, v, p, beta, g, do, scale=None):
    """Gradients of the Comba forward (decay before the read) with respect to q, k, v, p, beta, g.

    q, k, p: (B, T, H, K); v, do: (B, T, H, V), all bfloat16, float16 or float32 of one dtype;
    beta: (B, T, H) of any of those dtypes; g: (B, T, H) float32 log-decay. scale: float or None (K ** -0.5).
    Returns (dq, dk, dv, dp, dbeta, dg): dq, dk, dv, dp in q's dtype, dbeta in beta's, dg float32.
    Non-contiguous inputs are copied to contiguous ones; any T >= 1 is accepted.
    """
    check_comba_args(q, k, v, p, beta, g, scale, do)
    tensors, scale = _prepare((q, k, v, p, beta, g, do), scale, q.shape[-1])
    return comba_backward_op(*tensors, scale)


def comba_attention(q, k, v, p, beta, g, scale=None) -> torch.Tensor:
    """Comba forward o (B, T, H, V) in v's dtype, differentiable in q, k, v, p, beta and g.

    Same arguments as `comba_backward` without `do`. On CUDA the forward and the backward are the fused kernels, and
    a training step keeps the forward's chunk transform and states for the backward; on the CPU both run the eager
    chunked reference (float32 inside).
    """
    check_comba_args(q, k, v, p, beta, g, scale)
    tensors, scale = _prepare((q, k, v, p, beta, g), scale, q.shape[-1])
    return comba_forward_op(*tensors, scale)[0]
