"""The shared task specs (`../shared/specs`, or `$TESSERA_SPECS`) as callables, and the error metric every
comparison with them reports: one definition each, for the tools, the side-by-side harness and the tests.

A spec file defines `SPEC`, a `spec.TaskSpec` holding its reference, input maker and work formula as source;
`spec(name)` runs that source and returns the spec with `.ref`, `.make` and `.work` callables on the CUDA device
where there is one, else on the CPU.
"""

import functools
import os
import sys
import types
from pathlib import Path

from .common import REPO_ROOT


def folder() -> Path:
    """Where the specs are: `$TESSERA_SPECS`, read at each call (gpu_bench sets it from --specs), else
    ../shared/specs beside the checkout."""
    return Path(os.environ.get("TESSERA_SPECS", REPO_ROOT.parent / "shared" / "specs"))


def has_spec(name: str) -> bool:
    """Whether spec `name` is in `folder()` (the shared specs need not be beside a checkout)."""
    return (folder() / f"{name}.py").is_file()


@functools.cache
def spec(name: str):
    """Spec `name` with `.ref`, `.make` and `.work` callables and its shape lists; FileNotFoundError naming
    the folder where it is absent."""
    import torch

    path = folder() / f"{name}.py"
    if not path.is_file():
        raise FileNotFoundError(f"spec {name} not found in {path.parent}: set TESSERA_SPECS to the specs folder")
    # The spec files import `spec.TaskSpec` from their parent directory; give them a stand-in.
    sys.modules.setdefault("spec", types.SimpleNamespace(TaskSpec=_TaskSpec))
    ns = {"__file__": str(path)}
    exec(compile(path.read_text(), str(path), "exec"), ns)
    s = ns["SPEC"]
    env = {}
    exec(s.reference_imports, env)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    exec((s.reference_src + s.make_inputs_src + s.flops_src).replace('device="cuda"', f'device="{device}"'), env)
    s.ref, s.make, s.work = env[s.func], env["_mk"], env["canonical_work"]
    return s


class _TaskSpec:
    def __init__(self, **fields):
        self.__dict__.update(fields)

    def validate(self):
        return self


def rel_err(x, ref) -> float:
    """Relative Frobenius error ||x - ref|| / ||ref||, in float64 on x's device (a CPU copy of a GPU-sized
    tensor would cost more than the kernel under test)."""
    x, ref = x.double(), ref.to(x.device).double()
    return ((x - ref).norm() / ref.norm().clamp_min(1e-300)).item()
