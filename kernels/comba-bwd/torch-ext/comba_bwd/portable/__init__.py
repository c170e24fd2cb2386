"""The portable Triton kernels, one module per stage, each with its launch: the chunk transform (`transform`), the
scans' chunk-local terms (`scan_terms`), the forward scan that makes the states (`forward_scan`), the forward's
output (`output`), the reverse scan (`reverse_scan`), the transform's adjoint (`adjoint`), the gradients (`grads`)
and dg (`dg`), with what they share in `chunk`; the L2 normalisation of a model's q, k and p and, in its backward,
the sum of their gradients over each group of value heads (`l2norm`); and the recurrent decode step (`decode`). They
run on every CUDA GPU the metadata accepts, under every supported Triton, and under the interpreter on the CPU."""

from . import adjoint, chunk, decode, dg, forward_scan, grads, l2norm, output, reverse_scan, scan_terms, transform

__all__ = ["adjoint", "chunk", "decode", "dg", "forward_scan", "grads", "l2norm", "output", "reverse_scan",
           "scan_terms", "transform"]
