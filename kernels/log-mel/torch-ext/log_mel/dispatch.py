"""The plan and the path of a call: CUDA tensors run the Triton kernels (`portable/`), every other device the eager
reference (`reference.py`). `log_mel_spectrogram` on CUDA runs `portable/stft.py`. `whisper_log_mel` on CUDA runs its
main pass in the Gluon kernel (`hopper/waveform.py`) where its row of FAST_PATHS says it is verified, and in the
portable Triton kernel (`portable/waveform.py`) everywhere else, or after the Gluon kernel failed to compile (one
warning, then the Triton kernel for the process); the floor pass (`portable/floor.py`) follows either, each stage's
launch built once per call shape and run through the kept launcher of `common/launch.py` (no per-call argument
binding). The kernels' modules are imported on a CUDA call's first use (they need triton) and then found without an
import statement (`common.direct_calls.stage_module`)."""

import torch

from .common.direct_calls import stage_module
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


def log_mel_spectrogram_cuda(stft: torch.Tensor, mel_filters: torch.Tensor) -> torch.Tensor:
    """`log_mel_spectrogram` on validated, contiguous CUDA (or meta) tensors: the band plan, the main pass and the
    floor of `portable/stft.py`, in the tile config its pick table names for the shape."""
    return stage_module(__package__, "portable.stft").launch(stft, mel_filters)


def whisper_log_mel_cuda(audio: torch.Tensor, lengths: torch.Tensor | None, n_mels: int,
                         out_dtype: torch.dtype) -> torch.Tensor:
    """`whisper_log_mel` on validated, contiguous CUDA (or meta) tensors: the main pass on the path `waveform_path`
    picks, then the floor pass."""
    out, stats, block_f = _waveform_main_pass(audio, lengths, n_mels, out_dtype)
    stage_module(__package__, "portable.floor").launch(out, stats, block_f)
    return out


def _waveform_main_pass(audio: torch.Tensor, lengths: torch.Tensor | None, n_mels: int,
                        out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(out, stats, block_f) of the main pass in the Gluon kernel where `waveform_path` takes it and it compiles, in
    the portable Triton kernel otherwise."""
    if waveform_path(audio) == "waveform-gluon":
        try:
            return stage_module(__package__, "hopper.waveform").launch(audio, lengths, n_mels, out_dtype)
        except Exception as error:
            if not falls_back(error):
                raise
            FAST_PATHS.failed("waveform-gluon", error)
    return stage_module(__package__, "portable.waveform").launch(audio, lengths, n_mels, out_dtype)
