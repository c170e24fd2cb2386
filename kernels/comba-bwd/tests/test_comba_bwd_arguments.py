"""comba_backward's and comba_attention's `scale` as users pass it: numpy scalars work as Python numbers do; a
bool, a string or a tensor raises a TypeError naming `scale`."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F


def inputs(B=1, T=16, H=2, K=8, V=8):
    gen = torch.Generator().manual_seed(0)
    q, v, do = torch.randn(B, T, H, K, generator=gen), torch.randn(B, T, H, V, generator=gen), torch.randn(B, T, H, V)
    k, p = (F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1) for _ in range(2))
    beta = torch.rand(B, T, H, generator=gen).sigmoid()
    g = F.logsigmoid(torch.randn(B, T, H, generator=gen)) / 4
    return q, k, v, p, beta, g, do


@pytest.mark.kernels_ci
@pytest.mark.parametrize("scale", [np.float32(0.5), np.float64(0.5), np.int64(1)])
def test_numpy_scale_gives_the_float_result(comba, scale):
    x = inputs()
    assert torch.equal(comba.comba_attention(*x[:6], scale=scale), comba.comba_attention(*x[:6], scale=float(scale)))
    ours, expected = comba.comba_backward(*x, scale=scale), comba.comba_backward(*x, scale=float(scale))
    assert all(torch.equal(a, b) for a, b in zip(ours, expected))


@pytest.mark.kernels_ci
@pytest.mark.parametrize("scale", [np.bool_(True), "0.5", torch.tensor(0.5)])
def test_a_scale_that_is_not_a_real_number_is_named(comba, scale):
    with pytest.raises(TypeError, match="scale must be a float or None"):
        comba.comba_backward(*inputs(), scale=scale)
