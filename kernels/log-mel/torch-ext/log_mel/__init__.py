"""log_mel: Whisper's log-mel spectrogram from a complex STFT (power -> mel -> log10 -> per-clip 80 dB
floor -> rescale) as one streaming pass, plus Whisper's Slaney filterbank and a waveform front end, for
the Hugging Face kernels hub."""

from . import layers
from .op import kernel_path, log_mel_spectrogram
from .reference import log_mel_spectrogram_reference
from .whisper import mel_filters, whisper_log_mel

__all__ = [
    "layers",
    "log_mel_spectrogram",
    "log_mel_spectrogram_reference",
    "mel_filters",
    "whisper_log_mel",
    "kernel_path",
]
