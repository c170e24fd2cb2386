"""Where comba's fast path runs. The portable path (five Triton kernels: the chunk transform, the two state scans,
the gradient parts and dg) runs on every CUDA GPU the metadata accepts under every supported Triton; the Gluon
kernels run only where their row says they were verified, and the backward takes the Triton kernels everywhere
else."""

from .common.fast_paths import FastPath, FastPaths

FAST_PATHS = FastPaths("comba-bwd", (
    FastPath("gluon", "Gluon warpgroup-MMA kernels for bf16 inputs with V = 128: both scans and the gradients at "
             "K = 128; the chunk transform, the forward scan and the gradients (with dv) at K = 64", ((9, 0),),
             verified=("3.6", "3.7", "3.8"), compiles=("3.6", "3.7", "3.8", "3.9")),
))
