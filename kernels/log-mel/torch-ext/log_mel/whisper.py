"""Whisper's front end around the kernel: its Slaney mel filterbank, computed here (no librosa), and
`whisper_log_mel`, waveform -> log-mel with transformers' batched (per-clip) floor."""

import functools
import math

import torch

from .op import log_mel_spectrogram
from .validation import check_filterbank_args, check_whisper_args

SAMPLE_RATE = 16000
N_FFT = 400
HOP_LENGTH = 160

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
    check_filterbank_args(n_mels, n_fft, sample_rate)
    bins_hz = torch.arange(n_fft // 2 + 1, dtype=torch.float64) * (sample_rate / n_fft)
    top_mel = _hz_to_mel(torch.tensor(sample_rate / 2.0, dtype=torch.float64))
    edges_hz = _mel_to_hz(torch.linspace(0.0, top_mel.item(), n_mels + 2, dtype=torch.float64))
    left, centre, right = edges_hz[:-2, None], edges_hz[1:-1, None], edges_hz[2:, None]
    rising = (bins_hz - left) / (centre - left)
    falling = (right - bins_hz) / (right - centre)
    triangles = torch.minimum(rising, falling).clamp(min=0.0)
    return (triangles * (2.0 / (right - left))).to(torch.float32)


@functools.lru_cache(maxsize=None)
def _filterbank_on(n_mels: int, device: torch.device) -> torch.Tensor:
    """One filterbank per (n_mels, device), like whisper's own cache; never handed to callers."""
    return mel_filters(n_mels).to(device)


def whisper_log_mel(audio: torch.Tensor, n_mels: int = 80) -> torch.Tensor:
    """Whisper's log-mel of a batch of 16 kHz waveforms, one 80 dB floor per clip.

    audio: (B, N) float32. Returns (B, n_mels, N // 160) float32, contiguous: torch.stft with a periodic
    Hann window of 400, hop 160, centred with reflect padding, last frame dropped; then
    `log_mel_spectrogram` with `mel_filters(n_mels)`. This is transformers' WhisperFeatureExtractor on a
    batch (per-clip max); openai-whisper takes one max over whatever tensor it is given.
    """
    check_whisper_args(audio, n_mels, N_FFT)
    window = torch.hann_window(N_FFT, device=audio.device)
    stft = torch.stft(audio, N_FFT, HOP_LENGTH, window=window, center=True, pad_mode="reflect",
                      return_complex=True)  # (B, NF, N // 160 + 1)
    frames = stft[..., :-1].transpose(1, 2)  # (B, F, NF): the kernel's layout
    out = log_mel_spectrogram(frames.contiguous(), _filterbank_on(n_mels, audio.device))
    return out.transpose(1, 2).contiguous()
