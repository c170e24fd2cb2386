"""How a call of the LDSA window op is planned and which path runs it, in one place: the configurations (paths) and
the table of fast paths, the default table, the choice for a call (`plan`, one cascade for both directions), the
fall-back from a fast path that fails to compile, and the CUDA entry points that run a call (`ldsa_forward_cuda`,
`ldsa_backward_cuda`).

The portable path (`band`, `band-prefetch`: pointer-fed Triton band kernels, `portable.band`) runs on every CUDA GPU
the metadata accepts under every supported Triton; the fast paths (`band-tma`: `hopper.band_tma`; `band-gluon`:
`hopper.band_forward`, `hopper.band_backward`) run only where their row of FAST_PATHS says they are verified, and the
portable path runs everywhere else. Each stage module plans its own tiles and builds its launch; a configuration is
picked per call from a fixed table (no autotuning: a shape's first call costs one compile), and the launches are
cached by shape, since small calls are host-bound. Without triton (CPU torch wheels) every call runs the eager
reference.
"""

from __future__ import annotations

import functools

import torch

from .common.devices import on_device
from .common.direct_calls import DirectCalls
from .common.fast_paths import TRITON_RELEASE, FastPath, FastPaths
from .reference import ldsa_backward_reference, ldsa_forward_reference

if TRITON_RELEASE is not None:  # the kernels need triton
    from .hopper import band_tma
    from .portable import band
    from .common.launch import Launch, kept_launcher, launch

    try:  # Gluon, Triton's explicit-layout dialect (its Hopper TMA and mma.sync): band-gluon
        from .hopper import band_backward, band_forward
    except ImportError:  # a Triton without it: the other configurations
        band_forward = band_backward = None

HOPPER = ((9, 0),)
ALL_TRITONS = ("3.6", "3.7", "3.8", "3.9")

FAST_PATHS = FastPaths("ldsa", (
    FastPath("band-gluon forward", "Gluon, TMA-fed persistent kernel, the band built in mma.sync's registers; "
             "windows of 2-15 taps, calls of 2^18 frames and more", HOPPER,
             verified=ALL_TRITONS, compiles=ALL_TRITONS),
    FastPath("band-gluon backward", "Gluon, TMA-fed persistent kernel, the bands skewed by shared-memory addressing "
             "(views of other row strides under 3.6 and 3.7, gathers and scatters from 3.8); windows of 2-15 taps, "
             "calls of 2^18 frames and more", HOPPER, verified=ALL_TRITONS, compiles=ALL_TRITONS),
    FastPath("band-tma forward", "Triton, tensor descriptors feeding a persistent pipelined band kernel; calls of "
             "2^18 frames and more that band-gluon does not take", HOPPER,
             verified=ALL_TRITONS, compiles=ALL_TRITONS),
    FastPath("band-tma backward", "Triton, the same for the backward with 16-bit values", HOPPER,
             verified=ALL_TRITONS, compiles=ALL_TRITONS),
))


def kernel_path(x: torch.Tensor) -> str:
    """Which implementation a call on `x`'s device takes: "triton" or "reference" (windows of 2 to 113
    taps; other windows run the reference on every device)."""
    return "triton" if x.is_cuda and TRITON_RELEASE is not None else "reference"


# ---- The configurations and the default table ----

BAND = "band"  # the pointer-fed band kernels (`portable.band`), tiles from the window (`band.plan`)
# The same forward with the next chunk's loads issued before the current chunk's compute (one channel tile
# only; with several it runs as "band"): the band forward waits on L1 loads.
BAND_PREFETCH = "band-prefetch"
# The band kernels with their tiles copied by the tensor memory accelerator (`hopper.band_tma`) on a persistent
# grid. They take calls whose rows TMA can address (`band_tma.tiles`); others run as band-prefetch (forward) and band
# (backward).
BAND_TMA = "band-tma"
# The forward in Gluon (`hopper.band_forward`) on Hopper, its band built in the MMA's registers: windows of up to 15
# taps (`band_forward.takes`); the backward in Gluon (`hopper.band_backward`), its bands read from skewed
# shared-memory views (`band_backward.takes`). The calls they do not take run as band-tma (or band where it cannot).
BAND_GLUON = "band-gluon"
FORWARD_CONFIGS = (BAND, BAND_PREFETCH, BAND_TMA, BAND_GLUON)
BACKWARD_CONFIGS = (BAND, BAND_TMA, BAND_GLUON)

