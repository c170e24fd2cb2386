"""The Triton kernels, one module per stage, each with its own launcher: `waveform` (log-mel from the waveform)
and `stft` (log-mel from a complex STFT); `epilogue` holds device functions and constants both use."""
