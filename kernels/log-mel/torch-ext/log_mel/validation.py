"""Argument checks at the public boundary: a bad call raises here, naming the argument."""

import numbers
from collections.abc import Iterable

import torch

from .common.checks import as_int, check_tensor


def _check_no_grad(function: str, name: str, x: torch.Tensor) -> None:
    if x.requires_grad and torch.is_grad_enabled():
        raise ValueError(
            f"{name} requires grad, but {function} is not differentiable: "
            "call it under torch.no_grad() or pass a detached tensor"
        )


def check_log_mel_args(stft, mel_filters) -> None:
    """Validate `log_mel_spectrogram(stft (B, F, NF) complex64, mel_filters (NM, NF) float32)`."""
    check_tensor("stft", stft, 3, (torch.complex64,), "(B, F, NF)")
    check_tensor("mel_filters", mel_filters, 2, (torch.float32,), "(NM, NF)")
    if stft.device != mel_filters.device:
        raise ValueError(
            f"stft and mel_filters must be on one device, got {stft.device} and {mel_filters.device}"
        )
    if mel_filters.shape[1] != stft.shape[2]:
        raise ValueError(
            f"mel_filters must be (NM, NF) with NF = {stft.shape[2]} frequency bins to match stft "
            f"{tuple(stft.shape)}, got {tuple(mel_filters.shape)}"
        )
    if min(stft.shape) < 1 or mel_filters.shape[0] < 1:
        raise ValueError(
            f"every size must be >= 1, got stft {tuple(stft.shape)} and mel_filters {tuple(mel_filters.shape)}"
        )
    _check_no_grad("log_mel_spectrogram", "stft", stft)
    _check_no_grad("log_mel_spectrogram", "mel_filters", mel_filters)


AUDIO_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.int16)
OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
LENGTH_DTYPES = (torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8)


def check_whisper_args(audio, n_mels, lengths, out_dtype, n_fft: int) -> tuple[int, torch.Tensor | None]:
    """Validate `whisper_log_mel(audio (B, N), n_mels, lengths=(B,) or None, out_dtype)` and return `n_mels` as a
    Python int and `lengths` as an int64 tensor on audio's device (or None). `lengths` is a tensor of ints or a
    sequence of ints (Python or numpy); its values are not inspected (that would synchronise the GPU): a length
    past N counts as N, a negative one as 0."""
    check_tensor("audio", audio, 2, AUDIO_DTYPES, "(B, N)")
    n_mels = as_int("n_mels", n_mels, 1)
    if audio.shape[0] < 1 or audio.shape[1] <= n_fft // 2:
        raise ValueError(
            f"audio must be (B, N) with B >= 1 and N > {n_fft // 2} samples (reflect padding of half a "
            f"window), got {tuple(audio.shape)}"
        )
    if not isinstance(out_dtype, torch.dtype) or out_dtype not in OUT_DTYPES:
        raise TypeError(f"out_dtype must be torch.float32, torch.bfloat16 or torch.float16, got {out_dtype!r}")
    _check_no_grad("whisper_log_mel", "audio", audio)
    if lengths is None:
        return n_mels, None
    if not isinstance(lengths, torch.Tensor):
        lengths = _lengths_tensor(lengths)
    check_tensor("lengths", lengths, 1, LENGTH_DTYPES, "(B,)")
    if lengths.shape[0] != audio.shape[0]:
        raise ValueError(f"lengths must be (B,) with B = {audio.shape[0]}, got {tuple(lengths.shape)}")
    if lengths.is_meta and not audio.is_meta:
        raise ValueError(f"lengths must hold values (a tensor on {audio.device} or the CPU), got a meta tensor")
    return n_mels, lengths_on(audio, lengths)


def lengths_on(audio: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Checked `lengths` as the kernels read them: int64 on audio's device, contiguous (they read lengths[b] at
    offset b)."""
    return lengths.to(device=audio.device, dtype=torch.int64).contiguous()


def _lengths_tensor(lengths) -> torch.Tensor:
    """A sequence of ints (a list, a tuple, a numpy array) as an int64 tensor; anything else a TypeError."""
    if isinstance(lengths, (str, bytes)) or not isinstance(lengths, Iterable):
        raise TypeError(f"lengths must be a tensor or a sequence of ints, got {type(lengths).__name__}")
    values = list(lengths)
    for x in values:
        if isinstance(x, bool) or not isinstance(x, numbers.Integral):
            raise TypeError(f"lengths must hold ints, got {type(x).__name__} {x!r}")
    return torch.tensor([int(x) for x in values], dtype=torch.int64)


def check_filterbank_args(n_mels, n_fft, sample_rate) -> tuple[int, int, int]:
    """Validate `mel_filters(n_mels, n_fft, sample_rate)` and return them as Python ints."""
    return as_int("n_mels", n_mels, 1), as_int("n_fft", n_fft, 2), as_int("sample_rate", sample_rate, 1)
