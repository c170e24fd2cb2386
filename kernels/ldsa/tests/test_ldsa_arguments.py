"""ldsa_local_attention's window sides as users pass them: numpy integers work as Python ints do, and anything
that is not an integral number (a float, a bool, numpy's bool) raises a TypeError naming the side."""

import numpy as np
import pytest
import torch

from testkit import load


@pytest.fixture(scope="module")
def ldsa():
    return load("ldsa")


def window_inputs(left, right):
    gen = torch.Generator().manual_seed(0)
    return torch.randn(1, 2, left + right + 1, 12, generator=gen), torch.randn(1, 2, 4, 12, generator=gen)


@pytest.mark.kernels_ci
@pytest.mark.parametrize("left,right", [(np.int64(2), np.int32(1)), (np.uint8(2), 1)])
def test_numpy_integer_sides_give_the_int_result(ldsa, left, right):
    a, v = window_inputs(2, 1)
    assert torch.equal(ldsa.ldsa_local_attention(a, v, left, right), ldsa.ldsa_local_attention(a, v, 2, 1))


@pytest.mark.kernels_ci
@pytest.mark.parametrize("left,right,name", [(np.float64(2.0), 1, "left"), (2, np.bool_(True), "right"),
                                             (2, "1", "right")])
def test_a_side_that_is_not_an_integer_is_named(ldsa, left, right, name):
    a, v = window_inputs(2, 1)
    with pytest.raises(TypeError, match=f"{name} must be an int"):
        ldsa.ldsa_local_attention(a, v, left, right)


@pytest.mark.kernels_ci
def test_a_negative_numpy_side_is_named(ldsa):
    a, v = window_inputs(2, 1)
    with pytest.raises(ValueError, match="left must be >= 0, got -1"):
        ldsa.ldsa_local_attention(a, v, np.int64(-1), 4)
