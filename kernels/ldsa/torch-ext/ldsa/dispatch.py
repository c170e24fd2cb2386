"""Where ldsa's fast paths run. The portable path (`band`, `band-prefetch`: pointer-fed Triton band kernels) runs on
every CUDA GPU the metadata accepts under every supported Triton; the paths below run only where their row says they
are verified, and the launchers (`ldsa_triton`) take the portable path everywhere else."""

from .common.fast_paths import FastPath, FastPaths

HOPPER = ((9, 0),)
ALL_TRITONS = ("3.6", "3.7", "3.8", "3.9")

FAST_PATHS = FastPaths("ldsa", (
    FastPath("band-gluon forward", "Gluon, TMA-fed persistent kernel, the band built in mma.sync's registers; "
             "windows of 2-15 taps, calls of 2^18 frames and more", HOPPER,
             verified=("3.6", "3.7", "3.8"), compiles=ALL_TRITONS),
    FastPath("band-gluon backward", "Gluon, TMA-fed persistent kernel, the bands read through skewed shared-memory "
             "views (padded layouts of other row strides, which Triton 3.8 on refuses: there the backward runs as "
             "band-tma, or band in float32); windows of 2-15 taps, calls of 2^18 frames and more", HOPPER,
             verified=("3.6", "3.7"), compiles=("3.6", "3.7")),
    FastPath("band-tma forward", "Triton, tensor descriptors feeding a persistent pipelined band kernel; calls of "
             "2^18 frames and more that band-gluon does not take", HOPPER,
             verified=("3.6", "3.7", "3.8"), compiles=ALL_TRITONS),
    FastPath("band-tma backward", "Triton, the same for the backward with 16-bit values", HOPPER,
             verified=("3.6", "3.7", "3.8"), compiles=ALL_TRITONS),
))
