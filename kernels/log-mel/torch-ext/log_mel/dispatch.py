"""Which implementation a call takes, in one place: CUDA tensors run the Triton kernels (`triton/`), every other
device the eager reference (`reference.py`). `whisper_log_mel` on CUDA takes the Gluon kernel (`gluon/waveform.py`)
where its row of FAST_PATHS says it is verified, and the portable Triton kernel (`triton/waveform.py`) everywhere
else, or after the Gluon kernel failed to compile (one warning, then the Triton kernel for the process). The
kernels' modules are imported on a CUDA call's first use: they need triton."""

import torch

from .common.fast_paths import FastPath, FastPaths, falls_back

FAST_PATHS = FastPaths("log-mel", (
    FastPath("waveform-gluon", "`whisper_log_mel` in Gluon: each warp runs frames through both DFT stages as "
             "mma.sync products with the tables in registers, then projects them over each band block's bins",
             ((9, 0),), verified=("3.6", "3.7", "3.8"), compiles=("3.6", "3.7", "3.8", "3.9")),
))


def kernel_path(x: torch.Tensor) -> str:
    """Which implementation a call on `x`'s device takes: "triton" or "reference"."""
    return "triton" if x.is_cuda else "reference"


def waveform_path(audio: torch.Tensor) -> str:
    """The CUDA path `whisper_log_mel` takes for `audio`: "waveform-gluon" or "triton"."""
    return "waveform-gluon" if FAST_PATHS.runs("waveform-gluon", audio.device) else "triton"


def whisper_log_mel_cuda(audio: torch.Tensor, lengths: torch.Tensor | None, n_mels: int,
                         out_dtype: torch.dtype) -> torch.Tensor:
    """`whisper_log_mel` on validated, contiguous CUDA (or meta) tensors, on the path `waveform_path` picks."""
    if waveform_path(audio) == "waveform-gluon":
        from .gluon.waveform import whisper_log_mel_gluon

        try:
            return whisper_log_mel_gluon(audio, lengths, n_mels, out_dtype)
        except Exception as error:
            if not falls_back(error):
                raise
            FAST_PATHS.failed("waveform-gluon", error)
    from .triton.waveform import whisper_log_mel_triton

    return whisper_log_mel_triton(audio, lengths, n_mels, out_dtype)
