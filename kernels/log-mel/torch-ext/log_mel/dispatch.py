"""The plan and the path of a call: CUDA tensors run the Triton kernels (`portable/`), every other device the eager
reference (`reference.py`). `log_mel_spectrogram` on CUDA runs `portable/stft.py`. `whisper_log_mel` on CUDA runs its
main pass in the Gluon kernel (`hopper/waveform.py`) where its row of FAST_PATHS says it is verified, and in the
portable Triton kernel (`portable/waveform.py`) everywhere else, or after the Gluon kernel failed to compile (one
warning, then the Triton kernel for the process). Its floor (`portable/floor.py`) runs in the main pass's launch
(ONE_LAUNCH) or as a pass of its own after it (TWO_LAUNCHES), by batch size (`waveform_plan`). Each stage's launch is
built once per call shape and runs through the kept launcher of `common/launch.py` (no per-call argument binding).
The kernels' modules are imported on a CUDA call's first use (they need triton) and then found without an import
statement (`common.direct_calls.stage_module`)."""

import torch

from .common.direct_calls import DirectCalls, stage_module
from .common.fast_paths import FastPath, FastPaths, falls_back
from .whisper import HOP_LENGTH

FAST_PATHS = FastPaths("log-mel", (
    FastPath("waveform-gluon", "`whisper_log_mel` in Gluon: each warp runs frames through both DFT stages as "
             "mma.sync products with the tables in registers, then projects them over each band block's bins",
             ((9, 0),), verified=("3.6", "3.7", "3.8", "3.9"), compiles=("3.6", "3.7", "3.8", "3.9")),
))


def kernel_path(x: torch.Tensor) -> str:
    """Which implementation a call on `x`'s device takes: "triton" or "reference"."""
    return "triton" if x.is_cuda else "reference"


def waveform_path(audio: torch.Tensor) -> str:
    """The CUDA path `whisper_log_mel` takes for `audio`: "waveform-gluon" or "triton"."""
    return "waveform-gluon" if FAST_PATHS.runs("waveform-gluon", audio.device) else "triton"


# The plans of `whisper_log_mel`: its floor folded into the main pass's launch, or launched after it.
ONE_LAUNCH = "one-launch"
TWO_LAUNCHES = "two-launch"
WAVEFORM_PLANS = (ONE_LAUNCH, TWO_LAUNCHES)
# Batches of up to this many clips take ONE_LAUNCH, larger ones TWO_LAUNCHES. One clip's call is bound by host time,
# of which a launch is the largest part; from a few clips on the GPU time bounds the call, and the folded floor's items
# (polling while the main tiles run, two atomics each main program) cost more GPU time than a second launch's gap.
ONE_LAUNCH_MAX_CLIPS = 1


def waveform_plan(B: int) -> str:
    """The plan `whisper_log_mel` takes for a batch of B clips: ONE_LAUNCH up to ONE_LAUNCH_MAX_CLIPS, else
    TWO_LAUNCHES."""
    return ONE_LAUNCH if B <= ONE_LAUNCH_MAX_CLIPS else TWO_LAUNCHES


def log_mel_spectrogram_cuda(stft: torch.Tensor, mel_filters: torch.Tensor) -> torch.Tensor:
    """`log_mel_spectrogram` on validated, contiguous CUDA (or meta) tensors: the band plan, the main pass and the
    floor of `portable/stft.py`, in the tile config its pick table names for the shape."""
    return stage_module(__package__, "portable.stft").launch(stft, mel_filters)


def log_mel_spectrogram_direct(stft: torch.Tensor, mel_filters: torch.Tensor):
    """What `log_mel_spectrogram_cuda(stft, mel_filters)` does, once it ran on tensors on 16 bytes, for every call
    of the same shapes and device on contiguous tensors on 16 bytes (`common.direct_calls.launches_directly`): a
    function (stft, mel_filters) -> out. None where no launcher is kept (the interpreter, no call on 16 bytes yet)."""
    return stage_module(__package__, "portable.stft").kept_launch(stft, mel_filters)


