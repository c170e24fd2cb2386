"""common/launch.py: a launch keeps its compiled kernel's launcher by specialization, later launches call it with the
arguments the JIT took, and `kept_launcher` binds it for a kept direct call. No GPU here: a stand-in kernel returns a
CompiledKernel whose launcher records its arguments, and stand-in tensors sit on "device 0"."""

from types import SimpleNamespace

import pytest
import torch
import triton
from triton.compiler.compiler import CompiledKernel

from testkit import load, submodule


@pytest.fixture
def launches(monkeypatch):
    """The vendored common.launch of a built kernel, its kept launchers emptied; the current device 0 and its stream
    7 stand in for CUDA's, ("checked", x) for a Triton descriptor of x; and the launcher's and the JIT's calls,
    recorded."""
    module = submodule(load("ldsa"), "common.launch")
    monkeypatch.setattr(module, "_compiled", {})
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)
    monkeypatch.setattr(triton.runtime.driver, "_active", SimpleNamespace(get_current_stream=lambda device: 7))
    host = module._descriptor  # its unchecked descriptors; checked ones (Triton's) stand in as ("checked", x)
    monkeypatch.setattr(module, "_descriptor", lambda x, shape, block, layout=None, checked=True:
                        ("checked", x) if checked else host(x, shape, block, layout, checked=False))
    recorded = SimpleNamespace(run=[], jit=[])
    compiled = CompiledKernel.__new__(CompiledKernel)
    compiled._run = lambda *arguments: recorded.run.append(arguments)
    compiled.function, compiled.packed_metadata, compiled.module = "function", "metadata", None

    class Kernel:
        arg_names = ["x_ptr", "y_desc", "n", "BLOCK"]

        def __getitem__(self, grid):
            return lambda *arguments, **meta: recorded.jit.append((grid, arguments, meta)) or compiled

    return module, Kernel(), recorded


def tensor(dtype=torch.float32, address=64):
    """A stand-in tensor on device 0 at `address` (not CUDA to `devices.on_device`, which then guards nothing)."""
    return SimpleNamespace(dtype=dtype, data_ptr=lambda: address, device=SimpleNamespace(index=0), is_cuda=False)


def test_a_kept_launch_takes_the_arguments_the_jit_took(launches):
    """The first launch goes through the JIT (a checked descriptor); the second, and a kept launcher's, call the
    kept launcher with the tensor, a host descriptor of the row-major view, the integers and the constexprs."""
    module, kernel, recorded = launches
    plan = module.Launch(kernel, 3, (5,), {"BLOCK": 16, "num_stages": 2}, 4, "test", arguments=(0, (1, (2, 8), (1, 8))))
    x, y = tensor(), tensor(torch.bfloat16)
    assert module.kept_launcher(plan, 0, (torch.float32, torch.bfloat16)) is None  # nothing launched yet
    assert module.launch(plan, (x, y)) is None
    assert recorded.jit == [((3,), (x, ("checked", y), 5), {"BLOCK": 16, "num_stages": 2, "num_warps": 4})]
    module.launch(plan, (x, y))
    kept = module.kept_launcher(plan, 0, (torch.float32, torch.bfloat16))
    kept(x, y)
    expected = (3, 1, 1, 7, "function", "metadata", None, None, None, x, module._HostDescriptor(y, (2, 8), (8, 1)), 5,
                16)
    assert recorded.run == [expected, expected] and len(recorded.jit) == 1


def test_a_kept_launcher_is_one_of_its_specialization(launches):
    """Another dtype or a tensor off 16 bytes is another specialization: the JIT launches it, and a kept launcher
    (which serves tensors on 16 bytes) is found only for the dtypes launched on 16 bytes."""
    module, kernel, recorded = launches
    plan = module.Launch(kernel, 1, (5,), {"BLOCK": 16}, 4, "test", arguments=(0, 1))
    module.launch(plan, (tensor(), tensor(address=66)))
    module.launch(plan, (tensor(), tensor(torch.float16)))
    assert len(recorded.jit) == 2 and not recorded.run
    assert module.kept_launcher(plan, 0, (torch.float32, torch.float32)) is None
    assert module.kept_launcher(plan, 0, (torch.float32, torch.float16)) is not None


def test_a_kept_launcher_switches_to_the_jit_for_hooks_and_to_the_tensors_device(launches, monkeypatch):
    """While a launch hook is registered the kept launcher launches through the JIT; with another device current it
    launches under that device's guard."""
    module, kernel, recorded = launches
    plan = module.Launch(kernel, 1, (5,), {"BLOCK": 16}, 4, "test", arguments=(0, 1))
    x, y = tensor(), tensor()
    module.launch(plan, (x, y))
    kept = module.kept_launcher(plan, 0, (torch.float32, torch.float32))
    hook = triton.knobs.runtime.launch_enter_hook
    hook.add(print)
    try:
        kept(x, y)
    finally:
        hook.remove(print)
    assert len(recorded.jit) == 2 and not recorded.run
    guarded = []
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 1, raising=False)
    monkeypatch.setattr(module, "on_device", lambda x: guarded.append(x) or torch.no_grad())
    kept(x, y)
    assert guarded == [x] and len(recorded.run) == 1  # the kept launcher, under the device guard


def test_the_c_launch_takes_what_the_wrapper_would_pass_it(launches):
    """A kept launch of a CUDA launcher hands its C launch function exactly the arguments the launcher's Python
    wrapper (`CudaLauncher.__call__`) would: under Triton 3.6 by calling it past the wrapper, elsewhere through
    the wrapper."""
    from triton.backends.nvidia.driver import CudaLauncher

    module, kernel, recorded = launches
    launcher = CudaLauncher.__new__(CudaLauncher)
    c_calls = []
    launcher.launch = lambda *arguments: c_calls.append(arguments)
    for name, value in dict(global_scratch_size=0, global_scratch_align=1, profile_scratch_size=0,
                            profile_scratch_align=1, launch_cooperative_grid=False, launch_pdl=True, num_ctas=1,
                            arg_annotations="annotations", kernel_signature="signature", gsan_enabled=False).items():
        setattr(launcher, name, value)
    compiled = kernel[(1,)]()  # the stand-in's CompiledKernel
    compiled._run = launcher
    plan = module.Launch(kernel, 3, (5,), {"BLOCK": 16}, 4, "test", arguments=(0, 1))
    x, y = tensor(), tensor()
    module.launch(plan, (x, y))
    module.kept_launcher(plan, 0, (torch.float32, torch.float32))(x, y)
    launcher(3, 1, 1, 7, "function", "metadata", None, None, None, x, y, 5, 16)  # the wrapper, as called before
    assert len(c_calls) == 2 and c_calls[0] == c_calls[1]
    call = next(iter(module._compiled.values()))[0]
    assert (call is launcher.launch) == (module.TRITON_RELEASE == "3.6")
