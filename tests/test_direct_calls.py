"""common/direct_calls.py: when an eager call may skip its registered op, and the checked call signatures."""

import importlib.util
import sys

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from testkit import HAS_CUDA
from tools.common import REPO_ROOT


@pytest.fixture(scope="module")
def direct_calls():
    spec = importlib.util.spec_from_file_location("tessera_direct_calls", REPO_ROOT / "common" / "direct_calls.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # where torch.compile looks a traced function's module up
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


def seen_inside(transform, direct_calls) -> bool:
    """What `nothing_intercepts` says inside `transform` of a function of one tensor."""
    seen = []

    def probe(x):
        seen.append(direct_calls.nothing_intercepts())
        return x * 2

    transform(probe)(torch.ones(3))
    return seen[0]


def test_nothing_intercepts_a_plain_eager_call(direct_calls):
    assert direct_calls.nothing_intercepts()
    with torch.no_grad():
        assert direct_calls.nothing_intercepts()


@pytest.mark.parametrize("transform", [
    lambda f: torch.compile(f, fullgraph=True, backend="eager"),
    lambda f: (lambda x: torch.jit.trace(f, (x,))),
    torch.func.vmap,
    lambda f: torch.func.grad(lambda x: f(x).sum()),
], ids=["compile", "jit-trace", "vmap", "grad"])
def test_tracers_and_transforms_intercept(direct_calls, transform):
    assert not seen_inside(transform, direct_calls)


def test_dispatch_modes_intercept(direct_calls):
    with FakeTensorMode():
        assert not direct_calls.nothing_intercepts()
    with torch.utils.flop_counter.FlopCounterMode(display=False):
        assert not direct_calls.nothing_intercepts()


def test_only_plain_cuda_tensors_call_directly(direct_calls):
    assert not direct_calls.calls_directly(torch.ones(2))  # the CPU runs the registered op's reference
    assert not direct_calls.calls_directly(torch.ones(2, device="meta"))
    with FakeTensorMode() as mode:
        fake = mode.from_tensor(torch.ones(2))
    assert not direct_calls.calls_directly(fake)


@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_cuda_calls_directly_unless_autograd_records_it(direct_calls):
    x = torch.ones(2, device="cuda")
    w = torch.ones(2, device="cuda", requires_grad=True)
    assert direct_calls.calls_directly(x) and direct_calls.calls_directly(x, x)
    assert not direct_calls.calls_directly(x, w)
    with torch.no_grad():
        assert direct_calls.calls_directly(x, w)
    assert not direct_calls.calls_directly(x, torch.ones(2))  # one CPU tensor: the op decides
    assert not direct_calls.calls_directly(x, torch.nn.Parameter(torch.ones(2, device="cuda")))  # a subclass


def test_checked_signatures_are_bounded(direct_calls):
    checked = direct_calls.CheckedSignatures(limit=2)
    checked.add(("a",))
    checked.add(("b",))
    assert ("a",) in checked and ("b",) in checked and ("c",) not in checked
    checked.add(("c",))  # past the limit the set starts over
    assert len(checked) == 1 and ("c",) in checked and ("a",) not in checked


def test_stage_module_imports_once(direct_calls):
    import json.decoder

    direct_calls.stage_module.cache_clear()
    assert direct_calls.stage_module("json", "decoder") is json.decoder
    assert direct_calls.stage_module("json", "decoder") is json.decoder
    info = direct_calls.stage_module.cache_info()
    assert info.misses == 1 and info.hits == 1
