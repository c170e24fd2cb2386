# Generated from common/fast_paths.py by `python -m tools.vendor`: edit that file, not this copy.
"""Where a package's fast paths (Gluon and TMA kernels) run: the (GPU arch, Triton release) pairs each was verified
on, and the fall-back to the portable Triton path when one fails to compile anyway.

A fast path runs on a CUDA device only where its compute capability and the installed Triton's release (major.minor)
are both in its row of the package's table (`verified`: its GPU tests passed there); everywhere else the call takes
the portable Triton kernels, which run on every GPU the package's metadata accepts. `compiles` lists the releases
under which the offline compile (`tools.compile_offline`, in CI, for every architecture the row's capabilities name)
builds the path; it holds `verified`. Meta tensors take the paths of the GPU they stand for (`devices.meta_gpu`).

A fast path whose first launch of a specialization raises (a compile error) is switched off for the process: the
call and every later one take the portable path, and one warning names the path, the Triton release and the error.
Errors of the portable path itself are the caller's.
"""

import os
import warnings
from typing import NamedTuple

import torch

from .devices import gpu

try:
    import triton

    TRITON_RELEASE = ".".join(triton.__version__.split(".")[:2])
except ImportError:  # CPU torch wheels ship no triton: no fast path runs
    TRITON_RELEASE = None


# TESSERA_TRY_UNVERIFIED=1 runs each fast path on its GPUs under every Triton release it compiles under, for the GPU
# run that verifies a release; users leave it unset.
TRY_UNVERIFIED = os.environ.get("TESSERA_TRY_UNVERIFIED") == "1"


class FastPathFallback(RuntimeWarning):
    """A fast path failed to compile and the portable Triton path runs in its place."""


class FastPath(NamedTuple):
    """A path, what it is, the compute capabilities and Triton releases it was verified on, and the releases it
    compiles under."""

    name: str
    summary: str
    capabilities: tuple[tuple[int, int], ...]
    verified: tuple[str, ...]
    compiles: tuple[str, ...]


class FastPaths:
    """One package's table of fast paths (`runs`, `failed`) and its rendering for the card (`markdown`)."""

    def __init__(self, package: str, paths: tuple[FastPath, ...]):
        self.package = package
        self.paths = {path.name: path for path in paths}
        self.switched_off: dict[str, str] = {}  # path -> the error that switched it off

    def verified(self, name: str, capability: tuple[int, int], release: str | None = None) -> bool:
        """Whether path `name` is verified on a GPU of `capability` under Triton `release` (default: the installed
        one); with TRY_UNVERIFIED set, whether it compiles under `release` (how a GPU run verifies a release before
        its row names it)."""
        path = self.paths[name]
        release = release or TRITON_RELEASE
        releases = path.compiles if TRY_UNVERIFIED else path.verified
        return tuple(capability) in path.capabilities and release in releases

    def compiles(self, name: str, release: str | None = None) -> bool:
        """Whether path `name` compiles under Triton `release` (default: the installed one)."""
        return (release or TRITON_RELEASE) in self.paths[name].compiles

    def compiles_for(self, name: str, device: torch.device) -> bool:
        """Whether path `name` compiles under the installed Triton for CUDA device `device`'s compute capability,
        verified there or not: where a GPU run that verifies it tests and times it."""
        return (device.type == "cuda" and gpu(device).capability in self.paths[name].capabilities
                and self.compiles(name))

    def runs(self, name: str, device: torch.device) -> bool:
        """Whether path `name` runs for tensors on `device`: verified for its GPU and this Triton, and not switched
        off. Meta tensors (an offline compile) take every path that compiles under this Triton and claims the
        capability of the GPU they stand for (`devices.meta_gpu`)."""
        if name in self.switched_off:
            return False
        if device.type == "meta":
            return self.compiles(name) and gpu(device).capability in self.paths[name].capabilities
        return device.type == "cuda" and self.verified(name, gpu(device).capability)

    def failed(self, name: str, error: BaseException) -> None:
        """Switch path `name` off for the process after `error` at its launch, with one warning."""
        if name in self.switched_off:
            return
        message = " ".join(str(error).split())[:300]
        self.switched_off[name] = f"{type(error).__name__}: {message}"
        warnings.warn(f"{self.package}: the {name} path failed to compile under Triton {TRITON_RELEASE} "
                      f"({self.switched_off[name]}); the portable Triton path runs instead in this process",
                      FastPathFallback, stacklevel=3)

    def markdown(self) -> str:
        """The table as the card prints it."""
        rows = ["| path | what it is | runs on (compute capability) | verified under Triton | compiles under |",
                "|---|---|---|---|---|"]
        for path in self.paths.values():
            caps = ", ".join(f"{major}.{minor}" for major, minor in path.capabilities)
            rows.append(f"| `{path.name}` | {path.summary} | {caps} | {', '.join(path.verified)} | "
                        f"{', '.join(path.compiles)} |")
        return "\n".join(rows)


def falls_back(error: BaseException) -> bool:
    """Whether an error at a fast path's first launch switches it off: compile and resource errors do; running out of
    device memory does not (the portable path would too)."""
    return not isinstance(error, torch.OutOfMemoryError)