def whisper_log_mel_cuda(audio: torch.Tensor, lengths: torch.Tensor | None, n_mels: int, out_dtype: torch.dtype,
                         plan: str | None = None) -> torch.Tensor:
    """`whisper_log_mel` on validated, contiguous CUDA (or meta) tensors: the main pass on the path `waveform_path`
    picks, its floor in the plan `plan` names (one of WAVEFORM_PLANS; None: `waveform_plan`'s choice)."""
    if plan is None:
        plan = waveform_plan(audio.shape[0])
    elif plan not in WAVEFORM_PLANS:
        raise ValueError(f"unknown plan {plan!r}; the plans are {WAVEFORM_PLANS}")
    with_floor = plan == ONE_LAUNCH
    out, stats, block_f = _waveform_main_pass(audio, lengths, n_mels, out_dtype, with_floor)
    if not with_floor:
        stage_module(__package__, "portable.floor").launch(out, stats, block_f)
    return out


def _waveform_main_pass(audio: torch.Tensor, lengths: torch.Tensor | None, n_mels: int, out_dtype: torch.dtype,
                        with_floor: bool) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(out, stats, block_f) of the main pass (`with_floor`: its floor folded in) in the Gluon kernel where
    `waveform_path` takes it and it compiles, in the portable Triton kernel otherwise."""
    if waveform_path(audio) == "waveform-gluon":
        try:
            return stage_module(__package__, "hopper.waveform").launch(audio, lengths, n_mels, out_dtype,
                                                                       with_floor=with_floor)
        except Exception as error:
            if not falls_back(error):
                raise
            FAST_PATHS.failed("waveform-gluon", error)
            DIRECT_WHISPER.clear()
    return stage_module(__package__, "portable.waveform").launch(audio, lengths, n_mels, out_dtype,
                                                                 with_floor=with_floor)


# The kept direct calls of `whisper_log_mel` (`whisper_log_mel_direct`) and `log_mel_spectrogram`
# (`log_mel_spectrogram_direct`) by their call signatures: see `common.direct_calls.DirectCalls`. The plans
# they hold change only where the Gluon path is switched off, which forgets them.
DIRECT_WHISPER = DirectCalls()
DIRECT_SPECTROGRAM = DirectCalls()


def whisper_log_mel_direct(audio: torch.Tensor, lengths: torch.Tensor | None, n_mels: int, out_dtype: torch.dtype):
    """What `whisper_log_mel_cuda(audio, lengths, n_mels, out_dtype)` does, once it ran on tensors on 16 bytes, for
    every call of the same shapes, dtypes and device on contiguous tensors on 16 bytes
    (`common.direct_calls.launches_directly`): a function (audio, lengths) -> out that allocates the outputs and
    launches the kept kernels of the default plan, on the path `waveform_path` takes. None where no launcher is kept
    (the interpreter, no call on 16 bytes yet)."""
    B, N = audio.shape
    with_floor = waveform_plan(B) == ONE_LAUNCH
    module = "hopper.waveform" if waveform_path(audio) == "waveform-gluon" else "portable.waveform"
    kept = stage_module(__package__, module).kept_launch(audio, lengths, n_mels, out_dtype, with_floor)
    if kept is None:
        return None
    main_pass, block_f = kept
    if with_floor:
        def whisper_log_mel_kept(audio, lengths):
            return main_pass(audio, lengths)[0]

        return whisper_log_mel_kept
    F = N // HOP_LENGTH
    floor_pass = stage_module(__package__, "portable.floor").kept_launch(B, n_mels, F, (F + block_f - 1) // block_f,
                                                                          block_f, audio.device, out_dtype)
    if floor_pass is None:
        return None

    def whisper_log_mel_kept(audio, lengths):
        out, stats = main_pass(audio, lengths)
        floor_pass(out, stats)
        return out

    return whisper_log_mel_kept
