"""log_mel: Whisper's log-mel features (power -> Slaney mel -> log10 -> per-clip 80 dB floor -> rescale), from the
waveform in one fused pass (`whisper_log_mel`) or from a complex STFT (`log_mel_spectrogram`), with Whisper's
filterbank, for the Hugging Face kernels hub."""

from . import layers
from .dispatch import kernel_path
from .op import log_mel_spectrogram, whisper_log_mel
from .reference import log_mel_spectrogram_reference, whisper_log_mel_reference
from .whisper import mel_filters

__all__ = [
    "layers",
    "log_mel_spectrogram",
    "log_mel_spectrogram_reference",
    "mel_filters",
    "whisper_log_mel",
    "whisper_log_mel_reference",
    "kernel_path",
]
