"""Every kernel's layers satisfy the kernels layer contract, and transformers (pinned with kernels 0.17.2)
keeps its Hub-kernel integration on."""

import inspect

import pytest
from torch import nn

from testkit import load
from tools.common import all_kernels

KERNELS = all_kernels()


def _transformers_is_pinned() -> bool:
    from importlib.metadata import version

    from packaging.version import Version

    return Version("5.20.2") <= Version(version("transformers")) <= Version("5.22.2")


# The GPU machine brings its own transformers; these check the environment `make` pins.
pinned_transformers = pytest.mark.skipif(not _transformers_is_pinned(), reason="transformers outside 5.20.2-5.22.2")


@pytest.mark.kernels_ci
@pytest.mark.parametrize("kernel", KERNELS, ids=lambda k: k.name)
def test_layers_follow_the_contract(kernel):
    layers = load(kernel.name).layers
    classes = [c for _, c in inspect.getmembers(layers, inspect.isclass)
               if issubclass(c, nn.Module) and c.__module__ == layers.__name__]
    assert classes, f"{kernel.name}.layers defines no layer"
    for cls in classes:
        assert cls.__init__ is nn.Module.__init__, f"{cls.__name__} must not define __init__"
        extra = set(dir(cls)) - set(dir(nn.Module))
        assert extra <= {"can_torch_compile", "has_backward"}, f"{cls.__name__} has extra members {extra}"
        assert cls.can_torch_compile is True


@pinned_transformers
def test_transformers_sees_hub_kernels():
    """transformers 5.23+ silently disables Hub kernels with kernels 0.17.2; our pins must keep them on."""
    from transformers.utils.import_utils import is_kernels_available

    assert is_kernels_available()


@pinned_transformers
def test_transformers_decorated_module_kernelizes():
    """A host module decorated with transformers' own decorator is replaced by our layer through kernelize."""
    import torch
    from kernels import LayerRepository, Mode, kernelize, use_kernel_mapping
    from transformers.integrations import use_kernel_forward_from_hub

    @use_kernel_forward_from_hub("LDSAWindow")
    class Window(nn.Module):
        def __init__(self, left, right):
            super().__init__()
            self.left, self.right = left, right

        def forward(self, a_logits, v):
            raise AssertionError("the kernel's forward should have replaced this one")

    model = nn.Sequential()
    model.add_module("window", Window(3, 1))
    mapping = {"LDSAWindow": {"cpu": LayerRepository("tessera/ldsa", layer_name="LDSAWindow", version=1,
                                                     trust_remote_code=True)}}
    with use_kernel_mapping(mapping, inherit_mapping=False):
        kernelize(model, mode=Mode.INFERENCE, device="cpu", use_fallback=False)
    a, v = torch.randn(2, 2, 5, 11), torch.randn(2, 2, 4, 11)
    ldsa = load("ldsa")
    assert torch.equal(model.window(a, v), ldsa.ldsa_local_attention(a, v, 3, 1))
