"""The registered ops (forward, backward, autograd link) and the public function.

CUDA tensors run `_cuda_forward` / `_cuda_backward`; CPU tensors run the eager reference. Every op name
goes through `add_op_namespace_prefix`, so two versions of this kernel can be loaded side by side.
"""

import torch

from ._ops import add_op_namespace_prefix
from .reference import ldsa_backward_reference, ldsa_forward_reference
from .validation import check_ldsa_args


def kernel_path(x: torch.Tensor) -> str:
    """Which implementation a call on `x`'s device takes: "triton" or "reference"."""
    return "reference"


def _cuda_forward(a_logits, v, left, right):
    return ldsa_forward_reference(a_logits, v, left, right)


def _cuda_backward(a_logits, v, grad_out, left, right):
    return ldsa_backward_reference(a_logits, v, grad_out, left, right)


@torch.library.custom_op(add_op_namespace_prefix("ldsa_forward"), mutates_args=(), device_types="cuda")
def ldsa_forward(a_logits: torch.Tensor, v: torch.Tensor, left: int, right: int) -> torch.Tensor:
    return _cuda_forward(a_logits, v, left, right)


@torch.library.register_kernel(add_op_namespace_prefix("ldsa_forward"), "cpu")
def _(a_logits, v, left, right):
    return ldsa_forward_reference(a_logits, v, left, right)


@torch.library.register_fake(add_op_namespace_prefix("ldsa_forward"))
def _(a_logits, v, left, right):
    return torch.empty_like(v)


@torch.library.custom_op(add_op_namespace_prefix("ldsa_backward"), mutates_args=(), device_types="cuda")
def ldsa_backward(
    a_logits: torch.Tensor, v: torch.Tensor, grad_out: torch.Tensor, left: int, right: int
) -> tuple[torch.Tensor, torch.Tensor]:
    return _cuda_backward(a_logits, v, grad_out, left, right)


@torch.library.register_kernel(add_op_namespace_prefix("ldsa_backward"), "cpu")
def _(a_logits, v, grad_out, left, right):
    return ldsa_backward_reference(a_logits, v, grad_out, left, right)


@torch.library.register_fake(add_op_namespace_prefix("ldsa_backward"))
def _(a_logits, v, grad_out, left, right):
    return torch.empty_like(a_logits), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    a_logits, v, left, right = inputs
    ctx.save_for_backward(a_logits, v)
    ctx.window = (left, right)


def _backward(ctx, grad_out):
    a_logits, v = ctx.saved_tensors
    dlogits, dv = ldsa_backward(a_logits, v, grad_out.contiguous(), *ctx.window)
    return dlogits, dv, None, None


torch.library.register_autograd(
    add_op_namespace_prefix("ldsa_forward"), _backward, setup_context=_setup_context
)


def ldsa_local_attention(a_logits: torch.Tensor, v: torch.Tensor, left: int, right: int) -> torch.Tensor:
    """LDSA window op: softmax over the window of `a_logits`, then the windowed weighted sum of `v`.

    a_logits: [B, H, W, T] window logits (W = left + right + 1), float32/bfloat16/float16.
    v:        [B, H, Dh, T] values, float32/bfloat16/float16.
    Returns [B, H, Dh, T] in v's dtype: out[b,h,d,t] = sum_k softmax_k(a_logits[b,h,:,t]) v[b,h,d,t-left+k],
    with v taken as zero outside [0, T). Softmax and accumulation in float32. Differentiable in both
    tensors. Non-contiguous inputs are copied to contiguous ones.
    """
    check_ldsa_args(a_logits, v, left, right)
    return ldsa_forward(a_logits.contiguous(), v.contiguous(), left, right)
