"""The Hopper Gluon kernels, one module per stage, each owning its launch: the chunk transform at K = 64
(`transform`) and the forward scan (`states`), which the forward and the backward share, the reverse scan at K = 128
(`reverse`), and the gradients with dg at K = 128 (`grads`) and, with dv and dbeta's v part, at K = 64 (`grads64`);
what they share (gates, TMA descriptors) is in `chunk`. `dispatch.plan` says which stages they run."""

from . import chunk, grads, grads64, reverse, states, transform

__all__ = ["chunk", "grads", "grads64", "reverse", "states", "transform"]
