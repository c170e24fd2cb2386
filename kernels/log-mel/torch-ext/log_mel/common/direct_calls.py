# Generated from common/direct_calls.py by `python -m tools.vendor`: edit that file, not this copy.
"""The host path of a small eager call: whether it may skip its registered op for the op's CUDA entry point
(`calls_directly`), the call signatures whose argument checks passed (`CheckedSignatures`), and the stage modules an
entry point launches through, found without an import statement (`stage_module`).

A registered custom op costs tens of microseconds of host time a call in torch.library's dispatch layers, and the
argument checks several more: at launch-bound sizes that is most of a call. Where nothing needs the registered
op (no autograd graph to record, no compiler, tracer, functorch transform or dispatch mode looking at the call),
a public function calls the entry point the op would run, with the checks it ran the last time it saw the same
call signature. After such a call a package may keep what it derived from the signature as a direct call
(`DirectCalls`): the later calls of the signature look it up and, where `launches_directly` lets them, allocate
their outputs and launch through kept launchers, with nothing else in between.
"""

import functools
import importlib
from threading import get_ident

import torch
from torch.autograd import forward_ad

_C = torch._C


def calls_directly(*tensors) -> bool:
    """Whether an eager call on `tensors` may skip the registered op for its CUDA entry point: nothing intercepts
    calls (`nothing_intercepts`), CUDA autocast is off (the registered op holds its autocast rule), and every tensor
    is a plain CUDA tensor (not a FakeTensor or other subclass, not meta), none requiring grad while grad mode is on.
    Everywhere else the registered op runs, which each of those knows how to handle."""
    if not nothing_intercepts() or _C.is_autocast_enabled():  # without an argument: CUDA's autocast
        return False
    grad = _C.is_grad_enabled()
    for x in tensors:
        if type(x) is not torch.Tensor or not x.is_cuda or (grad and x.requires_grad):
            return False
    return True


def nothing_intercepts() -> bool:
    """No torch.compile tracing, torch.jit trace, functorch transform (vmap, grad) or torch dispatch mode
    (FakeTensorMode, functionalization, a profiler's mode) active: each of them must see the registered op. The tests
    past the first are torch's C functions themselves (torch.jit.is_tracing wraps the first of them in Python)."""
    return not (torch.compiler.is_compiling() or _C._is_tracing() or _C._len_torch_dispatch_stack()
                or _C._are_functorch_transforms_active())


def launches_directly(*tensors) -> bool:
    """Whether an eager call on plain tensors whose call signature holds a kept direct call (`DirectCalls`) may run it:
    nothing intercepts the call and CUDA autocast is off (as `calls_directly`), no forward-mode AD level is open (a
    dual tensor takes the checks of the public function's other route), no tensor requires grad while grad mode is on,
    and every tensor is contiguous and starts on 16 bytes, the specialization a kept launch was compiled for. Under
    torch.compile the first test is constant True, so a traced call never reaches the lookup that follows."""
    if (torch.compiler.is_compiling() or _C._is_tracing() or _C._len_torch_dispatch_stack()
            or _C._are_functorch_transforms_active() or _C.is_autocast_enabled() or forward_ad._current_level >= 0):
        return False
    grad = _C.is_grad_enabled()
    for x in tensors:
        if (grad and x.requires_grad) or not x.is_contiguous() or x.data_ptr() % 16:
            return False
    return True


class DirectCalls(dict):
    """Kept direct calls by call signature: for a signature (everything the argument checks and the plan of a call read
    but the tensors' contiguity and alignment, which `launches_directly` tests every call), the function that does what
    the CUDA entry point did for it, its outputs allocated and its kernels launched through kept launchers
    (`launch.kept_launcher`). A package keeps one after a direct call of the signature ran (its checks passed and its
    kernels launched once), and forgets them all with its cached plans. Bounded for callers with ever-new shapes: past
    `limit` signatures it starts over. A dict, so that a lookup is the dict's own `get`."""

    def __init__(self, limit: int = 4096):
        super().__init__()
        self.limit = limit

    def keep(self, signature, call) -> None:
        """Keep `call` for `signature`; None (nothing to keep: the call ran the reference, or the interpreter) is not
        kept."""
        if call is None:
            return
        if len(self) >= self.limit:
            self.clear()
        self[signature] = call


class CheckedSignatures:
    """Call signatures (hashable tuples of what a function's argument checks read: shapes, dtypes, devices, the
    scalars and their types) that passed the checks, so that a signature seen before skips them. The checks
    read nothing else, so a signature that passed once passes again. Bounded for callers with ever-new shapes:
    past `limit` signatures the set starts over."""

    def __init__(self, limit: int = 4096):
        self.limit = limit
        self._passed: set = set()

    def __contains__(self, signature) -> bool:
        return signature in self._passed

    def add(self, signature) -> None:
        """Record that `signature` passed the checks."""
        if len(self._passed) >= self.limit:
            self._passed.clear()
        self._passed.add(signature)

    def __len__(self) -> int:
        return len(self._passed)


class StreamScratch:
    """The intermediate tensors of a kept direct call (written and read by its own launches only, never returned),
    kept per current stream of CUDA device `device` and host thread: launches on one stream run in order, so a
    call reuses the tensors of the previous call of its thread on its stream, and saves their allocations (two
    threads on one stream keep two sets, since their calls' launches may interleave). `make()` makes fresh ones in
    the state the launches expect (zeros for counters that every launch leaves at zero). A call under CUDA graph
    capture takes fresh ones, from its graph's pool, so that no graph shares them with another or with eager calls.
    Past `limit` (stream, thread) pairs the scratch starts over, for callers with ever-new threads: tensors dropped
    while their launches run are safe, the allocator reusing their memory in their stream's order."""

    __slots__ = ("device", "make", "limit", "_kept")

    def __init__(self, device: int, make, limit: int = 64):
        self.device, self.make, self.limit, self._kept = device, make, limit, {}

    def __call__(self) -> tuple:
        if _C._cuda_isCurrentStreamCapturing():
            return self.make()
        key = (_C._cuda_getCurrentRawStream(self.device), get_ident())
        kept = self._kept.get(key)
        if kept is None:
            if len(self._kept) >= self.limit:
                self._kept.clear()
            kept = self._kept[key] = self.make()
        return kept


@functools.cache
def stage_module(package: str, name: str):
    """The module `name` of `package` (`stage_module(__package__, "portable.decode")`), imported at its first call
    (stage modules import triton, which CPU torch wheels lack, so a package imports them on a CUDA call's first use)
    and then found by one cache lookup, where an import statement in the entry point would cost about a microsecond of
    host time every call."""
    return importlib.import_module(f"{package}.{name}")
