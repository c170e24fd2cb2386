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


def test_launches_directly_tests_what_a_kept_call_cannot_prove(direct_calls):
    """Plain contiguous tensors on 16 bytes launch directly; off 16 bytes, non-contiguous, requiring grad under grad
    mode, with a forward-AD level open, under a dispatch mode or a transform they do not."""
    import torch.autograd.forward_ad as forward_ad

    x = torch.ones(4, 4)
    assert direct_calls.launches_directly(x) and direct_calls.launches_directly(x, x)
    assert not direct_calls.launches_directly(x, torch.ones(17)[1:])
    assert not direct_calls.launches_directly(x.t())
    w = torch.ones(4, requires_grad=True)
    assert not direct_calls.launches_directly(x, w)
    with torch.no_grad():
        assert direct_calls.launches_directly(x, w)
    with forward_ad.dual_level():
        assert not direct_calls.launches_directly(x)
    with FakeTensorMode():
        assert not direct_calls.launches_directly(x)
    seen = []
    torch.func.vmap(lambda y: seen.append(direct_calls.launches_directly(x)) or y)(torch.ones(2))
    torch.compile(lambda y: seen.append(direct_calls.launches_directly(x)) or y * 2, backend="eager",
                  fullgraph=False)(torch.ones(2))
    assert seen == [False, False]


def test_direct_calls_keep_calls_only_and_are_bounded(direct_calls):
    calls = direct_calls.DirectCalls(limit=2)
    calls.keep(("a",), None)  # nothing to keep
    assert not calls
    calls.keep(("a",), len)
    calls.keep(("b",), abs)
    assert calls.get(("a",)) is len and calls.get(("b",)) is abs
    calls.keep(("c",), min)  # past the limit it starts over
    assert dict(calls) == {("c",): min}


def test_stream_scratch_is_kept_per_stream_and_thread(direct_calls, monkeypatch):
    """One set of tensors a (stream, thread), fresh ones under graph capture, and a fresh start past the limit."""
    import threading

    stream, capturing = [1], [False]
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: stream[0], raising=False)
    monkeypatch.setattr(torch._C, "_cuda_isCurrentStreamCapturing", lambda: capturing[0], raising=False)
    made = []
    scratch = direct_calls.StreamScratch(0, lambda: made.append(object()) or (made[-1],), limit=3)
    first = scratch()
    assert scratch() is first and len(made) == 1
    stream[0] = 2
    assert scratch() is not first and scratch()[0] is made[1]
    other = []
    thread = threading.Thread(target=lambda: other.append(scratch()))
    thread.start()
    thread.join()
    assert other[0][0] is made[2]  # another thread on stream 2 keeps its own
    capturing[0] = True
    assert scratch()[0] is made[3] and scratch()[0] is made[4]  # under capture: fresh every call
    capturing[0] = False
    stream[0] = 3  # a fourth (stream, thread) pair: past the limit of 3, a fresh start
    assert scratch()[0] is made[5] and len(scratch._kept) == 1
