"""How a call of the LDSA window op is planned and which path runs it, in one place: the configurations (paths) and
the table of fast paths, the default table, the tile planning of each path, the choice for a call, and the entry
points that run it (`ldsa_forward`, `ldsa_backward`, through `triton.launch`).

The portable path (`band`, `band-prefetch`: pointer-fed Triton band kernels, `triton.band`) runs on every CUDA GPU
the metadata accepts under every supported Triton; the fast paths (`band-tma`: `triton.band_tma`; `band-gluon`:
`gluon.forward`, `gluon.backward`) run only where their row of FAST_PATHS says they are verified, and the portable
path runs everywhere else. A configuration is picked per call from a fixed table (no autotuning: a shape's first
call costs one compile); the plans are cached by shape, since small calls are host-bound. The op (`op`) imports
this module on a CUDA path's first call: it needs triton.
"""

import functools

import torch
import triton

from .common.devices import on_device
from .common.fast_paths import FastPath, FastPaths
from .triton import band, band_tma
from .triton.launch import Launch, launch, sm_count

try:  # Gluon, Triton's explicit-layout dialect (its Hopper TMA and mma.sync): band-gluon
    from .gluon import backward as gluon_backward
    from .gluon import forward as gluon_forward
except ImportError:  # a Triton without it: the other configurations
    gluon_forward = gluon_backward = None

HOPPER = ((9, 0),)
ALL_TRITONS = ("3.6", "3.7", "3.8", "3.9")

FAST_PATHS = FastPaths("ldsa", (
    FastPath("band-gluon forward", "Gluon, TMA-fed persistent kernel, the band built in mma.sync's registers; "
             "windows of 2-15 taps, calls of 2^18 frames and more", HOPPER,
             verified=("3.6", "3.7", "3.8"), compiles=ALL_TRITONS),
    FastPath("band-gluon backward", "Gluon, TMA-fed persistent kernel, the bands skewed by shared-memory addressing "
             "(views of other row strides under 3.6 and 3.7, gathers and scatters from 3.8); windows of 2-15 taps, "
             "calls of 2^18 frames and more", HOPPER, verified=("3.6", "3.7", "3.8"), compiles=ALL_TRITONS),
    FastPath("band-tma forward", "Triton, tensor descriptors feeding a persistent pipelined band kernel; calls of "
             "2^18 frames and more that band-gluon does not take", HOPPER,
             verified=("3.6", "3.7", "3.8"), compiles=ALL_TRITONS),
    FastPath("band-tma backward", "Triton, the same for the backward with 16-bit values", HOPPER,
             verified=("3.6", "3.7", "3.8"), compiles=ALL_TRITONS),
))

# ---- The configurations and the default table ----

BAND = "band"  # the pointer-fed band kernels (`triton.band`), tiles from the window (`_band_plan`)
# The same forward with the next chunk's loads issued before the current chunk's compute (one channel tile
# only; with several it runs as "band"): the band forward waits on L1 loads.
BAND_PREFETCH = "band-prefetch"
# The band kernels with their tiles copied by the tensor memory accelerator (`triton.band_tma`) on a persistent
# grid. They take calls whose rows TMA can address (`_tma_tiles`); others run as band-prefetch (forward) and band
# (backward).
BAND_TMA = "band-tma"
# The forward in Gluon (`gluon.forward`) on Hopper, its band built in the MMA's registers: windows of up to 15 taps
# (`gluon.forward.takes`); the backward in Gluon (`gluon.backward`), its bands read from skewed shared-memory views
# (`gluon.backward.takes`). The calls they do not take run as band-tma (or band where it cannot).
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


# Calls that `_tma_tiles` takes run band-tma from this many frames (B * H * T) up (`_tma_by_default`).
# Below, calls are launch-bound, and band-tma's host time is longer: its tensor descriptors are encoded every
# call.
TMA_MIN_FRAMES = 1 << 18
# Persistent programs an SM, and pipeline depth (chunks in flight a program, the one computed included): the
# best measured on the H200. Deeper pipelines leave shared memory for fewer programs: 4 forward programs of
# 3 stages, or 3 backward programs (five tiles a stage) of 3 stages, do not fit an SM.
TMA_PROGRAMS_PER_SM = {"forward": 3, "backward": 3}
TMA_STAGES = {"forward": 3, "backward": 2}


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


def _t_align(T: int) -> int:
    """The largest power of two up to 16 dividing T: the kernels' T_ALIGN."""
    return min(16, T & -T)