# The configuration a call takes below band-tma's reach (`default_config`): (pass, window of at most 32 taps,
# float32 values) -> config name. Wider windows keep the band design, whose tiles are sized for them.
# Prefetching the next chunk is faster for 16-bit forward windows up to 32 taps, measured on the H200 (though
# not for small causal calls). Float32 takes `band`: with TF32 products it beats band-prefetch.
DEFAULT_CONFIG = {
    ("forward", True, False): BAND_PREFETCH,
    ("forward", True, True): BAND,
    ("forward", False, False): BAND,
    ("forward", False, True): BAND,
    ("backward", True, False): BAND,
    ("backward", True, True): BAND,
    ("backward", False, False): BAND,
    ("backward", False, True): BAND,
}

# Calls that `band_tma.tiles` takes run band-tma from this many frames (B * H * T) up (`_tma_by_default`), and calls
# that band-gluon takes run band-gluon. Below, calls are launch-bound, and the fast paths' host time is longer: their
# tensor descriptors are encoded every call.
TMA_MIN_FRAMES = 1 << 18


def default_config(direction: str, W: int, dtype: torch.dtype, tma: bool = False) -> str:
    """The configuration a call takes; `tma`: band-tma takes the call by default (`_tma_by_default`)."""
    if tma:
        return BAND_TMA
    return DEFAULT_CONFIG[(direction, W <= 32, dtype == torch.float32)]


def _tma_by_default(tiles, Dh: int, dtype: torch.dtype, frames: int) -> bool:
    """Whether the default runs band-tma for a call of `frames` frames (B * H * T) whose TMA tiles are `tiles`
    (None where TMA cannot take it): from TMA_MIN_FRAMES frames up, and for float32 values only with value
    tiles of at most 16 KB, where it beats `band`. Larger float32 tiles leave shared memory for one program
    an SM."""
    if tiles is None or frames < TMA_MIN_FRAMES:
        return False
    return dtype != torch.float32 or Dh * tiles[1] * 4 <= 16384


def _chosen_config(direction: str, config: str | None, W: int, dtype: torch.dtype, tma: bool) -> str:
    """`config`, checked against the direction's configurations, or the default's choice for the call
    (`tma`: `_tma_by_default`)."""
    configs = FORWARD_CONFIGS if direction == "forward" else BACKWARD_CONFIGS
    config = config or default_config(direction, W, dtype, tma)
    if config not in configs:
        raise ValueError(f"unknown {direction} config {config!r}; the configs are {configs}")
    return config


# ---- Where each path runs ----


@functools.cache
def _fused(W: int) -> bool:
    """Whether the fused kernels take a W-tap window (`band.supports_window`: 2 to 113 taps) with triton
    installed; the other calls run the reference."""
    return TRITON_RELEASE is not None and band.supports_window(W)


def _gluon_runs(direction: str, aligned: bool, logits_dtype: torch.dtype | None, dtype: torch.dtype,
                device: int) -> bool:  # fmt: skip
    """Whether band-gluon can run a call in `direction`, whatever its window: tensors on 16 bytes (TMA), logits in
    the values' dtype (None: the same), and CUDA device `device` where FAST_PATHS runs it (not the interpreter,
    -1)."""
    return (aligned and logits_dtype in (None, dtype) and device >= 0
            and FAST_PATHS.runs(f"{BAND_GLUON} {direction}", torch.device("cuda", device)))


