"""The fused Based forward in Triton, chunk-parallel: the forward state scan, then one program per (chunk, V
tile, b h) for the output.

Notation as in reference.py: q~ = scale q, s_ij = q~_i . k_j, A_ij = 1 + s_ij + s_ij^2 / 2 (j <= i). The scan
(`states._state_scan`) stores each chunk's start state S_n = sum over earlier chunks of phi_k(K)^T V and its
normaliser z_n, in the packed layout of `states`. A chunk's rows i read it out through the query side of the
feature map, [1, q~_i, q~_i (x) q~_i / 2], and the C x C quadratic form A gives the rest:

    num_i = S0 + q~_i S1 + (q~_i (x) q~_i / 2) S2 + sum_{j <= i in chunk} A_ij v_j,
    den_i = z0 + q~_i . z1 + q~_i^T Z2 q~_i / 2 + sum_{j <= i in chunk} A_ij,
    o_i   = num_i / (den_i + 1e-6),

with S2 the quadratic rows of S_n expanded to all K^2 ordered pairs (both orders of a pair read one packed
row) and Z2 the quadratic rows of z_n as a K x K matrix. The quadratic read-out is one K^2-deep tensor-core
product: q~ (x) q~ is formed in registers as an outer product reshaped to K^2 columns, and S2's K^2 rows are
gathered from the packed state by the load.

Precision: matmuls take bf16 operands (the inputs', the state's and the features' rounding) with fp32
accumulation, IEEE fp32 for fp32 inputs; s^2 and the normaliser are fp32: den's read-out takes Z2 as a bf16
head plus a bf16 tail against q (exact for bf16 inputs). fp16 inputs run the bf16 kernels, converted in and
out (the states outgrow fp16's range over long sequences).
"""

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ..common.devices import on_device
from .states import _chunk_state, _pair_row, _state_scan, n_features, state_buffers
from .tiles import _EPS, _dot, _load_rows, _sequence_row, _store_rows, operand_type


@triton.jit
def _outer_rows(x, coef, KK: tl.constexpr, C: tl.constexpr, DOT: tl.constexpr):
    """[C, K^2] in DOT: row i holds coef x_ia x_ib at column a K + b (an fp32 product, rounded), for x [C, K]."""
    x = x.to(tl.float32)
    return tl.reshape((coef * x[:, :, None] * x[:, None, :]).to(DOT), [C, KK])


@triton.jit
def _split_dot(DOT: tl.constexpr, x, Z):
    """x @ Z for x exact in DOT and an fp32 Z, to about 16 bits: Z split into a DOT head and a DOT tail (for
    DOT = fp32 one exact product)."""
    if DOT == tl.float32:
        return _dot(DOT, x, Z)
    head = Z.to(DOT)
    return _dot(DOT, x, head) + _dot(DOT, x, (Z - head.to(tl.float32)).to(DOT))


