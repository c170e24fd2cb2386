"""Eager log-mel from the complex STFT: the numerical specification, in plain torch, float32 throughout.

This is the CPU path of `log_mel_spectrogram` and the baseline the fused kernel is checked against. It
materialises the power spectrum and the mel spectrogram, as the spec's reference does.
"""

import torch

CLAMP = 1e-10  # mel power floor before the log: silent bins give log10(1e-10) = -10, never -inf
DYNAMIC_RANGE = 8.0  # 80 dB below the clip's loudest mel bin, in log10 units


def log_mel_spectrogram_reference(stft: torch.Tensor, mel_filters: torch.Tensor) -> torch.Tensor:
    """(B, F, NF) complex64, (NM, NF) float32 -> (B, F, NM) float32.

    power = re^2 + im^2; mel = power @ mel_filters^T; log_spec = log10(max(mel, 1e-10));
    out = (max(log_spec, max_clip(log_spec) - 8) + 4) / 4 with one maximum per clip (dims F and NM).
    On CUDA the projection is a cuBLAS fp32 matmul, so it inherits torch.backends.cuda.matmul.allow_tf32.
    """
    pairs = torch.view_as_real(stft).float()  # (B, F, NF, 2): re, im
    power = pairs.square().sum(dim=-1)
    mel = power @ mel_filters.float().t()
    log_spec = mel.clamp(min=CLAMP).log10()
    clip_max = log_spec.amax(dim=(1, 2), keepdim=True)
    return (torch.maximum(log_spec, clip_max - DYNAMIC_RANGE) + 4.0) / 4.0
