"""The registered ops and the public functions.

CUDA tensors run the CUDA entry points of `dispatch` (whose stage modules, the Triton and Gluon kernels, are
imported on first use so that the package imports without triton); CPU tensors run the eager reference. The public
functions decide whether a call needs the registered op at all (`common.direct_calls.calls_directly`): an eager call
on plain CUDA tensors runs the entry point directly, with the argument checks skipped for a call signature that
passed them before, and a later call of the signature runs the direct call kept for it (`dispatch.DIRECT_WHISPER`,
`dispatch.DIRECT_SPECTROGRAM`; `common.direct_calls.launches_directly` tests what the signature cannot). The op
names go through `add_op_namespace_prefix`, so two versions of this kernel can be loaded side by side. The ops have
no autograd formula: the public functions refuse inputs that require grad (see `validation`). Under autocast
(`common.autocast`) both ops run with autocast off on the CPU and on CUDA, their arguments as given: float32
arithmetic throughout, the output dtype the docstring gives.
"""

from collections.abc import Sequence

import torch

from ._ops import add_op_namespace_prefix
from .common.autocast import register_autocast
from .common.devices import on_device
from .common.direct_calls import CheckedSignatures, calls_directly, launches_directly
from .dispatch import (DIRECT_SPECTROGRAM, DIRECT_WHISPER, log_mel_spectrogram_cuda, log_mel_spectrogram_direct,
                       whisper_log_mel_cuda, whisper_log_mel_direct)
from .reference import log_mel_spectrogram_reference, whisper_log_mel_reference
from .validation import check_log_mel_args, check_whisper_args, lengths_on
from .whisper import HOP_LENGTH, N_FFT


@torch.library.custom_op(add_op_namespace_prefix("log_mel_spectrogram"), mutates_args=(), device_types="cuda")
def log_mel_spectrogram_op(stft: torch.Tensor, mel_filters: torch.Tensor) -> torch.Tensor:
    with on_device(stft):
        return log_mel_spectrogram_cuda(stft, mel_filters)


@torch.library.register_kernel(add_op_namespace_prefix("log_mel_spectrogram"), "cpu")
def _(stft, mel_filters):
    return log_mel_spectrogram_reference(stft, mel_filters)


@torch.library.register_fake(add_op_namespace_prefix("log_mel_spectrogram"))
def _(stft, mel_filters):
    B, F, _ = stft.shape
    return stft.new_empty((B, F, mel_filters.shape[0]), dtype=torch.float32)


@torch.library.custom_op(add_op_namespace_prefix("whisper_log_mel"), mutates_args=(), device_types="cuda")
def whisper_log_mel_op(audio: torch.Tensor, lengths: torch.Tensor | None, n_mels: int,
                       out_dtype: torch.dtype) -> torch.Tensor:
    with on_device(audio):
        return whisper_log_mel_cuda(audio, lengths, n_mels, out_dtype)


@torch.library.register_kernel(add_op_namespace_prefix("whisper_log_mel"), "cpu")
def _(audio, lengths, n_mels, out_dtype):
    return whisper_log_mel_reference(audio, n_mels, lengths, out_dtype)


