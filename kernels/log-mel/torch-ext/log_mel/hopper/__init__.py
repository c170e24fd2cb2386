"""The fast path on Hopper, where `dispatch.FAST_PATHS` says it is verified: `waveform`, the main pass of
`whisper_log_mel` in Gluon (Triton's explicit-layout dialect)."""
