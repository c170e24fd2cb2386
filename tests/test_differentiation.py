"""The differentiable ops beyond one reverse pass: a double backward, torch.func's grad and jvp transforms and
forward-mode AD raise a RuntimeError naming the public function (the registered ops have a reverse-mode formula
only; based_attention with a state takes them on the CPU too); first-order gradients with create_graph=True and
torch.func.vmap work; the reference path of comba_attention (fla's read order) is torch ops, which torch.func
differentiates."""

import pytest
import torch
import torch.autograd.forward_ad as forward_ad

from test_autocast import DIFFERENTIABLE, comba_call, first
from testkit import load

CALLS = ["ldsa_local_attention", "based_attention", "comba_attention"]  # the public functions' plain calls
STATE_CALL = "based_attention with a state out"
REGISTERED = [*CALLS, STATE_CALL]  # the calls through registered ops


def public_function(name):
    return {"ldsa_local_attention": lambda: load("ldsa").ldsa_local_attention,
            "based_attention": lambda: load("based-bwd").based_attention,
            "comba_attention": lambda: load("comba-bwd").comba_attention}[name]()


def as_function(name):
    """The call (a public function, or STATE_CALL) as a function of its first input alone, the others fixed, and
    that input."""
    _, inputs = DIFFERENTIABLE[name]()
    function = name.split()[0]
    rest = [x.detach() for x in inputs[1:]] + ([2, 2] if function == "ldsa_local_attention" else [])
    kwargs = {"output_final_state": True} if name == STATE_CALL else {}
    op = public_function(function)
    return lambda x: first(op(x, *rest, **kwargs)), inputs[0].detach()


@pytest.mark.kernels_ci
@pytest.mark.parametrize("name", REGISTERED)
def test_double_backward_raises_naming_the_op(name):
    call, inputs = DIFFERENTIABLE[name]()
    o = first(call())
    grads = torch.autograd.grad(o.square().sum(), inputs, create_graph=True)
    plain = torch.autograd.grad(first(call()).square().sum(), inputs)
    assert all(torch.equal(g, p) for g, p in zip(grads, plain))  # first order with create_graph=True
    with pytest.raises(RuntimeError, match=f"^{name.split()[0]}: double backward is not supported"):
        sum(g.sum() for g in grads).backward()


@pytest.mark.kernels_ci
@pytest.mark.parametrize("name", REGISTERED)
@pytest.mark.parametrize("transform", ["grad", "jacrev", "jvp"])
def test_torch_func_grad_and_jvp_raise_naming_the_op(name, transform):
    f, x = as_function(name)
    run = {"grad": lambda: torch.func.grad(lambda x: f(x).sum())(x),
           "jacrev": lambda: torch.func.jacrev(f)(x),
           "jvp": lambda: torch.func.jvp(f, (x,), (torch.ones_like(x),))}[transform]
    with pytest.raises(RuntimeError, match=f"^{name.split()[0]}: torch.func's grad and jvp transforms"):
        run()


@pytest.mark.kernels_ci
@pytest.mark.parametrize("name", REGISTERED)
def test_forward_mode_ad_raises_naming_the_op(name):
    f, x = as_function(name)
    with forward_ad.dual_level(), pytest.raises(RuntimeError, match=f"^{name.split()[0]}: forward-mode AD"):
        f(forward_ad.make_dual(x, torch.ones_like(x)))


@pytest.mark.kernels_ci
@pytest.mark.parametrize("name", CALLS)
def test_torch_func_vmap_matches_a_loop(name):
    f, x = as_function(name)
    xs = torch.stack([x, 2 * x])
    assert torch.equal(torch.func.vmap(f)(xs), torch.stack([f(x), f(2 * x)]))


@pytest.mark.kernels_ci
def test_torch_func_grad_through_the_reference_path():
    """comba_attention in fla's read order runs the reference's torch ops: torch.func.grad gives autograd's
    gradient, and a double backward works."""
    kwargs = {"read_order": "fla"}
    call, inputs = comba_call(**kwargs)
    op = public_function("comba_attention")
    rest = [x.detach() for x in inputs[1:]]

    def loss(x):
        return first(op(x, *rest, **kwargs)).square().sum()

    x = inputs[0].detach().requires_grad_()
    (want,) = torch.autograd.grad(loss(x), x, create_graph=True)
    assert torch.allclose(torch.func.grad(loss)(x.detach()), want, rtol=1e-6, atol=0)
    want.sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
