"""The Triton kernels for every CUDA GPU, one module per stage, each with its kernels, their planning and their
launch: `stft` (log-mel from a complex STFT: band plan, main pass, floor), `waveform` (the main pass of log-mel from
the waveform) and `floor` (its floor, a pass of its own or folded into either main pass's launch, which the Gluon
main pass shares); `log10` holds the clamped log both main passes end with."""
