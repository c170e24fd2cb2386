"""Whisper's front-end constants and its Slaney mel filterbank, computed here (no librosa)."""

import math

import torch

from .validation import check_filterbank_args

SAMPLE_RATE = 16000
N_FFT = 400
HOP_LENGTH = 160
PCM_SCALE = 1.0 / 32768.0  # int16 PCM -> [-1, 1)

# Slaney's mel scale (librosa htk=False): linear below 1 kHz, logarithmic above.
_LINEAR_HZ_PER_MEL = 200.0 / 3.0
_LOG_START_HZ = 1000.0
_LOG_START_MEL = _LOG_START_HZ / _LINEAR_HZ_PER_MEL  # 15
_MELS_PER_LOG_HZ = 27.0 / math.log(6.4)


def _hz_to_mel(hz: torch.Tensor) -> torch.Tensor:
    log_part = _LOG_START_MEL + torch.log(hz.clamp(min=_LOG_START_HZ) / _LOG_START_HZ) * _MELS_PER_LOG_HZ
    return torch.where(hz >= _LOG_START_HZ, log_part, hz / _LINEAR_HZ_PER_MEL)


def _mel_to_hz(mel: torch.Tensor) -> torch.Tensor:
    log_part = _LOG_START_HZ * torch.exp((mel - _LOG_START_MEL) / _MELS_PER_LOG_HZ)
    return torch.where(mel >= _LOG_START_MEL, log_part, mel * _LINEAR_HZ_PER_MEL)


def mel_filters(n_mels: int, n_fft: int = N_FFT, sample_rate: int = SAMPLE_RATE) -> torch.Tensor:
    """Whisper's (librosa's default) Slaney mel filterbank: (n_mels, n_fft // 2 + 1) float32 on the CPU.

    Equals `librosa.filters.mel(sr=sample_rate, n_fft=n_fft, n_mels=n_mels)` (htk=False, norm="slaney",
    fmin=0, fmax=sample_rate/2), which is what whisper's mel_filters.npz holds for n_mels 80 and 128:
    triangles linear in Hz between consecutive mel-spaced edges, each scaled by 2 / (its width in Hz).
    Computed in float64, rounded once to float32.
    """
    n_mels, n_fft, sample_rate = check_filterbank_args(n_mels, n_fft, sample_rate)
    bins_hz = torch.arange(n_fft // 2 + 1, dtype=torch.float64) * (sample_rate / n_fft)
    top_mel = _hz_to_mel(torch.tensor(sample_rate / 2.0, dtype=torch.float64))
    edges_hz = _mel_to_hz(torch.linspace(0.0, top_mel.item(), n_mels + 2, dtype=torch.float64))
    left, centre, right = edges_hz[:-2, None], edges_hz[1:-1, None], edges_hz[2:, None]
    rising = (bins_hz - left) / (centre - left)
    falling = (right - bins_hz) / (right - centre)
    triangles = torch.minimum(rising, falling).clamp(min=0.0)
    return (triangles * (2.0 / (right - left))).to(torch.float32)
