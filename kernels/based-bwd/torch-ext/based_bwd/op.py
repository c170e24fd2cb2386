"""The registered ops (backward, forward with its autograd link) and the public functions.

The CUDA implementations come from `dispatch`, which picks each call's path. `based_forward`'s registered autograd calls
the registered `based_backward` op, so training goes through the same backward as a direct call, and inference
under no_grad through the same forward. Every op name goes through `add_op_namespace_prefix`, so two versions of
this kernel can be loaded side by side.
"""

import torch

from ._ops import add_op_namespace_prefix
from .dispatch import based_backward_cuda, based_forward_cuda
from .reference import based_backward_reference, based_forward_reference, default_scale
from .validation import check_based_args


@torch.library.custom_op(add_op_namespace_prefix("based_backward"), mutates_args=(), device_types="cuda")
def based_backward_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return based_backward_cuda(q, k, v, do, scale)


@torch.library.register_kernel(add_op_namespace_prefix("based_backward"), "cpu")
def _(q, k, v, do, scale):
    return based_backward_reference(q, k, v, do, scale)


@torch.library.register_fake(add_op_namespace_prefix("based_backward"))
def _(q, k, v, do, scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


@torch.library.custom_op(add_op_namespace_prefix("based_forward"), mutates_args=(), device_types="cuda")
def based_forward_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    return based_forward_cuda(q, k, v, scale)


@torch.library.register_kernel(add_op_namespace_prefix("based_forward"), "cpu")
def _(q, k, v, scale):
    return based_forward_reference(q, k, v, scale)


@torch.library.register_fake(add_op_namespace_prefix("based_forward"))
def _(q, k, v, scale):
    return torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, scale = inputs
    ctx.save_for_backward(q, k, v)
    ctx.scale = scale


def _backward(ctx, grad_out):
    q, k, v = ctx.saved_tensors
    dq, dk, dv = based_backward_op(q, k, v, grad_out.to(q.dtype).contiguous(), ctx.scale)
    return dq, dk, dv, None


torch.library.register_autograd(add_op_namespace_prefix("based_forward"), _backward, setup_context=_setup_context)


def _resolved(q, scale) -> float:
    return default_scale(q.shape[-1]) if scale is None else float(scale)


def based_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor, scale=None):
    """Gradients (dq, dk, dv) of the causal Based attention o = based_attention(q, k, v, scale) for the
    incoming gradient do.

    q, k: (B, T, H, K); v, do: (B, T, H, V); one dtype among float32/bfloat16/float16, one device. K is the
    Taylor feature size: 8 or 16 on CUDA, any on CPU. scale multiplies q only; None means K ** -0.5.
    Returns dq, dk, dv with the shapes and dtype of q, k, v. Non-contiguous inputs are copied.
    """
    check_based_args(q, k, v, scale, do=do)
    return based_backward_op(q.contiguous(), k.contiguous(), v.contiguous(), do.contiguous(), _resolved(q, scale))


def based_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale=None) -> torch.Tensor:
    """Causal Based (2nd-order Taylor) attention o (B, T, H, V) in q's dtype, differentiable in q, k, v:

    o_i = sum_{j<=i} A_ij v_j / (sum_{j<=i} A_ij + 1e-6),  A_ij = 1 + s_ij + s_ij^2 / 2,  s_ij = scale q_i . k_j.

    Same arguments as `based_backward`. Its gradients come from the registered `based_backward` op.
    """
    check_based_args(q, k, v, scale)
    return based_forward_op(q.contiguous(), k.contiguous(), v.contiguous(), _resolved(q, scale))