# Frames per program of the band kernels: at most this many (faster than 256 or 512 in both dtypes), to amortize
# the per-program setup over several chunks ...
FRAMES_PER_PROGRAM = 128
# ... but fewer when the grid would drop below this many programs (about 8 per SM on an H200's 132), so
# that small, launch-bound shapes run their chunks side by side rather than one after another.
MIN_PROGRAMS = 1024


# ---- Tile planning ----

def _pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


# The backward gathers from a [K, BLOCK_W] float32 tile through shared memory; 128 x 128 (64 KiB) is the
# largest it takes. That admits every window up to W = 113 taps; wider windows run the eager reference.
MAX_GATHER_TILE = 128 * 128


@functools.cache
def _band(W: int) -> tuple[int, int, int]:
    """(N frames per chunk, K band rows, BLOCK_W padded taps) for a window of W taps.

    N is the smallest power of two >= W - 1 in [16, 64], so the band K >= N + W - 1 wastes at most about
    half of the MMA; N shrinks while the [K, N] band tile would pass 8192 elements or the backward's
    [K, BLOCK_W] gather tile would pass MAX_GATHER_TILE. BLOCK_W is at least 8: logits tiles of 2 or 4 rows
    (W = 2 to 4) fail Triton 3.6's thread-locality pass for sm_90 in the band kernels and the TMA forward."""
    block_w = max(8, _pow2(W))
    N = min(max(16, _pow2(W - 1)), 64)
    K = _pow2(N + W - 1)
    while N > 16 and (K * N > 8192 or K * block_w > MAX_GATHER_TILE):
        N //= 2
        K = _pow2(N + W - 1)
    return N, K, block_w


@functools.cache
def supports_window(W: int) -> bool:
    """Windows of 2 to 113 taps. A one-tap window (its softmax is 1, the op a copy) fails its float64 check
    on the H200, forward and backward, while passing in the interpreter, so it runs the reference."""
    _, K, block_w = _band(W)
    return W >= 2 and K * block_w <= MAX_GATHER_TILE


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


