"""The decode step in Triton: a few new tokens per sequence after a carried state, in recurrent form (no chunks).

One program per (sequence, value head, V block) holds its (K, BV) fp32 slice of the state in registers for all of
the sequence's tokens, and writes the final slice to a new state tensor (the carried state is read, never
written). Per token, with q, k, p of the value head's query head (hk = hv // (HV / H)), optionally L2-normalised,
d = exp(g) and S the state before the step, both reads of S come from one pass over it:

    a = S^T p,  b = S^T (scale q)
    u = beta (v - d a)      (the spec's order: decay, then read)      or   u = beta (v - a)   (fla's: read first)
    o = d b + (k . scale q) u
    S = d S + k u^T

which is the recurrence of `recurrent.comba_recurrent_reference` rearranged (S^T q after the write is
d S^T q + k.q u). A log-decay of -inf gives d = 0, a hard reset, as the references' floor does.

Non-finite inputs follow the references' rule without a look from the host: a NaN or inf in q, k, p or v (the whole
row of v, whatever the program's V block), beta or g (g = -inf excepted) at step t makes o from t on, and the final
state, NaN for that sequence and value head. Each step's inputs times zero (NaN exactly where one is non-finite) are
summed into `poison`, which is added to every output from then on.

Offsets of packed sequences are read on the device and clamped into [0, T], so no offsets reach outside the
inputs; their order is not checked (the reference's check reads them on the host)."""

import functools

import torch
import triton
import triton.language as tl

from ..common.launch import Launch, kept_launcher, launch as run
from ..reference import L2NORM_EPS

EPS = tl.constexpr(L2NORM_EPS)

# Head sizes the kernel is planned for (`takes`).
DECODE_K = (64, 128, 256)
DECODE_V = (64, 128, 256, 512)
DECODE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# A program's state slice, K * BV = SLICE fp32 values (BV = 8 at K = 256, 16 at K = 128, 32 at K = 64), in one warp:
# its reductions over K stay in the warp (shuffles, no barrier), and at about 128 registers a thread, no spill
# (sm_90a), sixteen CTAs share an SM and keep 128 KB of state loads in flight on it, where 4 warps with twice the
# slice keep 96 KB (three CTAs) and 4 warps with this slice 64 KB (four CTAs).
DECODE_WARPS = 1
SLICE = 2048


