"""The portable Triton kernels, one module per stage, each with its launcher: the chunk transform (`transform`), the
forward scan that makes the states (`states`), the forward's output (`output`), the reverse scan (`reverse`) and the
gradients (`grads`), with what they share in `chunk`. They run on every CUDA GPU the metadata accepts, under every
supported Triton, and under the interpreter on the CPU."""

from . import chunk, grads, output, reverse, states, transform

__all__ = ["chunk", "grads", "output", "reverse", "states", "transform"]
