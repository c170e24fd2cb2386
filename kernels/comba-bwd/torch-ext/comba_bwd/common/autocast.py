# Generated from common/autocast.py by `python -m tools.vendor`: edit that file, not this copy.
"""What the packages do under autocast, written once: the references compute in float32 with autocast off, and each
registered op declares its rule on the CPU and on CUDA (a custom op is opaque to autocast unless registered: the
torch ops inside its Python implementation would otherwise be autocast one by one, float32 work dropping to 16 bits).
"""

import functools

import torch

# Library fragments holding the autocast kernels; a registration lives as long as its fragment.
_FRAGMENTS = []
# The dtypes autocast casts (float64 and the non-float dtypes are left alone, as autocast leaves them).
_CASTABLE = (torch.float32, torch.float16, torch.bfloat16)


def autocast_off(function):
    """`function` run with autocast off on the device of its first argument (a tensor), so that its float32
    arithmetic stays float32 and its outputs keep the dtypes its docstring gives."""

    @functools.wraps(function)
    def run(x, *args, **kwargs):
        with torch.autocast(x.device.type, enabled=False):
            return function(x, *args, **kwargs)

    return run


def register_autocast(qualname: str, cuda_16bit: tuple[int, ...] = ()) -> None:
    """Declare the rule of the registered op `qualname` (`add_op_namespace_prefix(name)`) under autocast.

    The op runs with autocast off on both devices. On the CPU it takes its arguments as given (its reference computes
    in float32). On CUDA the floating-point tensors at the positions `cuda_16bit` are first cast to autocast's dtype
    (bfloat16 or float16: the operands a fused kernel takes), the others as given.
    """
    namespace, name = qualname.split("::")
    op = getattr(getattr(torch.ops, namespace), name).default
    fragment = torch.library.Library(namespace, "FRAGMENT")
    for device_type, key, positions in (("cpu", "AutocastCPU", ()), ("cuda", "AutocastCUDA", cuda_16bit)):
        fragment.impl(name, _autocast_kernel(op, device_type, positions), key)
    _FRAGMENTS.append(fragment)


def _autocast_kernel(op, device_type: str, positions: tuple[int, ...]):
    def kernel(*args):
        dtype = torch.get_autocast_dtype(device_type)
        args = [_cast(x, dtype) if i in positions else x for i, x in enumerate(args)]
        with torch.autocast(device_type, enabled=False):
            return op(*args)

    return kernel


def _cast(x, dtype: torch.dtype):
    return x.to(dtype) if isinstance(x, torch.Tensor) and x.dtype in _CASTABLE else x
