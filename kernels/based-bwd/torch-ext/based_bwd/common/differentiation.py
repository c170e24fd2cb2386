# Generated from common/differentiation.py by `python -m tools.vendor`: edit that file, not this copy.
"""The ways of differentiating a registered op that its autograd formula does not cover, refused with an error that
names the public function.

A registered op's autograd (`torch.library.register_autograd`) gives reverse mode, once: its backward is a
registered op too, without a formula of its own, and torch's generated autograd function supports neither torch.func's
grad and jvp transforms (it fails inside torch) nor forward-mode AD (the tangents would be dropped without a word).
torch.func.vmap takes the ops as they are.
"""

import torch
import torch.autograd.forward_ad as forward_ad
from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters

# torch.func's transforms that differentiate (grad, vjp, jacrev, hessian build on Grad; jvp and jacfwd on Jvp).
_DIFFERENTIATING = (torch._C._functorch.TransformType.Grad, torch._C._functorch.TransformType.Jvp)


def check_differentiation(public_name: str, *tensors: torch.Tensor) -> None:
    """Raise RuntimeError under a differentiating torch.func transform, or where a tensor carries a forward-mode
    tangent. torch has no public query for either; the stack of torch.func's interpreters is empty outside its
    transforms, and no tensor carries a tangent outside a `forward_ad.dual_level`, which keeps the check of a
    plain call to two lookups."""
    if torch.compiler.is_compiling():
        return
    if torch._C._functorch.peek_interpreter_stack() is not None and any(
        interpreter.key() in _DIFFERENTIATING for interpreter in retrieve_all_functorch_interpreters()
    ):
        raise RuntimeError(
            f"{public_name}: torch.func's grad and jvp transforms (grad, vjp, jacrev, jacfwd, hessian, jvp) are not "
            "supported; differentiate it with torch.autograd (loss.backward(), torch.autograd.grad)"
        )
    check_forward_ad(public_name, *tensors)


def check_forward_ad(public_name: str, *tensors: torch.Tensor) -> None:
    """Raise RuntimeError where a tensor carries a forward-mode tangent: the one way of differentiating that
    `check_differentiation` refuses and a call that `direct_calls.calls_directly` takes may still meet (no torch.func
    transform is active there, nor a compiler)."""
    if forward_ad._current_level >= 0 and any(forward_ad.unpack_dual(x).tangent is not None for x in tensors):
        raise RuntimeError(f"{public_name}: forward-mode AD (a dual tensor) is not supported; use reverse mode")


def no_double_backward(public_name: str, backward_name: str):
    """The autograd formula to register for the op `backward_name` that computes `public_name`'s gradients: it
    raises, so that a double backward (a gradient of those gradients) stops with an error naming the function."""

    def backward(ctx, *grads):
        raise RuntimeError(
            f"{public_name}: double backward is not supported ({backward_name}, its gradients, has no derivative); "
            "take first-order gradients only (create_graph=True is fine where nothing differentiates them again)"
        )

    return backward
