"""The L2 normalisation of a model's q, k and p and the last step of its backward (`portable.l2norm`), in Triton (the
interpreter on the CPU): the normalised tensors against float64 math in bf16, fp16 and fp32, and the gradients of the
raw inputs from per-value-head fp32 gradients (summed over each group of value heads, with and without the
normalisation's backward) against float64 autograd, a zero row included (its norm is sqrt(eps): finite)."""

import pytest
import torch

from testkit import HAS_CUDA, needs_triton, rel_err, submodule

DEVICE = "cuda" if HAS_CUDA else "cpu"
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
EPS = 1e-6
# An element's tolerance relative to its float64 value: the rounding to the output dtype, plus fp32 arithmetic (and
# below the dtype's smallest normal, the step of its subnormals).
ROUNDING = {torch.bfloat16: 2**-8, torch.float16: 2**-10, torch.float32: 2**-20}


@pytest.fixture(scope="module")
def l2norm(comba):
    pytest.importorskip("triton")
    return submodule(comba, "portable.l2norm")


def keys(B, T, H, K, dtype, seed):
    """q, k, p (B, T, H, K) in `dtype` with rows of norms from 0.01 to 100, and q's row (0, 1, 0) all zeros."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(3):
        x = torch.randn(B, T, H, K, generator=gen) * 10 ** (4 * torch.rand(B, T, H, 1, generator=gen) - 2)
        out.append(x)
    out[0][0, 1, 0] = 0.0
    return [x.to(device=DEVICE, dtype=dtype) for x in out]


def normalised64(x: torch.Tensor) -> torch.Tensor:
    return x / (x * x).sum(-1, keepdim=True).add(EPS).sqrt()


@needs_triton
@pytest.mark.kernels_ci
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("K", [64, 128])
def test_forward_matches_float64(l2norm, dtype, K):
    """q, k and p normalised in one launch, in their dtype, each element within its dtype's rounding of float64; the
    zero row stays zero; the last block of rows is partial (T H is not a multiple of the block)."""
    q, k, p = keys(2, 5, 3, K, dtype, seed=K)
    out = l2norm.launch_forward(q, k, p)
    for x, y in zip((q, k, p), out):
        assert y.dtype == dtype and y.shape == x.shape
        y64 = normalised64(x.double().cpu())
        subnormal_step = torch.finfo(dtype).smallest_normal * torch.finfo(dtype).eps
        assert ((y.double().cpu() - y64).abs() <= ROUNDING[dtype] * y64.abs() + subnormal_step).all()
    assert torch.equal(out[0][0, 1, 0], torch.zeros_like(out[0][0, 1, 0]))


@needs_triton
@pytest.mark.kernels_ci
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("normalise", [True, False])
def test_backward_matches_float64(l2norm, dtype, group, normalise):
    """dq, dk, dp of the raw inputs from fp32 gradients per value head (HV = group H): the sum over each group, through
    the normalisation's backward where the call normalised, against float64 autograd through x / sqrt(sum(x^2) + eps)
    (the group sum alone otherwise); in q's dtype; the zero row's gradient is dy / sqrt(eps), finite."""
    B, T, H, K = 1, 6, 2, 64
    x = keys(B, T, H, K, dtype, seed=7 + group)
    gen = torch.Generator().manual_seed(group)
    heads = [torch.randn(B, T, H * group, K, generator=gen).to(DEVICE) for _ in range(3)]
    got = l2norm.launch_backward(*x, *heads, normalise)
    for xi, dy, dx in zip(x, heads, got):
        assert dx.dtype == dtype and dx.shape == xi.shape
        dy64 = dy.double().cpu().view(B, T, H, group, K).sum(3)
        if normalise:
            x64 = xi.double().cpu().requires_grad_()
            ref = torch.autograd.grad((normalised64(x64) * dy64).sum(), x64)[0]
        else:
            ref = dy64
        assert dx.isfinite().all()
        assert rel_err(dx, ref) < 4 * ROUNDING[dtype]
    zero = got[0][0, 1, 0].double().cpu()
    dy_zero = heads[0].double().cpu().view(B, T, H, group, K).sum(3)[0, 1, 0]
    expected = dy_zero / EPS**0.5 if normalise else dy_zero
    assert rel_err(zero, expected) < 4 * ROUNDING[dtype]
