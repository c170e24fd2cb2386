"""based_backward's `scale` as users pass it: numpy scalars work as Python numbers do; a bool, a string or a
tensor raises a TypeError naming `scale`."""

import numpy as np
import pytest
import torch


def inputs():
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(1, 16, 2, n, generator=gen) for n in (8, 8, 8, 8)]


@pytest.mark.kernels_ci
@pytest.mark.parametrize("scale", [np.float32(0.25), np.float64(0.25), np.int64(1)])
def test_numpy_scale_gives_the_float_result(based, scale):
    q, k, v, do = inputs()
    ours = based.based_backward(q, k, v, do, scale=scale)
    expected = based.based_backward(q, k, v, do, scale=float(scale))
    assert all(torch.equal(a, b) for a, b in zip(ours, expected))


@pytest.mark.kernels_ci
@pytest.mark.parametrize("scale", [np.bool_(True), "0.25", torch.tensor(0.25)])
def test_a_scale_that_is_not_a_real_number_is_named(based, scale):
    with pytest.raises(TypeError, match="scale must be a float or None"):
        based.based_backward(*inputs(), scale=scale)


@pytest.mark.kernels_ci
def test_a_non_finite_numpy_scale_is_named(based):
    with pytest.raises(ValueError, match="scale must be finite"):
        based.based_backward(*inputs(), scale=np.float32("inf"))