def _tma_runs(direction: str, aligned: bool, device: int) -> bool:
    """Whether band-tma can run a call in `direction`: tensors on 16 bytes and CUDA device `device` where
    FAST_PATHS runs it, or the interpreter's CPU tensors and meta tensors (-1) while it is not switched off."""
    name = f"{BAND_TMA} {direction}"
    if device < 0:
        return aligned and name not in FAST_PATHS.switched_off
    return aligned and FAST_PATHS.runs(name, torch.device("cuda", device))


def gluon_launch(direction: str, W: int, left: int, Dh: int, T: int, BH: int, dtype: torch.dtype,
                 device: int) -> Launch | None:  # fmt: skip
    """band-gluon's launch in `direction` for a call its module takes (`band_forward.takes`, `band_backward.takes`),
    else None; whether the path runs on the call's device is `_gluon_runs`' question."""
    module = band_forward if direction == "forward" else band_backward
    if module is None or not module.takes(W, left, Dh, T, BH, dtype):
        return None
    return module.launch(W, left, Dh, T, BH, dtype, device, BAND_GLUON, f"{BAND_GLUON} {direction}")


# ---- The choice for a call: one cascade for both directions ----


@functools.cache
def _plan(
    direction: str, config: str | None, W: int, left: int, Dh: int, T: int, BH: int, dtype: torch.dtype,
    aligned: bool, device: int, logits_dtype: torch.dtype | None = None,
) -> Launch:  # fmt: skip
    """The launch in `direction` for values (and grad_out) of `dtype` and logits of `logits_dtype` (None: the same),
    built once per shape since small calls are host-bound. `aligned`: every tensor starts on 16 bytes (TMA's
    condition); `device`: the CUDA device's index (-1 for the interpreter's CPU tensors and meta tensors).

    config None takes band-gluon for the calls it takes (`_gluon_runs`, `gluon_launch`) from TMA_MIN_FRAMES frames
    up, else the default table's choice; band-gluon asked for runs as band-tma where it cannot, and band-tma asked
    for where `band_tma.tiles` does not take the call runs as band-prefetch (forward) or band (backward)."""
    gluon = gluon_launch(direction, W, left, Dh, T, BH, dtype, device) if _gluon_runs(
        direction, aligned, logits_dtype, dtype, device) else None
    if config == BAND_GLUON or (config is None and gluon is not None and BH * T >= TMA_MIN_FRAMES):
        if gluon is not None:
            return gluon
        config = BAND_TMA
    tiles = band_tma.tiles(direction, W, left, Dh, T, BH, dtype) if _tma_runs(direction, aligned, device) else None
    config = _chosen_config(direction, config, W, dtype, _tma_by_default(tiles, Dh, dtype, BH * T))
    forward = direction == "forward"
    if config == BAND_TMA and tiles is not None:
        launch_tma = band_tma.launch_forward if forward else band_tma.launch_backward
        return launch_tma(tiles, W, left, Dh, T, BH, dtype, device, config, f"{BAND_TMA} {direction}")
    if config == BAND_TMA:
        config = BAND_PREFETCH if forward else BAND
    if forward:
        return band.launch_forward(W, left, Dh, T, BH, dtype, config == BAND_PREFETCH, config)
    return band.launch_backward(W, left, Dh, T, BH, dtype, config)


def plan(direction: str, inputs: tuple, left: int, right: int, config: str | None = None) -> Launch:
    """The launch `ldsa_<direction>_cuda` makes for its `inputs`, (a_logits, v) forward and (a_logits, v, grad_out)
    backward, v and grad_out of one dtype (its `.config` names the configuration that runs). The outputs, fresh
    allocations, start on 16 bytes like every block of torch's allocators."""
    a_logits, v = inputs[:2]
    B, H, Dh, T = v.shape
    aligned = all(x.data_ptr() % 16 == 0 for x in inputs)
    return _plan(direction, config, left + right + 1, left, Dh, T, B * H, v.dtype, aligned, v.get_device(),
                 a_logits.dtype)


# The kept direct calls of the public function (`ldsa_forward_direct`) by its call signature: see
# `common.direct_calls.DirectCalls`.
DIRECT_FORWARDS = DirectCalls()


