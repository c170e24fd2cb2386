# Generated from common/devices.py by `python -m tools.vendor`: edit that file, not this copy.
"""The device a launch runs on: Triton (and Gluon) launch on the current CUDA device, whatever device the
tensors are on, so a launch on another device's tensors makes that device current for its duration."""

import contextlib

import torch

_SAME_DEVICE = contextlib.nullcontext()


def on_device(x: torch.Tensor):
    """The context a launch on x's tensors runs in: x's CUDA device made current where another one is; nothing
    to do on the current device (the small-call path stays free of a device switch) or for the interpreter's CPU
    tensors."""
    if x.is_cuda and x.device.index != torch.cuda.current_device():
        return torch.cuda.device(x.device)
    return _SAME_DEVICE
