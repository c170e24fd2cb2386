"""The fixtures every comba-bwd test file shares: the kernel loaded from the local Hub cache as model code loads it,
and its dispatch module."""

import pytest

from testkit import load, submodule


@pytest.fixture(scope="module")
def comba():
    return load("comba-bwd")


@pytest.fixture(scope="module")
def dispatch(comba):
    return submodule(comba, "dispatch")