def block_v(K: int, V: int) -> int:
    """The V block of a program: SLICE // K, at most V."""
    return min(V, SLICE // K)


def takes(K: int, V: int, dtype: torch.dtype) -> bool:
    """Whether the fused decode takes inputs of `dtype` with these head sizes."""
    return K in DECODE_K and V in DECODE_V and dtype in DECODE_DTYPES


@triton.jit
def _unit(x, L2NORM: tl.constexpr):
    """x in float32, divided by sqrt(sum(x^2) + eps) if L2NORM."""
    x = x.to(tl.float32)
    if L2NORM:
        x = x * tl.rsqrt(tl.sum(x * x, axis=0) + EPS)
    return x


@triton.jit(do_not_specialize=["T"])
def _decode_kernel(q, k, v, p, beta, g, state, new_state, o, offsets, scale, T, H: tl.constexpr, HV: tl.constexpr,
                   K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, HAS_STATE: tl.constexpr,
                   VARLEN: tl.constexpr, L2NORM: tl.constexpr, READ_FIRST: tl.constexpr):
    pid = tl.program_id(0)
    iv = pid % (V // BV)
    nh = pid // (V // BV)                       # n * HV + hv
    n, hv = nh // HV, nh % HV
    hk = hv // (HV // H)
    if VARLEN:
        bos = tl.minimum(tl.maximum(tl.load(offsets + n).to(tl.int64), 0), T)
        eos = tl.minimum(tl.maximum(tl.load(offsets + n + 1).to(tl.int64), bos), T)
    else:
        bos = n.to(tl.int64) * T
        eos = bos + T
    rk = tl.arange(0, K)
    cv = iv * BV + tl.arange(0, BV)
    rv = tl.arange(0, V)
    # The head's offset in 64 bits, a scalar; the slice's in 32 bits, which stay live over the token loop for the
    # store (64-bit offsets of every element would take twice the registers of the slice itself).
    head = nh.to(tl.int64) * K * V
    slice_at = rk[:, None] * V + cv[None, :]
    if HAS_STATE:
        S = tl.load(state + head + slice_at)
    else:
        S = tl.zeros([K, BV], dtype=tl.float32)
    poison = tl.zeros([BV], dtype=tl.float32)
    for t in range(bos, eos):
        qt = _unit(tl.load(q + (t * H + hk) * K + rk), L2NORM) * scale
        kt = _unit(tl.load(k + (t * H + hk) * K + rk), L2NORM)
        pt = _unit(tl.load(p + (t * H + hk) * K + rk), L2NORM)
        row = (t * HV + hv) * V
        vt = tl.load(v + row + cv).to(tl.float32)
        bt = tl.load(beta + t * HV + hv).to(tl.float32)
        gt = tl.load(g + t * HV + hv)
        bad = (tl.sum(qt * 0.0 + kt * 0.0 + pt * 0.0, axis=0) + tl.sum(tl.load(v + row + rv).to(tl.float32) * 0.0,
                                                                         axis=0)
               + bt * 0.0 + tl.where(gt < 0.0, 0.0, gt * 0.0))
        poison += bad
        d = tl.exp(gt)
        a = tl.sum(S * pt[:, None], axis=0)
        b = tl.sum(S * qt[:, None], axis=0)
        if READ_FIRST:
            u = bt * (vt - a)
        else:
            u = bt * (vt - d * a)
        ot = d * b + tl.sum(kt * qt, axis=0) * u + poison
        tl.store(o + row + cv, ot.to(o.dtype.element_ty))
        S = d * S + kt[:, None] * u[None, :]
    tl.store(new_state + head + slice_at, S + poison[None, :])


def launch(q, k, v, p, beta, g, state, o, new_state, scale: float, cu_seqlens=None, use_qk_l2norm=False,
           read_first=False, block=None, warps=DECODE_WARPS):
    """o (B, T, HV, V) and new_state (N, HV, K, V) float32 of contiguous inputs q, k, p (B, T, H, K), v (B, T, HV, V),
    beta, g (B, T, HV), the carried state (N, HV, K, V) float32 or None (zeros) and cu_seqlens (N + 1,) or None
    (N = B). `block` (a power of two dividing V) and `warps` override the V block (`block_v`) and DECODE_WARPS: the
    tests' small blocks, the harness's sweep. The launch is planned once per call shape (`plan`) and runs through the
    kept launcher of `common.launch`."""
    run(_call_plan(q, v, state, new_state.shape[0], scale, cu_seqlens, use_qk_l2norm, read_first, block, warps),
        (q, k, v, p, beta, g, state, new_state, o, cu_seqlens))


def kept_launch(q, k, v, p, beta, g, state, N: int, scale: float, cu_seqlens=None, use_qk_l2norm=False,
                read_first=False):
    """`launch` with the default V block and warps, for every later call of the same shapes, dtypes, device and
    arguments (N sequences) on tensors on 16 bytes, once it ran on such tensors: a function of the tensors in the
    kernel's order, (q, k, v, p, beta, g, state, new_state, o, cu_seqlens), that launches the kept kernel
    (`common.launch.kept_launcher`); None where no launcher is kept."""
    dtypes = (q.dtype, k.dtype, v.dtype, p.dtype, beta.dtype, g.dtype, None if state is None else state.dtype,
              torch.float32, v.dtype, None if cu_seqlens is None else cu_seqlens.dtype)
    return kept_launcher(_call_plan(q, v, state, N, scale, cu_seqlens, use_qk_l2norm, read_first, None, DECODE_WARPS),
                         q.device.index, dtypes)


def _call_plan(q, v, state, N, scale, cu_seqlens, use_qk_l2norm, read_first, block, warps) -> Launch:
    """`plan` of a call's tensors and arguments: the one cached Launch of `launch` and `kept_launch`."""
    T, H, K = q.shape[1:]
    HV, V = v.shape[2], v.shape[3]
    return plan(N, T, H, HV, K, V, scale, state is not None, cu_seqlens is not None, use_qk_l2norm, read_first, block,
                warps)


@functools.cache
def plan(N: int, T: int, H: int, HV: int, K: int, V: int, scale: float, has_state: bool, varlen: bool, l2norm: bool,
         read_first: bool, block: int | None = None, warps: int = DECODE_WARPS) -> Launch:
    """The decode launch of a call shape and scale (a model has one scale), built once: N HV V / BV programs."""
    BV = block or block_v(K, V)
    meta = dict(H=H, HV=HV, K=K, V=V, BV=BV, HAS_STATE=has_state, VARLEN=varlen, L2NORM=l2norm, READ_FIRST=read_first,
                num_stages=1)
    return Launch(_decode_kernel, N * HV * (V // BV), (scale, T), meta, warps, f"BV={BV} warps={warps}")
