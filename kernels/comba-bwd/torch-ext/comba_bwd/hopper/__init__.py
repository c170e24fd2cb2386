"""The Hopper Gluon kernels, one module per stage, each owning its launch: the chunk transform at K = 64
(`transform`) and the forward scan (`forward_scan`), which the forward and the backward share, the reverse scan at
K = 128 (`reverse_scan`), and the gradients with dg (`grads`: at K = 128, and at K = 64 with dv and dbeta's v part);
what they share (gates, TMA descriptors) is in `chunk`. `dispatch.plan` says which stages they run."""

from . import chunk, forward_scan, grads, reverse_scan, transform

__all__ = ["chunk", "forward_scan", "grads", "reverse_scan", "transform"]
