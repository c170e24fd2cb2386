"""Helpers shared by every test: loading kernels the way model code does, the specs, error metrics.

Tests never `import <pkg>`: they load the built kernel through `kernels.get_kernel` from the local Hub
cache (`make hub`), or from `LOCAL_KERNELS` when that is set, exactly as a user would.
"""

import functools
import os
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parent
SPECS = Path(os.environ.get("TESSERA_SPECS", REPO_ROOT.parent / "shared" / "specs"))
ORG = os.environ.get("TESSERA_HUB_ORG", "tessera")
HAS_CUDA = torch.cuda.is_available()
# The variant the kernels loader picks follows the torch build, not the presence of a GPU.
BACKEND = "cuda" if torch.version.cuda else "cpu"
# Triton runs on CPU tensors through its interpreter; on a GPU machine the kernels run for real.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")


@functools.cache
def load(name: str, version: int = 1):
    from kernels import get_kernel

    return get_kernel(f"{ORG}/{name}", version=version, trust_remote_code=True)


def submodule(kernel, name: str):
    """A module of a loaded kernel that its __init__ does not import (the Triton launchers)."""
    import importlib

    return importlib.import_module(f"{kernel.__name__}.{name}")


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative Frobenius error ||x - ref|| / ||ref||, in float64."""
    x, ref = x.double().cpu(), ref.double().cpu()
    return ((x - ref).norm() / ref.norm().clamp_min(1e-300)).item()


@functools.cache
def spec(name: str):
    """A spec of ../shared/specs as callables on the CPU: `.ref`, `.make` and the shape lists.

    Skips the calling test when the specs are not beside the checkout."""
    path = SPECS / f"{name}.py"
    if not path.is_file():
        pytest.skip(f"spec {path} not found")
    import sys
    import types

    # The spec files import `spec.TaskSpec` from their parent directory; give them a stand-in.
    sys.modules.setdefault("spec", types.SimpleNamespace(TaskSpec=_TaskSpec))
    ns = {"__file__": str(path)}
    exec(compile(path.read_text(), str(path), "exec"), ns)
    s = ns["SPEC"]
    env = {}
    exec(s.reference_imports, env)
    device = "cuda" if HAS_CUDA else "cpu"
    exec((s.reference_src + s.make_inputs_src + s.flops_src).replace('device="cuda"', f'device="{device}"'), env)
    s.ref, s.make, s.work = env[s.func], env["_mk"], env["canonical_work"]
    return s


class _TaskSpec:
    def __init__(self, **fields):
        self.__dict__.update(fields)

    def validate(self):
        return self


def patch_interpreter_bf16_dot() -> None:
    """Make the Triton interpreter's `tl.dot` upcast bf16 operands to float32 first.

    The interpreter stores bf16 as uint16 and multiplies the raw bit patterns (triton-lang/triton#11584);
    on the GPU a bf16 dot multiplies the values exactly and accumulates in fp32, which this reproduces.
    """
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    if getattr(builder.create_dot, "_tessera_bf16", False):
        return
    original = builder.create_dot

    def upcast(x):
        if x.dtype == tl.bfloat16:
            data = interpreter._convert_float(x.data, tl.bfloat16, tl.float32, None).view(np.float32)
            return interpreter.TensorHandle(data.reshape(x.data.shape), tl.float32)
        return x

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return original(self, upcast(a), upcast(b), d, input_precision, max_num_imprecise_acc)

    create_dot._tessera_bf16 = True
    builder.create_dot = create_dot
