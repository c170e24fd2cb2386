# Generated from common/launch.py by `python -m tools.vendor`: edit that file, not this copy.
"""How a planned launch runs: the compiled kernel called without Triton's per-call argument binding, its TMA
descriptors built on the host each call, on the tensors' CUDA device. Every kernel of a package that takes this
module (Triton's and Gluon's) launches through `launch`; the stage modules build their launches, and the dispatcher
(`dispatch`) picks one for a call and decides what a fast path's compile failure does. The per-call binding costs
tens of microseconds of host time, most of a launch-bound call."""

import functools
import math
from typing import NamedTuple

import torch
import triton
from triton.compiler.compiler import CompiledKernel
from triton.tools.tensor_descriptor import TensorDescriptor

from .devices import on_device
from .fast_paths import TRITON_RELEASE, falls_back

try:  # the CUDA backend's launcher, which `_launcher_call` may call past its Python wrapper
    from triton.backends.nvidia.driver import CudaLauncher
except ImportError:
    CudaLauncher = None

try:  # Gluon's descriptors carry their shared-memory layout (band-gluon)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonTensorDescriptor
except ImportError:  # a Triton without Gluon plans no Gluon launch
    GluonTensorDescriptor = None


class Launch:
    """One kernel launch of a call shape: the kernel, its grid (programs), its integer arguments (they follow
    its tensor arguments, of which any may be None where the kernel takes an optional tensor), meta-parameters
    (the kernel's constexpr arguments, and launch options such as num_stages or maxnreg) and warps. Built by a
    stage module's launch once per shape (cached by the stage module or the dispatcher) and compared by identity,
    so the compiled-kernel cache keys on the object itself (and keeps it alive)."""

    __slots__ = ("kernel", "programs", "ints", "meta", "num_warps", "config", "arguments", "fast_path")

    def __init__(self, kernel, programs: int, ints: tuple, meta: dict, num_warps: int, config: str,
                 arguments: tuple | None = None, fast_path: str | None = None):  # fmt: skip
        self.kernel, self.programs, self.ints, self.meta, self.num_warps = kernel, programs, ints, meta, num_warps
        # The configuration that runs, and for a TMA kernel its tensor arguments: each the index of a tensor
        # handed to `launch`, or (index, shape, block[, shared layout]) for a descriptor of that tensor viewed
        # as the row-major `shape`; for a fast path, its row in `dispatch.FAST_PATHS`.
        self.config, self.arguments, self.fast_path = config, arguments, fast_path


# Kept launches of compiled kernels by (Launch, device, each tensor's dtype and 16-byte alignment or None): (call,
# function, head, the stream query, the integers and constexprs), see `launch` and `_launcher_call`.
_compiled: dict = {}
_C = torch._C


def launch(plan: Launch, tensors: tuple) -> Exception | None:
    """plan.kernel[(plan.programs,)](*tensors, *plan.ints, **plan.meta, num_warps=plan.num_warps), minus Triton's
    per-call binding (host time that launch-bound calls cannot spare). None once launched; the error where a fast
    path's first launch of a specialization fails to compile (`fast_paths.falls_back`), for the dispatcher to
    switch the path off and plan again. Other errors are raised.

    The first launch of a specialization (the tensors' dtypes and 16-byte alignment, or None; the Launch fixes
    the integers) goes through the JIT and keeps its CompiledKernel; later ones call its launcher directly, the
    arguments in the kernel's parameter order. While a launch hook is registered (Triton's profiler) every
    launch takes the JIT path; under the interpreter nothing is kept. TMA descriptors hold the data pointers,
    so they are built each call: checked ones for the JIT, `_HostDescriptor`s for the launcher."""
    device = tensors[0].device.index
    key = _key(plan, device, tensors)
    hit = _compiled.get(key)
    fast = hit is not None and not triton.knobs.runtime.launch_enter_hook.calls
    if plan.arguments is not None:
        tensors = tuple(tensors[a] if type(a) is int else _descriptor(tensors[a[0]], *a[1:], checked=not fast)
                        for a in plan.arguments)
    if fast:
        call, function, head, stream_of, trailing = hit
        call(plan.programs, 1, 1, stream_of(device), function, *head, *tensors, *trailing)
        return None
    try:
        compiled = plan.kernel[(plan.programs,)](*tensors, *plan.ints, **plan.meta, num_warps=plan.num_warps)
    except Exception as error:
        if plan.fast_path is None or not falls_back(error):
            raise
        return error
    if isinstance(compiled, CompiledKernel) and device is not None:  # meta tensors (offline compiles): not kept
        constexprs = tuple(plan.meta[name] for name in plan.kernel.arg_names[len(tensors) + len(plan.ints) :])
        stream_of = triton.runtime.driver.active.get_current_stream
        trailing = (*plan.ints, *constexprs)
        _compiled[key] = (*_launcher_call(compiled), stream_of, trailing)
    return None


