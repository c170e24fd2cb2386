"""The pieces the log-mel kernels end with: the STFT kernel's clamped log10 of a mel tile (the waveform kernel's
`log10_scaled` takes its power-of-two scale inside the log instead), the log's constants, and a clip's 80 dB floor
from its tiles' statistics."""

import triton
import triton.language as tl

# Globals read inside @triton.jit functions must be constexpr.
LOG10_2 = tl.constexpr(0.301029995663981195)  # log10(x) = log2(x) * log10(2)
# torch.log10(torch.tensor(1e-10)) is exactly -10.0 in fp32: the value of every clamped (silent) bin.
LOG10_CLAMP = tl.constexpr(-10.0)
STATS_CHUNK = 256  # tile statistics per step of the clip-maximum reduction (`clip_floor`)


@triton.jit
def log10_clamped(mel, HW_LOG2: tl.constexpr):
    """log10(max(mel, 1e-10)); with HW_LOG2 through the hardware log2 (`lg2.approx.f32`, absolute error about
    2^-22), else through libdevice's log2, which takes about 30 instructions a value: with the hardware one
    the main pass issues fewer instructions and runs closer to copy bandwidth on sm_90, at the same output
    error. The clamp discards its value at or below 1e-10, subnormals included."""
    if HW_LOG2:
        log2 = tl.inline_asm_elementwise("lg2.approx.f32 $0, $1;", "=f,f", [mel], dtype=tl.float32, is_pure=True,
                                         pack=1)
    else:
        log2 = tl.log2(mel)
    # `<=` keeps a NaN on the log2 side, so NaN input stays NaN instead of becoming silence.
    return tl.where(mel <= 1e-10, LOG10_CLAMP, log2 * LOG10_2)


@triton.jit
def clip_floor(stats_ptr, clip, n_tiles, CHUNK: tl.constexpr):
    """hi - 8 for `clip`, hi being the max of its tile maxima (stats hold (max, min) per tile)."""
    base = stats_ptr + clip.to(tl.int64) * n_tiles * 2
    hi = tl.full((), float("-inf"), tl.float32)
    for t0 in range(0, n_tiles, CHUNK):
        t = t0 + tl.arange(0, CHUNK)
        hi = tl.maximum(hi, tl.max(tl.load(base + 2 * t, mask=t < n_tiles, other=float("-inf"))))
    return hi - 8.0
