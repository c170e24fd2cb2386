"""The decode step: T new tokens (1 <= T <= 64) of N sequences from their carried state, in recurrent form, one
launch.

The state is the public pair (S (N, H, P, V), z (N, H, P)), float32, over phi(x) = [1, x, x (x) x / sqrt(2)]
(P = 1 + K + K^2 rows: the constant, the K linear rows, then the K^2 ordered pairs (a, b) at row 1 + K + a K + b;
`reference.py`). Per token t, with q~ = scale q:

    S += phi(k_t) v_t^T,    z += phi(k_t),    o_t = phi(q~_t) . S / (phi(q~_t) . z + 1e-6).

Reading and writing S is the whole cost (P V 4 bytes each way per sequence and head; q, k, v, o and z are small),
so the kernel is built for memory bandwidth: a program owns BV whole columns of S of one (n, h), loads them once
into registers (as three tiles, the constant row, the linear rows and the quadratic rows, each a power of two),
runs every token on them and stores them once. A read-out sums over all P rows of a column, so columns are never
split across programs; splitting V gives N H ceil(V / BV) programs, enough to fill the GPU at serving batch sizes.
Each program also reads z whole (one KiB) to form the normaliser; the program of the first V tile writes the new z.
V is a compile-time constant (a model has one or two), so that the state's offsets are immediates rather than
registers held across the tokens.

Everything is fp32 elementwise arithmetic and row sums (no matmul), so fp32, bf16 and fp16 q, k, v run the same
code, converted to fp32 on load; o is stored in v's dtype. The new state goes to separate buffers: the V tiles of
one (n, h) all read z before any of them may write it, which an in-place update could not guarantee.
"""

import functools

import torch
import triton
import triton.language as tl

from ..common.launch import Launch, kept_launcher, launch as run
from .tiles import _EPS, _sequence_row

_INV_SQRT2 = tl.constexpr(2**-0.5)


@triton.jit
def _decode_kernel(
    q, k, v, S_in, z_in, o, S_out, z_out,
    T, H, scale,
    K: tl.constexpr, KK: tl.constexpr, V: tl.constexpr, BV: tl.constexpr,
):
    # the V tiles of one (n, h) are neighbours in launch order, so that the programs running together read whole
    # rows of S
    n_tiles = tl.cdiv(V, BV)
    pid_bh = tl.program_id(0) // n_tiles
    pid_v = tl.program_id(0) % n_tiles
    P = 1 + K + KK
    row = _sequence_row(pid_bh, T, H)
    q += row * K
    k += row * K
    v += row * V
    o += row * V
    state = pid_bh.to(tl.int64) * P
    S_in += state * V
    S_out += state * V
    z_in += state
    z_out += state

    cols = pid_v * BV + tl.arange(0, BV)
    inside = cols < V
    lin = tl.arange(0, K)
    pair = tl.arange(0, KK)
    pa, pb = pair // K, pair % K  # the quadratic row 1 + K + pair holds x_pa x_pb / sqrt(2)
    lin_rows = (1 + lin)[:, None] * V + cols[None, :]  # int32: P V is far below 2^31
    quad_rows = (1 + K + pair)[:, None] * V + cols[None, :]
    S0 = tl.load(S_in + cols, mask=inside, other=0.0)
    S1 = tl.load(S_in + lin_rows, mask=inside[None, :], other=0.0)
    S2 = tl.load(S_in + quad_rows, mask=inside[None, :], other=0.0)
    z0 = tl.load(z_in)
    z1 = tl.load(z_in + 1 + lin)
    z2 = tl.load(z_in + 1 + K + pair)

    for t in range(T):
        qk = t * H * K  # token t of this sequence and head, in q and k
        q1 = scale * tl.load(q + qk + lin).to(tl.float32)
        q2 = (scale * scale * _INV_SQRT2) * tl.load(q + qk + pa).to(tl.float32) * tl.load(q + qk + pb).to(tl.float32)
        k1 = tl.load(k + qk + lin).to(tl.float32)
        k2 = _INV_SQRT2 * tl.load(k + qk + pa).to(tl.float32) * tl.load(k + qk + pb).to(tl.float32)
        vt = tl.load(v + t * H * V + cols, mask=inside, other=0.0).to(tl.float32)
        # write the token, then read with it
        S0 += vt
        S1 += k1[:, None] * vt[None, :]
        S2 += k2[:, None] * vt[None, :]
        z0 += 1.0
        z1 += k1
        z2 += k2
        num = S0 + tl.sum(q1[:, None] * S1, 0) + tl.sum(q2[:, None] * S2, 0)
        den = z0 + tl.sum(q1 * z1, 0) + tl.sum(q2 * z2, 0)
        tl.store(o + t * H * V + cols, (num / (den + _EPS)).to(o.dtype.element_ty), mask=inside)

    tl.store(S_out + cols, S0, mask=inside)
    tl.store(S_out + lin_rows, S1, mask=inside[None, :])
    tl.store(S_out + quad_rows, S2, mask=inside[None, :])
    if pid_v == 0:
        tl.store(z_out, z0)
        tl.store(z_out + 1 + lin, z1)
        tl.store(z_out + 1 + K + pair, z2)


def launch(q, k, v, S, z, o, S_out, z_out, scale: float, *, bv: int, warps: int) -> None:
    """o (B, T, H, V) and the new state (S_out, z_out) from contiguous q, k (B, T, H, K), v (B, T, H, V) and the
    state (S (B, H, P, V), z (B, H, P)), fp32, P = 1 + K + K^2, K a power of two; S_out, z_out must not overlap
    S, z. A program takes up to `bv` V columns of one (b, h), on `warps` warps. The launch is planned once per
    shape (`plan`) and runs through the kept launcher of `common.launch`."""
    B, T, H, K = q.shape
    run(plan(B, T, H, K, v.shape[-1], scale, bv, warps), (q, k, v, S, z, o, S_out, z_out))


def kept_launch(q, k, v, S, z, scale: float, *, bv: int, warps: int):
    """`launch` for every later call of the same shapes, dtypes, device, scale and plan on tensors on 16 bytes, once it
    ran on such tensors: a function of the tensors in `launch`'s order, (q, k, v, S, z, o, S_out, z_out), that
    launches the kept kernel (`common.launch.kept_launcher`); None where no launcher is kept."""
    B, T, H, K = q.shape
    dtypes = (q.dtype, k.dtype, v.dtype, S.dtype, z.dtype, v.dtype, torch.float32, torch.float32)
    return kept_launcher(plan(B, T, H, K, v.shape[-1], scale, bv, warps), q.device.index, dtypes)


@functools.cache
def plan(B: int, T: int, H: int, K: int, V: int, scale: float, bv: int, warps: int) -> Launch:
    """The decode launch of a call shape and scale (a model has one scale), built once: B H ceil(V / BV) programs of
    BV = min(bv, V rounded up to a power of two, at least 16) columns."""
    BV = min(bv, max(16, triton.next_power_of_2(V)))
    meta = dict(K=K, KK=K * K, V=V, BV=BV, num_stages=1)
    return Launch(_decode_kernel, B * H * triton.cdiv(V, BV), (T, H, scale), meta, warps, f"bv={BV} warps={warps}")
