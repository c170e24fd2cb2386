"""Layers for `kernels.kernelize`: stateless, forward-compatible with the host modules that model code
decorates with `@use_kernel_forward_from_hub("LogMelSpectrogram")`."""

import torch
from torch import nn

from .op import log_mel_spectrogram


class LogMelSpectrogram(nn.Module):
    """STFT -> Whisper log-mel with a per-clip 80 dB floor: forward(stft (B, F, NF) complex64,
    mel_filters (NM, NF) float32) -> (B, F, NM) float32. Inference only (no backward)."""

    has_backward = False
    can_torch_compile = True

    def forward(self, stft: torch.Tensor, mel_filters: torch.Tensor) -> torch.Tensor:
        return log_mel_spectrogram(stft, mel_filters)
