# Generated from common/devices.py by `python -m tools.vendor`: edit that file, not this copy.
"""The device a launch runs on: Triton (and Gluon) launch on the current CUDA device, whatever device the
tensors are on, so a launch on another device's tensors makes that device current for its duration. And what the
launch plans read of its GPU (`gpu`), for meta tensors the GPU they stand for (`meta_gpu`)."""

import contextlib
import functools
from typing import NamedTuple

import torch

_SAME_DEVICE = contextlib.nullcontext()


class Gpu(NamedTuple):
    """What launch plans read of a GPU: its compute capability and the bytes of shared memory one CTA may use (the
    opt-in maximum)."""

    capability: tuple[int, int]
    shared_per_cta: int


# The GPU meta tensors stand for, so that a call on them plans the launches that GPU makes: an H100 / H200, unless an
# offline compile for another target (`tools.compile_offline --arch`) sets its own.
meta_gpu = Gpu((9, 0), 227 * 1024)


def gpu(device: torch.device) -> Gpu:
    """The GPU of CUDA device `device` (read once: the dispatch asks every call), or `meta_gpu` for meta tensors."""
    return meta_gpu if device.type == "meta" else _cuda_gpu(device)


@functools.cache
def _cuda_gpu(device: torch.device) -> Gpu:
    properties = torch.cuda.get_device_properties(device)
    return Gpu((properties.major, properties.minor), properties.shared_memory_per_block_optin)


def on_device(x: torch.Tensor):
    """The context a launch on x's tensors runs in: x's CUDA device made current where another one is; nothing
    to do on the current device (the small-call path stays free of a device switch) or for the interpreter's CPU
    tensors."""
    if x.is_cuda and x.device.index != torch._C._cuda_getDevice():  # CUDA is initialised: a CUDA tensor exists
        return torch.cuda.device(x.device)
    return _SAME_DEVICE