@triton.jit
def _chunk_output(
    q, k, v, states, norms, o,
    T, H, V, scale, N,
    K: tl.constexpr, P: tl.constexpr, BK: tl.constexpr, KK: tl.constexpr, BV: tl.constexpr, C: tl.constexpr,
    DOT: tl.constexpr,
):
    n = tl.program_id(0)
    pid_v = tl.program_id(1)
    pid_bh = tl.program_id(2)
    row = _sequence_row(pid_bh, T, H)
    state = _chunk_state(pid_bh, n, N, P)
    t0 = n * C
    q += row * K
    k += row * K
    v += row * V + pid_v * BV
    o += row * V + pid_v * BV
    S = states + state * V + pid_v * BV
    Z = norms + state
    nv = V - pid_v * BV  # columns of this tile inside V

    i_idx = tl.arange(0, C)
    causal = i_idx[:, None] >= i_idx[None, :]
    vc = tl.arange(0, BV)
    kc = tl.arange(0, BK)
    # q, k padded to BK >= 16 features for the scores and the linear block; the quadratic features from the
    # K real ones
    q_c = _load_rows(q, t0, T, H * K, K, C, BK)
    k_c = _load_rows(k, t0, T, H * K, K, C, BK)
    v_c = _load_rows(v, t0, T, H * V, nv, C, BV)
    if BK == K:
        q_k = q_c
    else:
        q_k = _load_rows(q, t0, T, H * K, K, C, K)

    # the state: the constant and linear rows, the quadratic rows for every ordered pair (a, b) at a K + b
    S0 = tl.load(S + vc, mask=vc < nv, other=0.0).to(tl.float32)
    S1 = tl.load(S + (1 + kc)[:, None] * V + vc[None, :], mask=(kc < K)[:, None] & (vc < nv)[None, :], other=0.0)
    r2 = tl.arange(0, KK)
    S2 = tl.load(S + _pair_row(r2 // K, r2 % K, K)[:, None] * V + vc[None, :], mask=(vc < nv)[None, :], other=0.0)
    z0 = tl.load(Z)
    z1 = tl.load(Z + 1 + kc, mask=kc < K, other=0.0)
    Z2 = tl.load(Z + _pair_row(kc[:, None], kc[None, :], K), mask=(kc < K)[:, None] & (kc < K)[None, :], other=0.0)

    s = scale * _dot(DOT, q_c, tl.trans(k_c))
    A = tl.where(causal, 1.0 + s + 0.5 * s * s, 0.0)
    q2 = _outer_rows(q_k, 0.5 * scale * scale, KK, C, DOT)
    num = S0[None, :] + scale * _dot(DOT, q_c, S1) + _dot(DOT, q2, S2) + _dot(DOT, A, v_c)
    q32 = q_c.to(tl.float32)
    den = z0 + tl.sum(q32 * (scale * z1[None, :] + (0.5 * scale * scale) * _split_dot(DOT, q_c, Z2)), 1)
    den += tl.sum(A, 1)
    _store_rows(o, num / (den + _EPS)[:, None], t0, T, H * V, nv, C, BV)


class ForwardConfig(NamedTuple):
    """One launch plan: the chunk C; the output kernel's V columns a program and warps; the scan's feature rows
    and V columns a program and warps."""

    chunk: int = 64
    bv: int = 128
    warps: int = 4
    scan_rows: int = 64
    scan_bv: int = 64
    scan_warps: int = 8


# The launch the public op uses, per feature size K, and the alternatives the benchmark times beside it.
# At K = 16 a 64-column tile on 4 warps fits two CTAs an SM (186 registers); at K = 8 the whole of V = 128 fits
# three.
DEFAULT_CONFIG = {8: ForwardConfig(), 16: ForwardConfig(bv=64)}
CONFIG_CHOICES = [ForwardConfig(), ForwardConfig(bv=64), ForwardConfig(warps=8), ForwardConfig(bv=64, warps=8)]


def launch_plan(K: int, V: int, dtype: torch.dtype, config: ForwardConfig | None = None) -> dict:
    """{kernel name: (jit function, constexpr arguments, num_warps)} for the two launches."""
    cfg = config or DEFAULT_CONFIG[K]
    DOT = operand_type(dtype)
    BV = max(16, triton.next_power_of_2(V))
    P = n_features(K)
    scan = dict(K=K, P=P, R=cfg.scan_rows, BV=min(cfg.scan_bv, BV), C=cfg.chunk, DOT=DOT, REVERSE=False)
    out = dict(K=K, P=P, BK=max(16, K), KK=K * K, BV=min(cfg.bv, BV), C=cfg.chunk, DOT=DOT)
    return {"scan": (_state_scan, scan, cfg.scan_warps), "output": (_chunk_output, out, cfg.warps)}


def based_forward_triton(q, k, v, scale: float, config: ForwardConfig | None = None) -> torch.Tensor:
    """o (B, T, H, V) in the inputs' dtype for contiguous (B, T, H, K) q, k and (B, T, H, V) v with K in {8, 16},
    any T, V >= 1. `config` overrides DEFAULT_CONFIG[K]."""
    if q.dtype == torch.float16:
        return based_forward_triton(*(x.to(torch.bfloat16) for x in (q, k, v)), scale, config).to(torch.float16)
    B, T, H, K = q.shape
    V = v.shape[-1]
    plan = launch_plan(K, V, q.dtype, config)
    scan, out = plan["scan"][1], plan["output"][1]
    C, P, BH = out["C"], out["P"], B * H
    N = triton.cdiv(T, C)
    states, norms = state_buffers(BH, N, P, V, q)
    o = torch.empty_like(v)
    common = (T, H, V, scale, N)
    with on_device(q):
        # the scan's weights pointer is not read forward (unweighted)
        _state_scan[(triton.cdiv(P, scan["R"]), triton.cdiv(V, scan["BV"]), BH)](
            k, v, norms, states, norms, *common, **scan, num_warps=plan["scan"][2], num_stages=1)
        _chunk_output[(N, triton.cdiv(V, out["BV"]), BH)](
            q, k, v, states, norms, o, *common, **out, num_warps=plan["output"][2], num_stages=1)
    return o