@torch.library.register_fake(add_op_namespace_prefix("whisper_log_mel"))
def _(audio, lengths, n_mels, out_dtype):
    return audio.new_empty((audio.shape[0], n_mels, audio.shape[1] // HOP_LENGTH), dtype=out_dtype)


register_autocast(add_op_namespace_prefix("log_mel_spectrogram"))
register_autocast(add_op_namespace_prefix("whisper_log_mel"))


def log_mel_spectrogram(stft: torch.Tensor, mel_filters: torch.Tensor) -> torch.Tensor:
    """Whisper's normalised log-mel spectrogram from a complex STFT, with one 80 dB floor per clip.

    stft:        (B, F, NF) complex64, F frames of NF frequency bins per clip.
    mel_filters: (NM, NF) float32 filterbank (any values; a banded one is faster on CUDA).
    Returns (B, F, NM) float32:
        mel = (re^2 + im^2) @ mel_filters^T;  log_spec = log10(max(mel, 1e-10))
        out = (max(log_spec, max over the clip's (F, NM) of log_spec - 8) + 4) / 4
    fp32 accuracy throughout: on CUDA the projection is a 3xTF32 product (error-compensated, fp32-level),
    never plain TF32 or bf16, autocast or not. Not differentiable: inputs that require grad raise ValueError
    while grad mode is on. Non-contiguous inputs are copied to contiguous ones first.
    """
    kept = None  # the signature of a call a kept direct call could take, where none is kept yet
    if type(stft) is torch.Tensor and type(mel_filters) is torch.Tensor and launches_directly(stft, mel_filters):
        kept = (stft.shape, stft.dtype, stft.device, mel_filters.shape, mel_filters.dtype, mel_filters.device)
        spectrogram = DIRECT_SPECTROGRAM.get(kept)
        if spectrogram is not None:
            return spectrogram(stft, mel_filters)
    signature = _spectrogram_signature(stft, mel_filters)
    if signature is None or signature not in _checked:
        check_log_mel_args(stft, mel_filters)
        if signature is not None:
            _checked.add(signature)
    stft, mel_filters = stft.contiguous(), mel_filters.contiguous()
    if calls_directly(stft, mel_filters):
        with on_device(stft):
            out = log_mel_spectrogram_cuda(stft, mel_filters)
        if kept is not None:
            DIRECT_SPECTROGRAM.keep(kept, log_mel_spectrogram_direct(stft, mel_filters))
        return out
    return log_mel_spectrogram_op(stft, mel_filters)


def whisper_log_mel(audio: torch.Tensor, n_mels: int = 80, *, lengths: torch.Tensor | Sequence[int] | None = None,
                    out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Whisper's log-mel features of a batch of 16 kHz waveforms, one 80 dB floor per clip: what transformers'
    WhisperFeatureExtractor returns for the batch padded with zeros to N samples (its torch path).

    audio:     (B, N) float32, float16 or bfloat16 samples, or int16 PCM (scaled by 1/32768); N > 200.
    n_mels:    mel bands of `mel_filters(n_mels)` (Whisper: 80, or 128 for large-v3).
    lengths:   (B,) ints, or None: samples at or past a clip's length count as zeros, so clips of different
               lengths share one batch (a length past N counts as N, a negative one as 0).
    out_dtype: float32, bfloat16 or float16 (accumulation is float32 throughout, autocast or not).
    Returns (B, n_mels, N // 160) `out_dtype`, contiguous: frames of a periodic Hann window of 400, hop 160,
    centred with reflect padding, the last frame dropped; power, the Slaney filterbank, log10(max(mel, 1e-10)),
    the clip's maximum - 8 as a floor, (x + 4) / 4. On CUDA one fused pass from the samples (DFT and projection
    as tensor-core products of split 16-bit operands, fp32-accurate; in Gluon on Hopper, see `dispatch`) and the
    floor over only the tiles it reaches, in the same launch up to `dispatch.ONE_LAUNCH_MAX_CLIPS` clips and in a
    launch of its own above.
    """
    kept = None  # the signature of a call a kept direct call could take, where none is kept yet
    if type(audio) is torch.Tensor and type(n_mels) is int and type(out_dtype) is torch.dtype:
        if lengths is None:
            if launches_directly(audio):
                kept = (audio.shape, audio.dtype, audio.device, n_mels, out_dtype)
        elif type(lengths) is torch.Tensor and launches_directly(audio, lengths):
            kept = (audio.shape, audio.dtype, audio.device, n_mels, out_dtype, lengths.shape, lengths.dtype,
                    lengths.device)
        if kept is not None and (whisper := DIRECT_WHISPER.get(kept)) is not None:
            return whisper(audio, lengths)
    signature = _whisper_signature(audio, n_mels, lengths, out_dtype)
    given = lengths
    if signature is None or signature not in _checked:
        n_mels, lengths = check_whisper_args(audio, n_mels, lengths, out_dtype, N_FFT)
        if signature is not None:
            _checked.add(signature)
    elif lengths is not None:
        lengths = lengths_on(audio, lengths)
    audio = audio.contiguous()
    if calls_directly(audio) if lengths is None else calls_directly(audio, lengths):
        with on_device(audio):
            out = whisper_log_mel_cuda(audio, lengths, n_mels, out_dtype)
        if kept is not None and lengths is given:  # given lengths, if any, as the kernels read them
            DIRECT_WHISPER.keep(kept, whisper_log_mel_direct(audio, lengths, n_mels, out_dtype))
        return out
    return whisper_log_mel_op(audio, lengths, n_mels, out_dtype)


# Call signatures of both public functions that passed their argument checks: the checks cost more host time than the
# lookup, a share of a small call's launch-bound budget worth saving. Each signature holds whether the checks' no-grad
# rule applies (grad mode on and an input requiring grad: then they raise, and the signature never passes).
_checked = CheckedSignatures()


def _spectrogram_signature(stft, mel_filters) -> tuple | None:
    """What `check_log_mel_args` reads of a call, or None (checked every call) for tensor subclasses and non-tensors."""
    if type(stft) is not torch.Tensor or type(mel_filters) is not torch.Tensor:
        return None
    return ("log_mel_spectrogram", stft.shape, stft.dtype, stft.device, mel_filters.shape, mel_filters.dtype,
            mel_filters.device, torch.is_grad_enabled() and (stft.requires_grad or mel_filters.requires_grad))


def _whisper_signature(audio, n_mels, lengths, out_dtype) -> tuple | None:
    """What `check_whisper_args` reads of a call whose `n_mels` is an int, `out_dtype` a dtype and `lengths` None or a
    plain tensor, or None (checked every call) for every other call."""
    if (type(audio) is not torch.Tensor or type(n_mels) is not int or type(out_dtype) is not torch.dtype
            or not (lengths is None or type(lengths) is torch.Tensor)):
        return None
    lengths_of = None if lengths is None else (lengths.shape, lengths.dtype, lengths.device)
    return ("whisper_log_mel", audio.shape, audio.dtype, audio.device, torch.is_grad_enabled() and audio.requires_grad,
            n_mels, out_dtype, lengths_of)
