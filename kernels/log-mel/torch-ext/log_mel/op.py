"""The registered op and the public function.

CUDA tensors run the fused Triton kernels (`triton.stft`, imported on first use so that the package
imports without triton); CPU tensors run the eager reference. The op name goes through
`add_op_namespace_prefix`, so two versions of this kernel can be loaded side by side. The op has no
autograd formula: the public function refuses inputs that require grad (see `validation`).
"""

import torch

from ._ops import add_op_namespace_prefix
from .reference import log_mel_spectrogram_reference
from .validation import check_log_mel_args


def kernel_path(x: torch.Tensor) -> str:
    """Which implementation a call on `x`'s device takes: "triton" or "reference"."""
    return "triton" if x.is_cuda else "reference"


@torch.library.custom_op(add_op_namespace_prefix("log_mel_spectrogram"), mutates_args=(), device_types="cuda")
def log_mel_op(stft: torch.Tensor, mel_filters: torch.Tensor) -> torch.Tensor:
    from .triton.stft import log_mel_triton

    return log_mel_triton(stft, mel_filters)


@torch.library.register_kernel(add_op_namespace_prefix("log_mel_spectrogram"), "cpu")
def _(stft, mel_filters):
    return log_mel_spectrogram_reference(stft, mel_filters)


@torch.library.register_fake(add_op_namespace_prefix("log_mel_spectrogram"))
def _(stft, mel_filters):
    B, F, _ = stft.shape
    return stft.new_empty((B, F, mel_filters.shape[0]), dtype=torch.float32)


def log_mel_spectrogram(stft: torch.Tensor, mel_filters: torch.Tensor) -> torch.Tensor:
    """Whisper's normalised log-mel spectrogram from a complex STFT, with one 80 dB floor per clip.

    stft:        (B, F, NF) complex64, F frames of NF frequency bins per clip.
    mel_filters: (NM, NF) float32 filterbank (any values; a banded one is faster on CUDA).
    Returns (B, F, NM) float32:
        mel = (re^2 + im^2) @ mel_filters^T;  log_spec = log10(max(mel, 1e-10))
        out = (max(log_spec, max over the clip's (F, NM) of log_spec - 8) + 4) / 4
    fp32 accuracy throughout: on CUDA the projection is a 3xTF32 product (error-compensated, fp32-level),
    never plain TF32 or bf16. Not differentiable: inputs that require grad raise ValueError
    while grad mode is on. Non-contiguous inputs are copied to contiguous ones first.
    """
    check_log_mel_args(stft, mel_filters)
    return log_mel_op(stft.contiguous(), mel_filters.contiguous())
