"""The host path of `ldsa_local_attention`: an eager call on plain CUDA tensors without autograd runs
`ldsa_forward_cuda` without the registered op (`common.direct_calls.calls_directly`), its argument checks skipped
for a call signature that passed them before. On the CPU the direct route is taken by patching the decision, and runs
the Triton kernels under the interpreter."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from testkit import HAS_CUDA, load, needs_cuda, needs_triton, recorded_launches, rel_err, submodule

DEVICE = "cuda" if HAS_CUDA else "cpu"


@pytest.fixture(scope="module")
def ldsa():
    return load("ldsa")


@pytest.fixture
def direct(ldsa, monkeypatch):
    """The op module with every call routed directly to the entry point, the registered op refusing to run."""
    op = submodule(ldsa, "op")
    monkeypatch.setattr(op, "calls_directly", lambda *tensors: True)

    def refuse(*args):
        raise AssertionError("the registered op ran")

    monkeypatch.setattr(op, "ldsa_forward_op", refuse)
    return op


def make(B, H, Dh, T, left, right, dtype=torch.float32, device=DEVICE):
    g = torch.Generator().manual_seed(0)
    a = (2 * torch.randn(B, H, left + right + 1, T, generator=g)).to(device, dtype)
    v = torch.randn(B, H, Dh, T, generator=g).to(device, dtype)
    return a, v


def float64_window(a_logits, v, left, right):
    """out = einsum over the unfolded window, in float64."""
    a = torch.softmax(a_logits.double().cpu(), dim=2)
    windows = torch.nn.functional.pad(v.double().cpu(), (left, right)).unfold(-1, left + right + 1, 1)
    return torch.einsum("bhkt,bhdtk->bhdt", a, windows)


@needs_triton
def test_direct_route_runs_the_entry_point(ldsa, direct):
    a, v = make(1, 2, 16, 40, 3, 2, torch.bfloat16)
    out = ldsa.ldsa_local_attention(a, v, 3, 2)
    assert out.dtype == torch.bfloat16 and rel_err(out.cpu(), float64_window(a, v, 3, 2)) < 1e-2


BAD = [
    (lambda a, v: (a.double(), v, 2, 1), TypeError, "a_logits"),
    (lambda a, v: (a, v[..., :-1], 2, 1), ValueError, "v must be"),
    (lambda a, v: (a, v, 2, 2), ValueError, "W=4 must equal left \\+ right \\+ 1 = 5"),
    (lambda a, v: (a, v, True, 1), TypeError, "left must be an int"),
    (lambda a, v: (a, v, 2, 1.0), TypeError, "right must be an int"),
]


@pytest.mark.kernels_ci
@pytest.mark.parametrize("bad,exc,match", BAD)
def test_direct_route_raises_as_the_op_does(ldsa, direct, bad, exc, match):
    """With the good call's signature remembered, a bad one of the same tensors still raises the checks' error."""
    a, v = make(1, 2, 8, 16, 2, 1, device="cpu")
    submodule(ldsa, "op")._check_args_once(a, v, 2, 1)
    with pytest.raises(exc, match=match):
        ldsa.ldsa_local_attention(*bad(a, v))


@pytest.mark.kernels_ci
@pytest.mark.parametrize("dual", [0, 1])
def test_direct_route_refuses_forward_mode_ad(ldsa, direct, dual):
    """A dual tensor reaches the direct route (no transform or compiler intercepts it): it raises there too, before
    any launch."""
    import torch.autograd.forward_ad as forward_ad

    tensors = list(make(1, 2, 8, 16, 2, 1, device="cpu"))
    with forward_ad.dual_level():
        tensors[dual] = forward_ad.make_dual(tensors[dual], torch.ones_like(tensors[dual]))
        with pytest.raises(RuntimeError, match="^ldsa_local_attention: forward-mode AD"):
            ldsa.ldsa_local_attention(*tensors, 2, 1)


@pytest.mark.kernels_ci
def test_a_signature_seen_before_skips_the_checks(ldsa, monkeypatch):
    """Every change the checks read (dtype, shape, device, window) checks again; the same call does not."""
    op = submodule(ldsa, "op")
    count = []
    check = op.check_ldsa_args
    monkeypatch.setattr(op, "check_ldsa_args", lambda *args: count.append(1) or check(*args))
    monkeypatch.setattr(op, "_checked", type(op._checked)())
    a, v = make(1, 2, 8, 16, 2, 1, device="cpu")
    calls = [(a, v, 2, 1), (a.half(), v, 2, 1), (a, v.half(), 2, 1), (a[..., :8], v[..., :8], 2, 1),
             (a.to("meta"), v.to("meta"), 2, 1), (a, v, 1, 2)]
    for i, args in enumerate(calls):
        for _ in range(2):
            op._check_args_once(*args)
        assert len(count) == i + 1


@pytest.mark.kernels_ci
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_kept_direct_call_launches_what_the_first_call_did(ldsa, monkeypatch, dtype):
    """From a signature's second call on, the kept direct call (`dispatch.DIRECT_FORWARDS`) launches the kernel the
    entry point launched, with the same arguments, without the entry point (CUDA's path, taken on CPU tensors under
    `tools.host_time`'s stubs)."""
    op = submodule(ldsa, "op")
    a, v = make(2, 2, 16, 40, 3, 2, dtype, device="cpu")
    entry = op.ldsa_forward_cuda
    entered = []
    monkeypatch.setattr(op, "ldsa_forward_cuda", lambda *args: entered.append(1) or entry(*args))
    with torch.no_grad():
        first, kept, again = recorded_launches(ldsa, lambda: ldsa.ldsa_local_attention(a, v, 3, 2), calls=3)
    assert len(first) == 1 and kept == first and again == first and entered == [1]
    assert first[0][9:12] == ((dtype, (2, 2, 6, 40)), (dtype, (2, 2, 16, 40)), (dtype, (2, 2, 16, 40)))
    assert not submodule(ldsa, "dispatch").DIRECT_FORWARDS  # forgotten with the stubs


@pytest.mark.kernels_ci
def test_calls_the_kept_direct_call_cannot_prove_take_the_other_routes(ldsa, monkeypatch):
    """A signature's later call that is off 16 bytes or non-contiguous takes the entry point; one that requires grad
    or runs under a dispatch mode the registered op (here the CPU reference, which launches nothing): none takes the
    kept direct call."""
    op = submodule(ldsa, "op")
    a, v = make(2, 2, 16, 41, 3, 2, torch.bfloat16, device="cpu")
    entry = op.ldsa_forward_cuda
    entered = []
    monkeypatch.setattr(op, "ldsa_forward_cuda", lambda *args: entered.append(1) or entry(*args))
    off = torch.empty(2 * 2 * 16 * 41 + 1, dtype=torch.bfloat16)[1:].view(2, 2, 16, 41).copy_(v)
    strided = torch.empty(2, 2, 16, 82, dtype=torch.bfloat16)[..., ::2].copy_(v)
    grad = v.clone().requires_grad_()

    def calls():
        ldsa.ldsa_local_attention(a, v, 3, 2)
        ldsa.ldsa_local_attention(a, off, 3, 2)
        ldsa.ldsa_local_attention(a, strided, 3, 2)
        ldsa.ldsa_local_attention(a, grad, 3, 2)
        with FlopCounterMode(display=False):
            ldsa.ldsa_local_attention(a, v, 3, 2)

    first, second = recorded_launches(ldsa, calls)
    assert len(first) == len(second) == 3 and entered == [1, 1, 1, 1, 1]  # the second round's first call is kept


@pytest.mark.kernels_ci
def test_the_eager_backward_launches_without_the_registered_op(ldsa, monkeypatch):
    """autograd's backward of an eager call runs `ldsa_backward_cuda` directly (CUDA's path, taken on CPU tensors
    under `tools.host_time`'s stubs, the forward's registered op running the CPU reference); with create_graph it
    takes the registered backward op, whose reference launches nothing."""
    op = submodule(ldsa, "op")
    monkeypatch.setattr(op, "ldsa_backward_op", lambda *args: pytest.fail("the registered backward op ran"))
    a, v = (x.requires_grad_() for x in make(1, 2, 16, 40, 3, 2, torch.bfloat16, device="cpu"))
    (launches,) = recorded_launches(ldsa, lambda: ldsa.ldsa_local_attention(a, v, 3, 2).sum().backward(), calls=1)
    assert len(launches) == 1 and a.grad.shape == a.shape and v.grad.shape == v.shape
    assert launches[0][9:14] == ((torch.bfloat16, tuple(a.shape)), (torch.bfloat16, tuple(v.shape)),
                                 (torch.bfloat16, tuple(v.shape)), (torch.bfloat16, tuple(a.shape)),
                                 (torch.bfloat16, tuple(v.shape)))
    monkeypatch.undo()
    (launches,) = recorded_launches(ldsa, lambda: torch.autograd.grad(ldsa.ldsa_local_attention(a, v, 3, 2).sum(),
                                                                      (a, v), create_graph=True), calls=1)
    assert launches == []


@needs_cuda
@pytest.mark.parametrize("B,T", [(16, 256), (16, 3000)])
def test_cuda_kept_direct_calls_give_the_entry_points_results(ldsa, B, T):
    """Back-to-back kept direct calls of one signature on changing inputs (at [16, 3000] a TMA-fed plan on Hopper)
    give what the entry point gives on each; an input off 16 bytes takes the entry point and gives its result."""
    dispatch = submodule(ldsa, "dispatch")
    inputs = [make(B, 8, 64, T, 14, 0, torch.bfloat16) for _ in range(2)]
    for a, v in inputs:
        v.mul_(torch.rand(()).item() + 0.5)
    expected = [dispatch.ldsa_forward_cuda(a, v, 14, 0) for a, v in inputs]
    dispatch.DIRECT_FORWARDS.clear()
    with torch.no_grad():
        ldsa.ldsa_local_attention(*inputs[0], 14, 0)
        assert len(dispatch.DIRECT_FORWARDS) == 1
        outs = [ldsa.ldsa_local_attention(a, v, 14, 0) for a, v in inputs * 3]
        a, v = inputs[1]
        shifted = torch.empty(v.numel() + 8, dtype=v.dtype, device="cuda")[1:1 + v.numel()].view(v.shape).copy_(v)
        off = ldsa.ldsa_local_attention(a, shifted, 14, 0)
    torch.cuda.synchronize()
    assert all(torch.equal(out, expected[i % 2]) for i, out in enumerate(outs))
    assert rel_err(off, expected[1]) < 1e-2


@needs_cuda
def test_cuda_graph_capture_replays_the_direct_route(ldsa):
    a, v = make(16, 8, 64, 256, 14, 0, torch.bfloat16)
    ldsa.ldsa_local_attention(a, v, 14, 0)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = ldsa.ldsa_local_attention(a, v, 14, 0)
    v.copy_(v.flip(0))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, ldsa.ldsa_local_attention(a, v, 14, 0))
