"""The Triton kernels, one module per stage, each with its own launcher: `stft` (log-mel from a complex STFT)."""