def _launcher_call(compiled: CompiledKernel) -> tuple:
    """(call, function, head) of a compiled kernel: a kept launch is call(grid x, y, z, stream, function, *head,
    *tensors, *integers and constexprs). Under Triton 3.6 a CUDA launcher whose kernel takes no scratch memory is
    called past its Python wrapper (`CudaLauncher.__call__`, which allocates the scratch and passes its arguments on
    to its C launch function, about half a microsecond of host time a launch): the C function itself, with the
    arguments the wrapper passes it (`tests/test_launch.py` checks them against the wrapper's). Elsewhere the
    wrapper, with (metadata, launch metadata, enter hook, exit hook)."""
    run, metadata = compiled.run, compiled.packed_metadata
    if (TRITON_RELEASE == "3.6" and type(run) is CudaLauncher and not run.global_scratch_size
            and not run.profile_scratch_size):
        head = (run.launch_cooperative_grid, run.launch_pdl, None, None, metadata, None, None, None)
        return run.launch, compiled.function, head
    return run, compiled.function, (metadata, None, None, None)


def _key(plan: Launch, device: int | None, tensors: tuple) -> tuple:
    """The key of a kept launcher: the Launch, the device, each tensor's dtype and 16-byte alignment (or None)."""
    return (plan, device, *[None if t is None else (t.dtype, t.data_ptr() % 16 == 0) for t in tensors])


def kept_launcher(plan: Launch, device: int | None, dtypes: tuple):
    """`launch(plan, tensors)` for tensors on CUDA device `device` of `dtypes` (None for a None argument), each
    starting on 16 bytes, once `launch` keeps its launcher, bound to everything but the tensors: a function of such
    tensors (in `launch`'s order) that launches on the current stream, through the JIT while a launch hook is
    registered as `launch` does, on `device` made current where another device is. None where nothing is kept (the
    interpreter, meta tensors, a specialization not launched yet). For the kept direct calls of a call signature
    (`direct_calls.DirectCalls`): their host time is this and their allocations."""
    hit = _compiled.get((plan, device, *[None if d is None else (d, True) for d in dtypes]))
    if hit is None:
        return None
    call, function, head, stream_of, trailing = hit
    programs, arguments, runtime = plan.programs, plan.arguments, triton.knobs.runtime
    if arguments is not None:  # descriptors of the tensors (`_descriptor`), built each call
        views = tuple(a if type(a) is int else (a[0], a[1], _row_major_strides(a[1])) for a in arguments)

    def launch_kept(*tensors):
        if runtime.launch_enter_hook.calls or _C._cuda_getDevice() != device:
            with on_device(tensors[0]):
                launch(plan, tensors)
            return
        if arguments is not None:
            tensors = [tensors[a] if type(a) is int else _HostDescriptor(tensors[a[0]], a[1], a[2]) for a in views]
        call(programs, 1, 1, stream_of(device), function, *head, *tensors, *trailing)

    return launch_kept


class _HostDescriptor(NamedTuple):
    """What a compiled kernel's launcher reads of a TMA descriptor argument, Triton's or Gluon's (the box and
    the layout are compiled in): from Triton 3.7 on it reads `round_f32_to_tf32` too."""

    base: torch.Tensor
    shape: tuple
    strides: tuple
    padding: str = "zero"
    round_f32_to_tf32: bool = False


@functools.cache
def _row_major_strides(shape: tuple) -> tuple:
    """The strides of a contiguous tensor of `shape` (computed once a shape: descriptors are built every call)."""
    return tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))


def _descriptor(x: torch.Tensor, shape: tuple, block: tuple, layout=None, checked: bool = True):
    """A TMA descriptor of the contiguous x viewed as the row-major `shape`, copied in `block` boxes: Triton's, or
    with a shared-memory `layout` Gluon's. Not `checked`: a `_HostDescriptor`, several times cheaper to build, for
    a launch whose specialization the JIT has already taken (band-gluon builds four a call forward, seven
    backward)."""
    strides = _row_major_strides(shape)
    if not checked:
        return _HostDescriptor(x, shape, strides)
    if layout is None:
        return TensorDescriptor(x, shape, strides, block)
    return GluonTensorDescriptor(x, list(shape), list(strides), list(block), layout)


def sm_count(device: int) -> int:
    """Multiprocessors of CUDA device `device` (one for -1, the interpreter's CPU tensors), for persistent grids."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device >= 0 else 1
