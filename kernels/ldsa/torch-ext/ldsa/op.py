"""The registered ops (forward, backward, autograd link) and the public function.

Every CUDA call runs `dispatch`'s entry points (`ldsa_forward_cuda`, `ldsa_backward_cuda`), which pick the fused
kernels or the eager reference; CPU tensors run the reference. The public function, and the backward that autograd
runs, decide whether a call needs the registered op at all (`common.direct_calls.calls_directly`); the public
function keeps its direct calls by call signature (`dispatch.DIRECT_FORWARDS`). Every op name goes through
`add_op_namespace_prefix`, so two versions of this kernel can be loaded side by side.

Under autocast (`common.autocast`) the ops run with autocast off: on CUDA `ldsa_forward` takes a_logits and v in
autocast's dtype (the fused kernels' 16-bit operands), `ldsa_backward` its arguments as given; on the CPU both take
them as given and compute in float32. Reverse mode is the only differentiation (`common.differentiation`): a double
backward, torch.func's grad and jvp transforms and forward-mode AD raise RuntimeError naming the public function.
"""

import torch

from ._ops import add_op_namespace_prefix
from .common.autocast import register_autocast
from .common.differentiation import check_differentiation, check_forward_ad, no_double_backward
from .common.direct_calls import CheckedSignatures, calls_directly, launches_directly
from .dispatch import DIRECT_FORWARDS, ldsa_backward_cuda, ldsa_forward_cuda, ldsa_forward_direct
from .reference import ldsa_backward_reference, ldsa_forward_reference
from .validation import check_grad_out, check_ldsa_args


@torch.library.custom_op(add_op_namespace_prefix("ldsa_forward"), mutates_args=(), device_types="cuda")
def ldsa_forward_op(a_logits: torch.Tensor, v: torch.Tensor, left: int, right: int) -> torch.Tensor:
    return ldsa_forward_cuda(a_logits, v, left, right)


@torch.library.register_kernel(add_op_namespace_prefix("ldsa_forward"), "cpu")
def _(a_logits, v, left, right):
    return ldsa_forward_reference(a_logits, v, left, right)


@torch.library.register_fake(add_op_namespace_prefix("ldsa_forward"))
def _(a_logits, v, left, right):
    return torch.empty_like(v)


@torch.library.custom_op(add_op_namespace_prefix("ldsa_backward"), mutates_args=(), device_types="cuda")
def ldsa_backward_op(
    a_logits: torch.Tensor, v: torch.Tensor, grad_out: torch.Tensor, left: int, right: int
) -> tuple[torch.Tensor, torch.Tensor]:
    check_grad_out(grad_out, v)  # the registered backward is callable directly: a bad grad_out must not launch
    return ldsa_backward_cuda(a_logits, v, grad_out, left, right)


@torch.library.register_kernel(add_op_namespace_prefix("ldsa_backward"), "cpu")
def _(a_logits, v, grad_out, left, right):
    check_grad_out(grad_out, v)
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
    grad_out = grad_out.contiguous()
    if calls_directly(a_logits, v, grad_out):  # no create_graph (its grad mode sees the saved tensors need grad)
        check_grad_out(grad_out, v)
        dlogits, dv = ldsa_backward_cuda(a_logits, v, grad_out, *ctx.window)
    else:
        dlogits, dv = ldsa_backward_op(a_logits, v, grad_out, *ctx.window)
    return dlogits, dv, None, None


torch.library.register_autograd(
    add_op_namespace_prefix("ldsa_forward"), _backward, setup_context=_setup_context
)
torch.library.register_autograd(add_op_namespace_prefix("ldsa_backward"),
                                no_double_backward("ldsa_local_attention", "ldsa_backward"))
register_autocast(add_op_namespace_prefix("ldsa_forward"), cuda_16bit=(0, 1))
register_autocast(add_op_namespace_prefix("ldsa_backward"))


def ldsa_local_attention(a_logits: torch.Tensor, v: torch.Tensor, left: int, right: int) -> torch.Tensor:
    """LDSA window op: softmax over the window of `a_logits`, then the windowed weighted sum of `v`.

    a_logits: [B, H, W, T] window logits (W = left + right + 1), float32/bfloat16/float16.
    v:        [B, H, Dh, T] values, float32/bfloat16/float16.
    Returns [B, H, Dh, T] in v's dtype: out[b,h,d,t] = sum_k softmax_k(a_logits[b,h,:,t]) v[b,h,d,t-left+k],
    with v taken as zero outside [0, T). Softmax and accumulation in float32. Differentiable in both
    tensors, in reverse mode only: a double backward, torch.func's grad and jvp transforms and forward-mode AD raise
    RuntimeError. Under CUDA autocast the tensors are taken in autocast's dtype (the result in that dtype), under
    CPU autocast as given. Non-contiguous inputs are copied to contiguous ones.
    """
    kept = None  # the signature of a call a kept direct call could take, where none is kept yet
    if (type(a_logits) is torch.Tensor and type(v) is torch.Tensor and type(left) is int and type(right) is int
            and launches_directly(a_logits, v)):
        kept = (a_logits.shape, v.shape, a_logits.dtype, v.dtype, a_logits.device, v.device, left, right)
        forward = DIRECT_FORWARDS.get(kept)
        if forward is not None:
            return forward(a_logits, v)
    signature = _check_args_once(a_logits, v, left, right)
    left, right = int(left), int(right)  # numpy integers pass the check; the registered op takes Python ints
    a_logits, v = a_logits.contiguous(), v.contiguous()
    if calls_directly(a_logits, v):  # no torch.func transform or compiler sees the call: forward AD alone is left
        check_forward_ad("ldsa_local_attention", a_logits, v)
        out = ldsa_forward_cuda(a_logits, v, left, right)
        if kept is not None:
            DIRECT_FORWARDS.keep(kept, ldsa_forward_direct(a_logits, v, left, right))
        return out
    check_differentiation("ldsa_local_attention", a_logits, v)
    return ldsa_forward_op(a_logits, v, left, right)


# Call signatures (shapes, dtypes and devices of two plain tensors, the window sides as ints) that passed
# check_ldsa_args: the checks cost more host time than the lookup, a share of a small call's launch-bound budget
# worth saving.
_checked = CheckedSignatures()


def _check_args_once(a_logits, v, left, right) -> tuple | None:
    """check_ldsa_args, skipped for a call signature that passed it before; the signature (None for tensor
    subclasses)."""
    if type(a_logits) is not torch.Tensor or type(v) is not torch.Tensor:
        check_ldsa_args(a_logits, v, left, right)  # raises for a non-tensor; subclasses are checked every call
        return None
    if type(left) is not int or type(right) is not int:
        # numpy integers (and bools, which the check refuses) are checked every call; the signatures hold ints only,
        # which torch.compile can trace a set of
        check_ldsa_args(a_logits, v, left, right)
        left, right = int(left), int(right)
    signature = (a_logits.shape, v.shape, a_logits.dtype, v.dtype, a_logits.device, v.device, left, right)
    if signature not in _checked:
        check_ldsa_args(a_logits, v, left, right)
        _checked.add(signature)
    return signature
