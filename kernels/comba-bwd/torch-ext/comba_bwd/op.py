"""The registered ops (backward, forward, autograd link) and the public functions.

`comba_forward_op` runs the fused forward on CUDA tensors (`dispatch.comba_forward_cuda`) and the eager chunked
reference on CPU tensors; `comba_backward_op` runs the fused backward on CUDA tensors (`dispatch.comba_backward_cuda`)
and the eager analytic backward on CPU tensors. The autograd link saves the forward's inputs and calls
`comba_backward_op`, which makes the chunk transform and the states again. Every op name goes through
`add_op_namespace_prefix`, so two versions of this kernel can be loaded side by side.
"""

import torch

from ._ops import add_op_namespace_prefix
from .dispatch import comba_backward_cuda, comba_forward_cuda
from .reference import comba_backward_reference, comba_forward_reference
from .validation import check_comba_args

Grads = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def _as_input_dtypes(grads, q, beta):
    """Gradients in their inputs' dtypes: dq, dk, dv, dp like q, dbeta like beta, dg float32 (like g)."""
    dq, dk, dv, dp, dbeta, dg = grads
    return dq.to(q.dtype), dk.to(q.dtype), dv.to(q.dtype), dp.to(q.dtype), dbeta.to(beta.dtype), dg.float()


@torch.library.custom_op(add_op_namespace_prefix("comba_backward"), mutates_args=(), device_types="cuda")
def comba_backward_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: torch.Tensor, beta: torch.Tensor, g: torch.Tensor,
    do: torch.Tensor, scale: float,
) -> Grads:
    return comba_backward_cuda(q, k, v, p, beta, g, do, scale)


@torch.library.register_kernel(add_op_namespace_prefix("comba_backward"), "cpu")
def _(q, k, v, p, beta, g, do, scale):
    return _as_input_dtypes(comba_backward_reference(q, k, v, p, beta, g, do, scale), q, beta)


@torch.library.register_fake(add_op_namespace_prefix("comba_backward"))
def _(q, k, v, p, beta, g, do, scale):
    like = (q, k, v, p, beta)
    return (*(torch.empty_like(x) for x in like), torch.empty_like(g, dtype=torch.float32))


@torch.library.custom_op(add_op_namespace_prefix("comba_forward"), mutates_args=(), device_types="cuda")
def comba_forward_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: torch.Tensor, beta: torch.Tensor, g: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    return comba_forward_cuda(q, k, v, p, beta, g, scale)


@torch.library.register_kernel(add_op_namespace_prefix("comba_forward"), "cpu")
def _(q, k, v, p, beta, g, scale):
    return comba_forward_reference(q, k, v, p, beta, g, scale)


@torch.library.register_fake(add_op_namespace_prefix("comba_forward"))
def _(q, k, v, p, beta, g, scale):
    return torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    *tensors, scale = inputs
    ctx.save_for_backward(*tensors)
    ctx.scale = scale


def _backward(ctx, do):
    q, k, v, p, beta, g = ctx.saved_tensors
    grads = comba_backward_op(q, k, v, p, beta, g, do.contiguous(), ctx.scale)
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

    Same arguments as `comba_backward` without `do`. On CUDA the forward and the backward are the fused kernels; on
    the CPU both run the eager chunked reference (float32 inside).
    """
    check_comba_args(q, k, v, p, beta, g, scale)
    tensors, scale = _prepare((q, k, v, p, beta, g), scale, q.shape[-1])
    return comba_forward_op(*tensors, scale)
