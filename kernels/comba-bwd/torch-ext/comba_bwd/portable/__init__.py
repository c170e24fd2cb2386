"""The portable Triton kernels, one module per stage, each with its launch: the chunk transform (`transform`), the
forward scan that makes the states (`forward_scan`), the forward's output (`output`), the reverse scan
(`reverse_scan`), the gradients (`grads`) and dg (`dg`), with what they share in `chunk`; the L2 normalisation of a
model's q, k and p and, in its backward, the sum of their gradients over each group of value heads (`l2norm`); and
the recurrent decode step (`decode`). They run on every CUDA GPU the metadata accepts, under every supported Triton,
and under the interpreter on the CPU."""

from . import chunk, decode, dg, forward_scan, grads, l2norm, output, reverse_scan, transform

__all__ = ["chunk", "decode", "dg", "forward_scan", "grads", "l2norm", "output", "reverse_scan", "transform"]