def clear_plans() -> None:
    """Forget the cached plans and launches that depend on the tunables (DEFAULT_CONFIG, TMA_MIN_FRAMES, the band
    module's FRAMES_PER_PROGRAM and MIN_PROGRAMS, the Hopper modules' PROGRAMS_PER_SM and STAGES): for tests and
    benchmarks that change those."""
    band.plan.cache_clear()
    _plan.cache_clear()
    DIRECT_FORWARDS.clear()


# ---- The entry points ----


def ldsa_forward_cuda(a_logits: torch.Tensor, v: torch.Tensor, left: int, right: int,
                      config: str | None = None) -> torch.Tensor:  # fmt: skip
    """The forward on contiguous a_logits [B,H,W,T] and v [B,H,Dh,T] of one device (validated by the caller):
    the fused kernels, or the reference for windows they do not take (`_fused`).

    `config` names one of FORWARD_CONFIGS (its kernels must take the window); None takes the default table's
    choice."""
    if config is None and not _fused(left + right + 1):
        return ldsa_forward_reference(a_logits, v, left, right)
    out = torch.empty_like(v)
    with on_device(v):
        _run(lambda: plan("forward", (a_logits, v), left, right, config), (a_logits, v, out))
    return out


def ldsa_forward_direct(a_logits: torch.Tensor, v: torch.Tensor, left: int, right: int):
    """What `ldsa_forward_cuda(a_logits, v, left, right)` does, once it ran on tensors on 16 bytes, for every call of
    the same shapes, dtypes, device and window on contiguous tensors on 16 bytes
    (`common.direct_calls.launches_directly`): a function (a_logits, v) -> out that allocates out and launches the
    default plan's kept kernel. None where the call runs the reference or no launcher is kept (the interpreter, no
    call on 16 bytes yet)."""
    if not _fused(left + right + 1):
        return None
    B, H, Dh, T = v.shape
    device = v.get_device()
    launch = _plan("forward", None, left + right + 1, left, Dh, T, B * H, v.dtype, True, device, a_logits.dtype)
    launch_kept = kept_launcher(launch, v.device.index, (a_logits.dtype, v.dtype, v.dtype))
    if launch_kept is None:
        return None
    empty_like = torch.empty_like

    def ldsa_forward_kept(a_logits, v):
        out = empty_like(v)
        launch_kept(a_logits, v, out)
        return out

    return ldsa_forward_kept


def ldsa_backward_cuda(
    a_logits: torch.Tensor, v: torch.Tensor, grad_out: torch.Tensor, left: int, right: int, config: str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(dlogits in a_logits' dtype, dv in v's dtype) from contiguous saved inputs and grad_out (checked by the
    caller), as `ldsa_forward_cuda`: the fused kernels, or the reference for windows they do not take.

    `config` names one of BACKWARD_CONFIGS; None takes the default table's choice. Autograd hands grad_out
    in v's dtype; with another dtype both run in float32 (exact upcasts, since the V^T G product needs one
    operand dtype)."""
    if config is None and not _fused(left + right + 1):
        return ldsa_backward_reference(a_logits, v, grad_out, left, right)
    vals = v
    if grad_out.dtype != v.dtype:
        vals, grad_out = v.float(), grad_out.float()
    dlogits = torch.empty_like(a_logits)
    dv = torch.empty_like(v)
    with on_device(v):
        _run(lambda: plan("backward", (a_logits, vals, grad_out), left, right, config),
             (a_logits, vals, grad_out, dlogits, dv))
    return dlogits, dv


def _run(launch_of, tensors: tuple) -> None:
    """Launch `launch_of()`'s kernel on `tensors`. A fast path whose first launch fails to compile is switched off
    (`FAST_PATHS.failed`, one warning) and the plans forgotten, and the call planned again: each failure switches
    one path off, and the portable launches are not caught, so this ends."""
    while (error := launch(chosen := launch_of(), tensors)) is not None:
        FAST_PATHS.failed(chosen.fast_path, error)
        clear_plans()
