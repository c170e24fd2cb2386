"""The differentiable ops beyond one reverse pass: a double backward, torch.func's grad and jvp transforms and
forward-mode AD raise a RuntimeError naming the public function (the registered ops have a reverse-mode formula
only); first-order gradients with create_graph=True and torch.func.vmap work; the reference paths (a state, fla's
read order) are torch ops, which torch.func differentiates."""

import pytest
import torch
import torch.autograd.forward_ad as forward_ad

from test_autocast import based_call, comba_call, first, ldsa_call
from testkit import load

CALLS = {"ldsa_local_attention": ldsa_call, "based_attention": based_call, "comba_attention": comba_call}


def public_function(name):
    return {"ldsa_local_attention": lambda: load("ldsa").ldsa_local_attention,
            "based_attention": lambda: load("based-bwd").based_attention,
            "comba_attention": lambda: load("comba-bwd").comba_attention}[name]()


def as_function(name):
    """The op as a function of its first input alone, the others fixed, and that input."""
    _, inputs = CALLS[name]()
    rest = [x.detach() for x in inputs[1:]] + ([2, 2] if name == "ldsa_local_attention" else [])
    op = public_function(name)
    return lambda x: op(x, *rest), inputs[0].detach()


@pytest.mark.kernels_ci
@pytest.mark.parametrize("name", CALLS)
def test_double_backward_raises_naming_the_op(name):
    call, inputs = CALLS[name]()
    o = call()
    grads = torch.autograd.grad(o.square().sum(), inputs, create_graph=True)
    plain = torch.autograd.grad(call().square().sum(), inputs)
    assert all(torch.equal(g, p) for g, p in zip(grads, plain))  # first order with create_graph=True
    with pytest.raises(RuntimeError, match=f"^{name}: double backward is not supported"):
        sum(g.sum() for g in grads).backward()


@pytest.mark.kernels_ci
@pytest.mark.parametrize("name", CALLS)
@pytest.mark.parametrize("transform", ["grad", "jacrev", "jvp"])
def test_torch_func_grad_and_jvp_raise_naming_the_op(name, transform):
    f, x = as_function(name)
    run = {"grad": lambda: torch.func.grad(lambda x: f(x).sum())(x),
           "jacrev": lambda: torch.func.jacrev(f)(x),
           "jvp": lambda: torch.func.jvp(f, (x,), (torch.ones_like(x),))}[transform]
    with pytest.raises(RuntimeError, match=f"^{name}: torch.func's grad and jvp transforms"):
        run()


@pytest.mark.kernels_ci
@pytest.mark.parametrize("name", CALLS)
def test_forward_mode_ad_raises_naming_the_op(name):
    f, x = as_function(name)
    with forward_ad.dual_level(), pytest.raises(RuntimeError, match=f"^{name}: forward-mode AD"):
        f(forward_ad.make_dual(x, torch.ones_like(x)))


@pytest.mark.kernels_ci
@pytest.mark.parametrize("name", CALLS)
def test_torch_func_vmap_matches_a_loop(name):
    f, x = as_function(name)
    xs = torch.stack([x, 2 * x])
    assert torch.equal(torch.func.vmap(f)(xs), torch.stack([f(x), f(2 * x)]))


@pytest.mark.kernels_ci
@pytest.mark.parametrize("name", ["based_attention with a state out", "comba_attention, fla's read order"])
def test_torch_func_grad_through_the_reference_paths(name):
    """The calls that run the reference are torch ops: torch.func.grad gives autograd's gradient, and a double
    backward works."""
    kwargs = {"output_final_state": True} if name.startswith("based") else {"read_order": "fla"}
    call, inputs = (based_call if name.startswith("based") else comba_call)(**kwargs)
    op = public_function(name.split()[0].rstrip(","))
    rest = [x.detach() for x in inputs[1:]]

    def loss(x):
        return first(op(x, *rest, **kwargs)).square().sum()

    x = inputs[0].detach().requires_grad_()
    (want,) = torch.autograd.grad(loss(x), x, create_graph=True)
    assert torch.allclose(torch.func.grad(loss)(x.detach()), want, rtol=1e-6, atol=0)
    want.sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
