"""Every kernel's layers satisfy the kernels layer contract, and transformers (pinned with kernels 0.17.2)
keeps its Hub-kernel integration on."""

import inspect

import pytest
from torch import nn

from testkit import load, submodule
from tools.common import all_kernels

KERNELS = all_kernels()


@pytest.fixture
def pinned_transformers():
    """transformers at the version `make` pins (5.20.2-5.22.2); the test skips without it. The GPU machine
    brings its own transformers, or none."""
    from packaging.version import Version

    transformers = pytest.importorskip("transformers")
    if not Version("5.20.2") <= Version(transformers.__version__) <= Version("5.22.2"):
        pytest.skip(f"transformers {transformers.__version__} is outside 5.20.2-5.22.2")
    return transformers


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


def test_transformers_sees_hub_kernels(pinned_transformers):
    """transformers 5.23+ silently disables Hub kernels with kernels 0.17.2; our pins must keep them on."""
    from transformers.utils.import_utils import is_kernels_available

    assert is_kernels_available()


def test_transformers_decorated_module_kernelizes(pinned_transformers):
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


def test_readme_kernelize_pattern_runs_the_kernel_on_cpu():
    """The README's "Layers and `kernelize`" example as written there: one LayerRepository mapped for both
    "cuda" and "cpu", kernelize with the device given and the default fallback. On the CPU the host forward
    is replaced by the package's layer, which runs the eager reference, in the forward and in the backward."""
    import torch
    from kernels import LayerRepository, Mode, kernelize, use_kernel_forward_from_hub, use_kernel_mapping

    @use_kernel_forward_from_hub("LDSAWindow")
    class LDSAWindow(nn.Module):
        def __init__(self, left, right):
            super().__init__()
            self.left, self.right = left, right

        def forward(self, a_logits, v):
            raise AssertionError("the kernel's forward should have replaced the host's")

    model = nn.Sequential()
    model.add_module("window", LDSAWindow(4, 2))

    ldsa = LayerRepository("tessera/ldsa", layer_name="LDSAWindow", version=1, trust_remote_code=True)
    mapping = {"LDSAWindow": {"cuda": ldsa, "cpu": ldsa}}
    device = "cpu"  # the README's `"cuda" if torch.cuda.is_available() else "cpu"` on a machine without a GPU
    with use_kernel_mapping(mapping):
        model = kernelize(model, mode=Mode.TRAINING, device=device)

    kernel = load("ldsa")
    assert model.window.forward.__func__ is kernel.layers.LDSAWindow.forward
    reference = submodule(kernel, "reference").ldsa_forward_reference
    a = torch.randn(2, 3, 7, 19, requires_grad=True)
    v = torch.randn(2, 3, 8, 19, requires_grad=True)
    out = model.window(a, v)
    assert torch.equal(out, reference(a, v, 4, 2))
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (a, v), grad)
    want = torch.autograd.grad(reference(a, v, 4, 2), (a, v), grad)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
