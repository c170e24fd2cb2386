# Generated from common/checks.py by `python -m tools.vendor`: edit that file, not this copy.
"""The argument checks every public function starts with: a clear TypeError or ValueError naming the argument, before
any launch. Scalars are taken as users pass them (Python or numpy numbers, never a bool) and returned as Python
numbers, the types the registered ops' schemas declare."""

import math
import numbers

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


def as_int(name: str, n, minimum: int) -> int:
    """`n` as a Python int of at least `minimum`: any integral number (int, numpy integers), not a bool."""
    if isinstance(n, bool) or not isinstance(n, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(n).__name__}")
    n = int(n)
    if n < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {n}")
    return n


def as_scale(name: str, x) -> float | None:
    """None, or `x` as a finite Python float: any real number (float, int, numpy scalars), not a bool. Any finite
    value is valid (zero or negative too); nan or inf would reach every output."""
    if x is None:
        return None
    if isinstance(x, bool) or not isinstance(x, numbers.Real):
        raise TypeError(f"{name} must be a float or None, got {type(x).__name__}")
    x = float(x)
    if not math.isfinite(x):
        raise ValueError(f"{name} must be finite, got {x}")
    return x


def bounded_offsets(cu_seqlens: torch.Tensor, T: int) -> torch.Tensor:
    """cu_seqlens (N + 1 offsets of sequences packed along T rows) clamped into [0, T], each offset raised to the
    largest before it, on its device (no host read): the offsets themselves where they are valid, and where a GPU
    call's are not (a GPU call does not read them on the host, which would wait for the GPU) offsets whose sequences
    lie in the T packed rows."""
    return torch.cummax(cu_seqlens.clamp(0, T), 0).values
