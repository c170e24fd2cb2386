"""ldsa through `get_kernel`: the reference against an independent float64 computation, autograd, the
registered ops (opcheck, torch.compile), bad input, and the fused path against the reference on CUDA."""

import pytest
import torch

from testkit import HAS_CUDA, load, needs_cuda, rel_err

WINDOWS = [(0, 0), (14, 0), (7, 7), (3, 11), (0, 5), (31, 31), (64, 0)]
DEVICES = ["cpu"] + (["cuda"] if HAS_CUDA else [])


@pytest.fixture(scope="module")
def ldsa():
    return load("ldsa")


def ldsa_float64(a_logits, v, left, right):
    """out = einsum over the unfolded window: a different construction from the package's shifted sums."""
    a = torch.softmax(a_logits.double(), dim=2)
    windows = torch.nn.functional.pad(v.double(), (left, right)).unfold(-1, left + right + 1, 1)  # B,H,Dh,T,W
    return torch.einsum("bhkt,bhdtk->bhdt", a, windows)


def make(B, H, Dh, T, left, right, dtype=torch.float32, device="cpu", requires_grad=False):
    a = (2 * torch.randn(B, H, left + right + 1, T, device=device)).to(dtype).requires_grad_(requires_grad)
    v = torch.randn(B, H, Dh, T, device=device).to(dtype).requires_grad_(requires_grad)
    return a, v


@pytest.mark.kernels_ci
@pytest.mark.parametrize("left,right", WINDOWS)
@pytest.mark.parametrize("T", [1, 5, 97])
def test_reference_matches_float64(ldsa, left, right, T):
    a, v = make(2, 3, 8, T, left, right)
    assert rel_err(ldsa.ldsa_forward_reference(a, v, left, right), ldsa_float64(a, v, left, right)) < 1e-6


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2), (torch.float16, 2e-3)])
@pytest.mark.parametrize("device", DEVICES)
def test_public_op_dtypes(ldsa, dtype, tol, device):
    a, v = make(2, 2, 32, 301, 14, 0, dtype, device)
    out = ldsa.ldsa_local_attention(a, v, 14, 0)
    assert out.dtype == dtype and out.shape == v.shape and out.device == v.device
    assert rel_err(out, ldsa_float64(a, v, 14, 0)) < tol


@pytest.mark.kernels_ci
@pytest.mark.parametrize("left,right", [(14, 0), (7, 7), (2, 9)])
def test_backward_reference_matches_float64_autograd(ldsa, left, right):
    a, v = make(2, 2, 8, 37, left, right)
    go = torch.randn_like(v)
    a64, v64 = a.double().requires_grad_(), v.double().requires_grad_()
    ldsa_float64(a64, v64, left, right).backward(go.double())
    dlogits, dv = ldsa.ldsa_backward_reference(a, v, go, left, right)
    assert rel_err(dlogits, a64.grad) < 1e-5
    assert rel_err(dv, v64.grad) < 1e-5


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_autograd_through_public_op(ldsa, device, dtype, tol):
    a, v = make(2, 2, 16, 130, 3, 4, dtype, device, requires_grad=True)
    go = torch.randn_like(v)
    ldsa.ldsa_local_attention(a, v, 3, 4).backward(go)
    a64, v64 = a.detach().double().requires_grad_(), v.detach().double().requires_grad_()
    ldsa_float64(a64, v64, 3, 4).backward(go.double())
    assert a.grad.dtype == dtype and v.grad.dtype == dtype
    assert rel_err(a.grad, a64.grad) < tol
    assert rel_err(v.grad, v64.grad) < tol


@pytest.mark.kernels_ci
def test_opcheck(ldsa):
    a, v = make(2, 2, 8, 23, 2, 3, requires_grad=True)
    torch.library.opcheck(ldsa.op.ldsa_forward, (a, v, 2, 3))
    go = torch.randn_like(v)
    torch.library.opcheck(ldsa.op.ldsa_backward, (a.detach(), v.detach(), go, 2, 3))


def test_torch_compile_fullgraph(ldsa):
    a, v = make(2, 2, 8, 40, 5, 1, requires_grad=True)

    def step(a, v):
        return (ldsa.ldsa_local_attention(a, v, 5, 1) ** 2).sum()

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True)
    compiled(a, v).backward()
    ga, gv = a.grad.clone(), v.grad.clone()
    a.grad = v.grad = None
    step(a, v).backward()
    assert rel_err(ga, a.grad) < 1e-6 and rel_err(gv, v.grad) < 1e-6


def test_noncontiguous_inputs_are_copied(ldsa):
    a, v = make(2, 2, 8, 30, 4, 0)
    vt = v.transpose(2, 3).contiguous().transpose(2, 3)
    assert not vt.is_contiguous()
    assert torch.equal(ldsa.ldsa_local_attention(a, vt, 4, 0), ldsa.ldsa_local_attention(a, v, 4, 0))


BAD = [
    (lambda a, v: (a.double(), v, 2, 1), TypeError, "a_logits"),
    (lambda a, v: (a, v.int(), 2, 1), TypeError, "v must be"),
    (lambda a, v: (a[0], v, 2, 1), ValueError, "a_logits must have rank 4"),
    (lambda a, v: (a, v[..., :-1], 2, 1), ValueError, "v must be"),
    (lambda a, v: (a, v[:1], 2, 1), ValueError, "v must be"),
    (lambda a, v: (a, v, 2, 2), ValueError, "W=4 must equal left \\+ right \\+ 1 = 5"),
    (lambda a, v: (a, v, -1, 4), ValueError, "left must be >= 0"),
    (lambda a, v: (a, v, 2, 1.0), TypeError, "right must be an int"),
    (lambda a, v: (a, v, True, 2), TypeError, "left must be an int"),
    (lambda a, v: (a.numpy(), v, 2, 1), TypeError, "a_logits must be a torch.Tensor"),
    (lambda a, v: (a[..., :0], v[..., :0], 2, 1), ValueError, "every size must be >= 1"),
]


@pytest.mark.kernels_ci
@pytest.mark.parametrize("bad,exc,match", BAD)
def test_bad_input_raises(ldsa, bad, exc, match):
    a, v = make(2, 2, 8, 16, 2, 1)
    with pytest.raises(exc, match=match):
        ldsa.ldsa_local_attention(*bad(a, v))


@needs_cuda
def test_inputs_on_different_devices_raise(ldsa):
    a, v = make(1, 1, 8, 16, 2, 1)
    with pytest.raises(ValueError, match="one device"):
        ldsa.ldsa_local_attention(a.cuda(), v, 2, 1)
