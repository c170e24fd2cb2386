"""Gluon kernels (Triton's explicit-layout dialect) of the fast path."""
