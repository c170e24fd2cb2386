"""The clamped log10 the main passes end with, log10(max(mel, 1e-10)), and its constants: `log10_clamped` of a
mel tile (the STFT pass) and `log10_scaled`, which takes a power-of-two scale of the tile back inside the log (the
waveform passes, Triton and Gluon)."""

import triton
import triton.language as tl

# Globals read inside @triton.jit functions must be constexpr.
LOG10_2 = tl.constexpr(0.301029995663981195)  # log10(x) = log2(x) * log10(2)
# torch.log10(torch.tensor(1e-10)) is exactly -10.0 in fp32: the value of every clamped (silent) bin.
LOG10_CLAMP = tl.constexpr(-10.0)


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
def log10_scaled(mel, e, HW_LOG2: tl.constexpr):
    """log10(max(mel * 2^-e, 1e-10)) for mel >= 0 times 2^e (e an integer), without forming mel * 2^-e, which
    may leave fp32's range: log2(mel) - e, times log10(2), floored at -10; zero gives exactly -10, and NaN
    stays NaN."""
    if HW_LOG2:
        log2 = tl.inline_asm_elementwise("lg2.approx.f32 $0, $1;", "=f,f", [mel], dtype=tl.float32, is_pure=True,
                                         pack=1)
    else:
        log2 = tl.log2(mel)
    log = (log2 - e) * LOG10_2
    return tl.where(log <= LOG10_CLAMP, LOG10_CLAMP, log)
