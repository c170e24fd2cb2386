"""Eager log-mel, from the complex STFT and from the waveform: the numerical specification, in plain torch,
float32 throughout, whatever autocast is on (`autocast_off`).

These are the CPU paths of `log_mel_spectrogram` and `whisper_log_mel` and the baselines the fused kernels are
checked against. They materialise the power spectrum and the mel spectrogram, as the spec's reference does.
"""

import functools

import torch

from .common.autocast import autocast_off
from .whisper import HOP_LENGTH, N_FFT, PCM_SCALE, mel_filters

CLAMP = 1e-10  # mel power floor before the log: silent bins give log10(1e-10) = -10, never -inf
DYNAMIC_RANGE = 8.0  # 80 dB below the clip's loudest mel bin, in log10 units


@autocast_off
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


@functools.cache
def _window(device: torch.device) -> torch.Tensor:
    return torch.hann_window(N_FFT, device=device)


@functools.cache
def _filterbank_on(n_mels: int, device: torch.device) -> torch.Tensor:
    """`mel_filters(n_mels)` on `device`, once per (n_mels, device); never handed to callers."""
    return mel_filters(n_mels).to(device)


@autocast_off
def whisper_log_mel_reference(audio: torch.Tensor, n_mels: int = 80, lengths: torch.Tensor | None = None,
                              out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(B, N) float32, float16, bfloat16 or int16 PCM -> (B, n_mels, N // 160) `out_dtype`, as transformers'
    WhisperFeatureExtractor computes a padded batch (torch path, per-clip floor).

    The audio in float32 (int16 scaled by 1/32768), zero at or past each clip's length (its padding), then
    torch.stft (periodic Hann 400, hop 160, centred, reflect padding), the last frame dropped, and
    `log_mel_spectrogram_reference` with `mel_filters(n_mels)`; the result cast once to `out_dtype`.
    """
    x = audio.float() * PCM_SCALE if audio.dtype == torch.int16 else audio.float()
    if lengths is not None:
        x = torch.where(torch.arange(x.shape[1], device=x.device) < lengths.to(x.device)[:, None], x, 0.0)
    stft = torch.stft(x, N_FFT, HOP_LENGTH, window=_window(x.device), center=True, pad_mode="reflect",
                      return_complex=True)  # (B, NF, N // 160 + 1)
    frames = stft[..., :-1].transpose(1, 2)  # (B, F, NF)
    out = log_mel_spectrogram_reference(frames, _filterbank_on(n_mels, x.device))
    return out.transpose(1, 2).contiguous().to(out_dtype)