@functools.cache
def _span_leads(W: int, left: int, T: int, itemsize: int) -> tuple[int, int, int]:
    """(SPAN_ALIGN, lead, lead_right): a chunk's value span starts `lead` >= left positions before its first
    frame (the backward's second span, of the frames reading the chunk's values, `lead_right` >= right),
    rounded up to SPAN_ALIGN so that every row of a span is whole aligned vectors. Triton vectorizes only
    what it can prove aligned: spans starting at t0 - left compile to a 2-byte load per bf16 value and a
    2-byte store per output, aligned ones to pipelined 16-byte cp.async loads. SPAN_ALIGN is the largest power
    of two up to 16 bytes that divides T and keeps the shifted band within the window's K rows."""
    N, K, _ = _band(W)
    right = W - 1 - left
    align = min(_t_align(T), 16 // itemsize)
    while align > 1 and N + W - 1 + max(_round_up(left, align) - left, _round_up(right, align) - right) > K:
        align //= 2
    return align, _round_up(left, align), _round_up(right, align)


@functools.cache
def _tma_tiles(
    direction: str, W: int, left: int, Dh: int, T: int, BH: int, dtype: torch.dtype
) -> tuple[int, int, int, int] | None:
    """(N frames per chunk, K span positions, lead, lead_right) of the `direction` TMA kernel for values of
    `dtype`, or None where it cannot take the call.

    TMA reads rows whose byte stride is a multiple of 16 (T a multiple of 8, for every dtype) at int32
    coordinates, from column offsets that are multiples of 16 bytes: spans start at multiples of 8 frames,
    `lead` (left rounded up to 8) before the chunk for the values its frames read, `lead_right` (right rounded
    up) before it for the frames that read its values, so K >= N + W - 1 plus the larger rounding. Chunks are
    32 frames with K = 64, the fastest on the H200; windows too wide for that take 64 and 128, wider ones none.
    One channel tile: Dh a power of two from 16 (the MMA's least rows) to 128.

    Shared memory (227 KB a program) bounds each direction further. The forward's value tiles stay within
    32 KB (three stages of float32 values at Dh = K = 128 would not fit). The backward holds five tiles a stage,
    so it takes K = 64, Dh <= 64 and only 16-bit values: float32 ones run slower than band with TF32 products
    and spill registers with IEEE ones."""
    right = W - 1 - left
    lead, lead_right = _round_up(left, 8), _round_up(right, 8)
    if T % 8 or Dh not in (16, 32, 64, 128) or BH * max(Dh, _pow2(W)) >= 2**31:
        return None
    fitting = [(N, K) for N, K in ((32, 64), (64, 128)) if N + W - 1 + max(lead - left, lead_right - right) <= K]
    if not fitting:
        return None
    N, K = fitting[0]
    if direction == "forward" and Dh * K * dtype.itemsize > 32768:
        return None
    if direction == "backward" and (K > 64 or Dh > 64 or dtype == torch.float32):
        return None
    return N, K, lead, lead_right


@functools.cache
def _band_plan(W: int, left: int, Dh: int, T: int, BH: int, itemsize: int) -> tuple[int, tuple, dict, int]:
    """(programs per (b, h), the span leads, meta-parameters, num_warps) for W taps of which `left` before
    the frame, Dh channels, T frames, B*H sequences and values of `itemsize` bytes."""
    if not supports_window(W):
        raise ValueError(f"the band design does not take a {W}-tap window (see supports_window)")
    N, K, block_w = _band(W)
    span_align, *leads = _span_leads(W, left, T, itemsize)
    block_d = max(16, min(_pow2(Dh), 128, 16384 // K))  # a [BLOCK_D, K] value tile stays in registers
    all_chunks = BH * triton.cdiv(T, N)
    chunks = max(1, min(FRAMES_PER_PROGRAM // N, triton.cdiv(T, N), all_chunks // MIN_PROGRAMS))
    n_ttiles = triton.cdiv(T, chunks * N)
    num_warps = 4 if K * max(block_d, block_w, N) <= 4096 else 8
    meta = dict(N=N, K=K, BLOCK_W=block_w, BLOCK_D=block_d, D_TILES=triton.cdiv(Dh, block_d), CHUNKS=chunks,
                T_ALIGN=_t_align(T), SPAN_ALIGN=span_align)
    return n_ttiles, tuple(leads), meta, num_warps


def _tma_plan(
    direction: str, N: int, K: int, W: int, Dh: int, T: int, BH: int, dtype: torch.dtype, device: int
) -> tuple:  # fmt: skip
    """(programs, (chunks a head, all chunks), meta-parameters, num_warps) of a TMA kernel with N-frame parts
    and K-position spans: a persistent grid of TMA_PROGRAMS_PER_SM programs an SM, or one a chunk when there
    are fewer chunks.

    The forward's chunks are two parts where the tiles are N = 32, K = 64 with Dh <= 64 and 16-bit values
    (larger value tiles, two a stage, would leave shared memory for one program an SM), one part otherwise;
    its logits tiles have a row of zero weight past the window (BLOCK_W > W) for the band's out-of-band
    positions. The backward's chunks are one part, its logits tiles the band kernels'."""
    if direction == "forward":
        parts = 2 if (N, K) == (32, 64) and Dh <= 64 and dtype != torch.float32 else 1
        meta = dict(N=N, K=K, BLOCK_W=max(8, _pow2(W + 1)), BLOCK_D=Dh, PARTS=parts)
    else:
        parts = 1
        meta = dict(N=N, K=K, BLOCK_W=_band(W)[2], BLOCK_D=Dh)
    n_chunks = triton.cdiv(T, parts * N)
    programs = min(BH * n_chunks, sm_count(device) * TMA_PROGRAMS_PER_SM[direction])
    meta["STAGES"] = TMA_STAGES[direction]
    return programs, (n_chunks, BH * n_chunks), meta, 4 if K * N <= 2048 else 8



# ---- The choice for a call, and the entry points ----


def clear_plans() -> None:
    """Forget the cached plans and launches that depend on the tunables (DEFAULT_CONFIG, FRAMES_PER_PROGRAM,
    MIN_PROGRAMS, the TMA_ constants, the Gluon modules' PROGRAMS_PER_SM and the forward's STAGES): for tests and
    benchmarks that change those."""
    for plan in (_band_plan, _forward_launch, _backward_launch):
        plan.cache_clear()
    _signature_launches.clear()


def _chosen_config(direction: str, config: str | None, W: int, dtype: torch.dtype, tma: bool) -> str:
    """`config`, checked against the direction's configurations, or the default's choice for the call
    (`tma`: `_tma_by_default`)."""
    configs = FORWARD_CONFIGS if direction == "forward" else BACKWARD_CONFIGS
    config = config or default_config(direction, W, dtype, tma)
    if config not in configs:
        raise ValueError(f"unknown {direction} config {config!r}; the configs are {configs}")
    return config


def _gluon_lead(W: int, left: int, Dh: int, T: int, BH: int, dtype: torch.dtype) -> int | None:
    """band-gluon's forward span lead for a call its rule takes (`gluon.forward.takes`), else None: left rounded up
    to 8, TMA's 16-byte column offsets, as band-tma's (`_tma_tiles`)."""
    lead = _round_up(left, 8)
    return lead if gluon_forward is not None and gluon_forward.takes(W, lead - left, Dh, T, BH, dtype) else None


def gluon_launch(direction: str, W: int, left: int, Dh: int, T: int, BH: int, dtype: torch.dtype,
                 device: int) -> Launch | None:  # fmt: skip
    """band-gluon's launch in `direction` for a call its rule takes (`gluon.forward.takes`, `gluon.backward.takes`),
    else None; whether the path runs on the call's device is `_gluon_runs`' question."""
    fast_path = f"{BAND_GLUON} {direction}"
    if direction == "forward":
        lead = _gluon_lead(W, left, Dh, T, BH, dtype)
        if lead is None:
            return None
        return gluon_forward.launch(W, left, lead, Dh, T, BH, dtype, device, BAND_GLUON, fast_path)
    if gluon_backward is None or not gluon_backward.takes(W, left, Dh, T, BH, dtype):
        return None
    return gluon_backward.launch(W, left, Dh, T, BH, dtype, device, BAND_GLUON, fast_path)


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


@functools.cache
def _forward_launch(
    config: str | None, W: int, left: int, Dh: int, T: int, BH: int, dtype: torch.dtype, aligned: bool, device: int,
    logits_dtype: torch.dtype | None = None,
) -> Launch:
    """The forward's launch for values of `dtype` (logits of `logits_dtype`, None: the same), built once per shape
    since small calls are host-bound. `aligned`: every tensor starts on 16 bytes (TMA's condition); `device`: the
    CUDA device's index (-1 for the interpreter's CPU tensors). config None takes band-gluon for the calls it
    takes (`_gluon_runs`, `gluon_launch`) from TMA_MIN_FRAMES frames up, else the default table's choice;
    band-gluon asked for runs as band-tma where it cannot.

    band-gluon: `gluon.forward.launch`. band-tma: `_tma_tiles`, `_tma_plan`, `triton.band_tma.forward_launch`. The
    others: `_band_plan`, `triton.band.forward_launch`."""
    gluon = gluon_launch("forward", W, left, Dh, T, BH, dtype, device) if _gluon_runs(
        "forward", aligned, logits_dtype, dtype, device) else None
    if config == BAND_GLUON or (config is None and gluon is not None and BH * T >= TMA_MIN_FRAMES):
        if gluon is not None:
            return gluon
        config = BAND_TMA
    tiles = _tma_tiles("forward", W, left, Dh, T, BH, dtype) if _tma_runs("forward", aligned, device) else None
    config = _chosen_config("forward", config, W, dtype, _tma_by_default(tiles, Dh, dtype, BH * T))
    if config == BAND_TMA and tiles is not None:
        plan = _tma_plan("forward", *tiles[:2], W, Dh, T, BH, dtype, device)
        return band_tma.forward_launch(tiles, plan, W, left, Dh, T, BH, config, f"{BAND_TMA} forward")
    if config == BAND_TMA:
        config = BAND_PREFETCH
    plan = _band_plan(W, left, Dh, T, BH, dtype.itemsize)
    return band.forward_launch(plan, W, left, Dh, T, BH, config == BAND_PREFETCH, config)


@functools.cache
def _backward_launch(
    config: str | None, W: int, left: int, Dh: int, T: int, BH: int, dtype: torch.dtype, aligned: bool, device: int,
    logits_dtype: torch.dtype | None = None,
) -> Launch:
    """The backward's launch for values (and grad_out) of `dtype` and logits of `logits_dtype` (None: the same), as
    `_forward_launch`: band-gluon for the calls `gluon.backward.takes` on Hopper from TMA_MIN_FRAMES frames up
    (asked for elsewhere, it runs as band-tma, or band where that cannot), band-tma where `_tma_tiles` takes the
    call (band otherwise), band."""
    gluon = gluon_launch("backward", W, left, Dh, T, BH, dtype, device) if _gluon_runs(
        "backward", aligned, logits_dtype, dtype, device) else None
    if config == BAND_GLUON or (config is None and gluon is not None and BH * T >= TMA_MIN_FRAMES):
        if gluon is not None:
            return gluon
        config = BAND_TMA
    tiles = _tma_tiles("backward", W, left, Dh, T, BH, dtype) if _tma_runs("backward", aligned, device) else None
    config = _chosen_config("backward", config, W, dtype, _tma_by_default(tiles, Dh, dtype, BH * T))
    if config == BAND_TMA and tiles is not None:
        plan = _tma_plan("backward", *tiles[:2], W, Dh, T, BH, dtype, device)
        return band_tma.backward_launch(tiles, plan, W, left, Dh, T, BH, config, f"{BAND_TMA} backward")
    plan = _band_plan(W, left, Dh, T, BH, dtype.itemsize)
    return band.backward_launch(plan, W, left, Dh, T, BH, BAND)


def forward_launch(a_logits: torch.Tensor, v: torch.Tensor, left: int, right: int, config: str | None = None):
    """The launch `ldsa_forward` makes for these inputs (its `.config` names the configuration that runs).
    The output, a fresh allocation, starts on 16 bytes like every block of torch's allocators."""
    B, H, Dh, T = v.shape
    aligned = a_logits.data_ptr() % 16 == 0 and v.data_ptr() % 16 == 0
    return _forward_launch(config, left + right + 1, left, Dh, T, B * H, v.dtype, aligned, v.get_device(),
                           a_logits.dtype)


def backward_launch(a_logits, v, grad_out, left: int, right: int, config: str | None = None) -> Launch:
    """The launch `ldsa_backward` makes for these inputs (v and grad_out of one dtype), as `forward_launch`."""
    B, H, Dh, T = v.shape
    aligned = a_logits.data_ptr() % 16 == 0 and v.data_ptr() % 16 == 0 and grad_out.data_ptr() % 16 == 0
    return _backward_launch(config, left + right + 1, left, Dh, T, B * H, v.dtype, aligned, v.get_device(),
                            a_logits.dtype)


def ldsa_forward(a_logits: torch.Tensor, v: torch.Tensor, left: int, right: int, config: str | None = None):
    """Fused forward on contiguous a_logits [B,H,W,T] and v [B,H,Dh,T] (validated by the caller).

    `config` names one of FORWARD_CONFIGS; None takes the default table's choice."""
    return _run_forward(lambda: forward_launch(a_logits, v, left, right, config), a_logits, v)


# The default forward launches of the public op's direct calls, by (call signature, inputs on 16 bytes): see
# `ldsa_forward_of_signature`. Bounded like the op's set of checked signatures.
_signature_launches: dict = {}
MAX_SIGNATURE_LAUNCHES = 8192


def ldsa_forward_of_signature(signature: tuple, a_logits: torch.Tensor, v: torch.Tensor, left: int, right: int):
    """`ldsa_forward` with the default launch, found by the public op's call signature (the shapes, dtypes and
    devices of both tensors and the window: everything `forward_launch` reads of a call but the alignment). The
    op has built the signature for its argument checks; one lookup by it and the alignment replaces
    `forward_launch`'s derivation of its cache key at about half the host time."""
    key = (signature, a_logits.data_ptr() % 16 == 0 and v.data_ptr() % 16 == 0)

    def plan() -> Launch:
        found = _signature_launches.get(key)
        if found is None:
            if len(_signature_launches) >= MAX_SIGNATURE_LAUNCHES:
                _signature_launches.clear()
            found = _signature_launches[key] = forward_launch(a_logits, v, left, right)
        return found

    return _run_forward(plan, a_logits, v)


def _run_forward(plan, a_logits: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(v)
    with on_device(v):
        _run(plan, (a_logits, v, out))
    return out


def ldsa_backward(
    a_logits: torch.Tensor, v: torch.Tensor, grad_out: torch.Tensor, left: int, right: int, config: str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused backward: (dlogits in a_logits' dtype, dv in v's dtype) from contiguous saved inputs.

    `config` names one of BACKWARD_CONFIGS; None takes the default table's choice. Autograd hands grad_out
    in v's dtype; with another dtype both run in float32 (exact upcasts, since the V^T G product needs one
    operand dtype)."""
    vals = v
    if grad_out.dtype != v.dtype:
        vals, grad_out = v.float(), grad_out.float()
    dlogits = torch.empty_like(a_logits)
    dv = torch.empty_like(v)
    with on_device(v):
        _run(lambda: backward_launch(a_logits, vals, grad_out, left, right, config),
             (a_logits, vals, grad_out, dlogits, dv))
    return dlogits, dv


def _run(plan, tensors: tuple) -> None:
    """Launch `plan()`'s kernel on `tensors`. A fast path whose first launch fails to compile is switched off
    (`FAST_PATHS.failed`, one warning) and the plans forgotten, and the call planned again: each failure switches
    one path off, and the portable launches are not caught, so this ends."""
    while (error := launch(chosen := plan(), tensors)) is not None:
        FAST_PATHS.failed(chosen.fast_path, error)
        clear_plans()
