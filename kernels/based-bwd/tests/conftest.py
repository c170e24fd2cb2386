"""The fixtures every based-bwd test file shares: the kernel loaded from the local Hub cache as model code loads it,
and its dispatch module."""

import pytest

from testkit import load, submodule


@pytest.fixture(scope="module")
def based():
    return load("based-bwd")


@pytest.fixture(scope="module")
def dispatch(based):
    return submodule(based, "dispatch")
