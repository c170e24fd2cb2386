"""Helpers shared by every test: loading kernels the way model code does, the specs, the error metric (the last
two from tools.specs, where the tools find them too).

Tests never `import <pkg>`: they load the built kernel through `kernels.get_kernel` from the local Hub
cache (`make hub`), or from `LOCAL_KERNELS` when that is set, exactly as a user would.
"""

import functools
import os
from pathlib import Path

import pytest
import torch

from tools import specs
from tools.specs import has_spec, rel_err  # noqa: F401 - the tests take them from here

REPO_ROOT = Path(__file__).resolve().parent
ORG = os.environ.get("TESSERA_HUB_ORG", "tessera")
HAS_CUDA = torch.cuda.is_available()
# The variant the kernels loader picks follows the torch build, not the presence of a GPU.
BACKEND = "cuda" if torch.version.cuda else "cpu"
# Triton runs on CPU tensors through its interpreter; on a GPU machine the kernels run for real.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
# Triton kernels run on a GPU, or on CPU tensors under the interpreter.
needs_triton = pytest.mark.skipif(not (HAS_CUDA or INTERPRETED), reason="needs CUDA or TRITON_INTERPRET=1")


@functools.cache
def load(name: str, version: int = 1):
    from kernels import get_kernel

    return get_kernel(f"{ORG}/{name}", version=version, trust_remote_code=True)


def submodule(kernel, name: str):
    """A module of a loaded kernel that its __init__ does not import (the Triton launchers)."""
    import importlib

    return importlib.import_module(f"{kernel.__name__}.{name}")


def spec(name: str):
    """A spec of the specs folder as callables (`tools.specs.spec`); skips the calling test where the specs are
    not beside the checkout."""
    if not has_spec(name):
        pytest.skip(f"spec {name} not found in {specs.folder()}")
    return specs.spec(name)


def recorded_launches(kernel, call, calls: int = 2) -> list:
    """The launches of `calls` back-to-back calls of `call()` (a public function of `kernel` on CPU tensors) on the
    eager CUDA path, under `tools.host_time`'s stubs, each call's launches as one list of kept-launcher arguments:
    (programs, 1, 1, stream, function, four Nones, *tensors, *integers and constexprs), each tensor
    written as (dtype, shape). The first call plans and keeps; the later ones show what a kept direct call (or a
    kept launcher) launches."""
    from tools import host_time

    launches = []
    stub = host_time._stub_launcher

    def record(*arguments):
        launches[-1].append(tuple((x.dtype, tuple(x.shape)) if isinstance(x, torch.Tensor) else x for x in arguments))

    host_time._stub_launcher = record
    try:
        with host_time.cuda_stubs(submodule(kernel, "common.launch")):
            for _ in range(calls):
                launches.append([])
                call()
    finally:
        host_time._stub_launcher = stub
    return launches


def interpreted_kept_launches(kernel, stage: str, monkeypatch) -> None:
    """The kept launchers that stage module `stage` of `kernel` asks `common.launch.kept_launcher` for (none under
    Triton's interpreter, where nothing is kept) made to launch their plan through `common.launch.launch`: a kept
    direct call then runs its kernel on CPU tensors in the interpreter, and its results can be checked."""
    launch = submodule(kernel, "common.launch").launch
    monkeypatch.setattr(submodule(kernel, stage), "kept_launcher",
                        lambda plan, device, dtypes: lambda *tensors: launch(plan, tensors))


def entry_calls(kernel, entry: str, monkeypatch) -> list:
    """A list that grows by one at each call of the CUDA entry point `op.<entry>` from the public function, with the
    package's kept direct decodes (`op.DIRECT_DECODES`) cleared, so that no call signature starts out kept."""
    op = submodule(kernel, "op")
    op.DIRECT_DECODES.clear()
    calls = []
    called = getattr(op, entry)
    monkeypatch.setattr(op, entry, lambda *args: calls.append(1) or called(*args))
    return calls


def sequences(x: torch.Tensor, cu: torch.Tensor | None, per_position: bool) -> list:
    """x cut into its sequences: the packed sequences of a per-position tensor of a packed call (`cu` its
    sequence boundaries), else the batch rows."""
    if cu is None or not per_position:
        return list(x)
    return [x[0, a:b] for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())]


def patch_interpreter() -> None:
    """Fixes to Triton 3.6's interpreter so that kernels run on CPU tensors as they do on the GPU.

    - `tl.dot` on bf16: the interpreter stores bf16 as uint16 and multiplies the raw bit patterns
      (triton-lang/triton#11584); upcast the operands to float32 first, which is what a bf16 dot with fp32
      accumulation computes on the GPU.
    - `range()` over a runtime scalar: the interpreter wraps scalars in 1-element arrays and calls `int()` on
      them, which numpy >= 2.4 refuses; give its tensors an `__index__` that takes the element.
    - fp32 -> bf16 casts: the interpreter truncates (a -0.3% bias per cast) where the GPU rounds to nearest
      even; round like the GPU, so that interpreter errors mean what GPU errors mean.
    - TMA stores at a negative coordinate: the interpreter clips them like any out-of-bounds part, the H200
      stops with an illegal instruction; raise.
    """
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    if getattr(builder.create_dot, "_tessera", False):
        return
    create_dot = builder.create_dot
    patch_lang_tensor = interpreter._patch_lang_tensor
    convert_float = interpreter._convert_float
    descriptor_store = builder.create_descriptor_store

    def upcast(x):
        if x.dtype == tl.bfloat16:
            data = convert_float(x.data, tl.bfloat16, tl.float32, None).view(np.float32)
            return interpreter.TensorHandle(data.reshape(x.data.shape), tl.float32)
        return x

    def dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return create_dot(self, upcast(a), upcast(b), d, input_precision, max_num_imprecise_acc)

    def lang_tensor(tensor, scope):
        patch_lang_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

    def convert(data, src, dst, rounding_mode):
        if src == tl.float32 and dst == tl.bfloat16:
            x = torch.from_numpy(np.ascontiguousarray(data).view(np.float32).copy())
            return x.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16).reshape(np.shape(data))
        return convert_float(data, src, dst, rounding_mode)

    def store(self, desc, value, indices):
        if any((np.asarray(i.data) < 0).any() for i in indices):
            raise RuntimeError(f"TMA store at {[np.asarray(i.data).reshape(-1)[0].item() for i in indices]}: negative")
        return descriptor_store(self, desc, value, indices)

    dot._tessera = True
    builder.create_descriptor_store = store
    builder.create_dot = dot
    interpreter._patch_lang_tensor = lang_tensor
    interpreter._convert_float = convert
