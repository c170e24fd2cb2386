# Generated from common/checks.py by `python -m tools.vendor`: edit that file, not this copy.
"""The argument check every public function starts with: a clear TypeError or ValueError naming the argument, before
any launch."""

import torch


def check_tensor(name: str, x, rank: int, dtypes: tuple[torch.dtype, ...], layout: str = "") -> None:
    """`x` is a tensor of one of `dtypes` and of rank `rank` (`layout`, e.g. "(B, T, H, K)", names the dimensions in
    the message)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in dtypes:
        names = [str(d).removeprefix("torch.") for d in dtypes]
        expected = names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]
        raise TypeError(f"{name} must be {expected}, got {x.dtype}")
    if x.dim() != rank:
        raise ValueError(f"{name} must have rank {rank}{' ' + layout if layout else ''}, got shape {tuple(x.shape)}")
