"""The portable Triton kernels of the backward, one module per stage, each with its launcher: the chunk transform
(`transform`), the forward scan that recomputes the states (`states`), the reverse scan (`reverse`) and the gradients
(`grads`), with what they share in `chunk`. They run on every CUDA GPU the metadata accepts, under every supported
Triton, and under the interpreter on the CPU."""

from . import chunk, grads, reverse, states, transform

__all__ = ["chunk", "grads", "reverse", "states", "transform"]
