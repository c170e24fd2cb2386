"""The fused Based backward in Triton, chunk-parallel: two state scans and two per-chunk kernels.

Notation as in reference.py: q~ = scale q, s_ij = q~_i . k_j, A_ij = 1 + s_ij + s_ij^2 / 2 (j <= i),
r_i = 1 / (den_i + 1e-6), delta_i = do_i . o_i, g_i = r_i do_i, h_i = -r_i delta_i. With the feature maps
phi_k(k) = [1, k, k (x) k] and phi_q(q~) = [1, q~, q~ (x) q~ / 2] (P = 1 + K + K^2 features, the Taylor
term's 1/2 on the query side), A_ij = phi_q(q~_i) . phi_k(k_j). Feature f of a row: f = 0 the constant,
f = 1 .. K the linear block, f = 1 + K + a K + b the product x_a x_b.

The sequence is cut in chunks of C positions. Per (b, h) and chunk n the launches below exchange, through
one HBM buffer of N x P x V states (bf16 for 16-bit inputs) and an fp32 N x P normaliser buffer:

1. `_state_scan` (forward): S_n = sum over earlier chunks of phi_k(K)^T V and z_n = sum of phi_k(k). Each
   program owns a block of feature rows and of V columns, so the scan is parallel over (features, V, b h);
   only the running sum is serial, and it is fp32 in registers.
2. `_chunk_forward_dq`, one program per chunk, all of V: recomputes num and den from S_n, z_n and the
   chunk's quadratic form, hence r and delta (written, 2 floats a position), and then the complete dq:
       dq~_i = sum_{j <= i in chunk} ds_ij k_j + S1 g_i + z1 h_i + M_i q~_i,
       M_i[a, b] = S2[ab] . g_i + Z2[ab] h_i,   ds_ij = (g_i . v_j + h_i)(1 + s_ij).
3. `_state_scan` (reverse) overwrites the state buffer with dS_n = sum over later chunks of phi_q(Q~)^T G
   and dz_n = sum of phi_q(q~) h.
4. `_chunk_dkdv`, one program per chunk: dv_j = sum_{i >= j in chunk} A_ij g_i + phi_k(k_j)^T dS_n and
       dk_j = sum_{i >= j in chunk} ds_ij q~_i + dS1 v_j + dz1 + 2 M'_j k_j,   M'_j[a, b] = dS2[ab] . v_j + dZ2[ab].

The quadratic features are never stored: for num and dv each chunk kernel forms them QB at a time from two
gathered loads of its rows (x_a and x_b of f = a K + b) and multiplies them with the matching QB state rows;
the M x terms of dq and dk are sum_b (x_b G) S2[. K + b]^T, one product per b (`_quad_grad`). Matmuls take bf16 operands with fp32 accumulation
(IEEE fp32 for fp32 inputs); the scans' running sums, the normaliser (den and its states), r, delta and
every square are fp32. No transpose of a dot result (fla #640): where a product wants the other
orientation, its operand is loaded transposed from memory.
"""

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .reference import EPS

# A jit function may read a module global only when it is a constexpr (the interpreter does not check this,
# the compiler does).
_EPS = tl.constexpr(EPS)


@triton.jit
def _load_rows(base, t0, T, row_stride, ncols, R: tl.constexpr, W: tl.constexpr):
    """[R, W]: positions t0 .. t0 + R down, features 0 .. W across; zero past T or past ncols."""
    rows = t0 + tl.arange(0, R)
    cols = tl.arange(0, W)
    ptrs = base + rows.to(tl.int64)[:, None] * row_stride + cols[None, :]
    return tl.load(ptrs, mask=(rows[:, None] < T) & (cols[None, :] < ncols), other=0.0)


@triton.jit
def _load_cols(base, t0, T, row_stride, ncols, W: tl.constexpr, R: tl.constexpr):
    """[W, R]: the transpose of `_load_rows`, read straight from memory."""
    rows = t0 + tl.arange(0, R)
    cols = tl.arange(0, W)
    ptrs = base + rows.to(tl.int64)[None, :] * row_stride + cols[:, None]
    return tl.load(ptrs, mask=(cols[:, None] < ncols) & (rows[None, :] < T), other=0.0)


@triton.jit
def _store_rows(base, x, t0, T, row_stride, ncols, R: tl.constexpr, W: tl.constexpr):
    rows = t0 + tl.arange(0, R)
    cols = tl.arange(0, W)
    ptrs = base + rows.to(tl.int64)[:, None] * row_stride + cols[None, :]
    tl.store(ptrs, x.to(base.dtype.element_ty), mask=(rows[:, None] < T) & (cols[None, :] < ncols))


@triton.jit
def _load_vec(base, t0, T, R: tl.constexpr):
    rows = t0 + tl.arange(0, R)
    return tl.load(base + rows, mask=rows < T, other=0.0)


@triton.jit
def _dot(DOT: tl.constexpr, a, b):
    """a @ b with both operands in DOT (bf16: tensor cores; fp32: exact IEEE fp32), fp32 accumulation."""
    if DOT == tl.float32:
        return tl.dot(a.to(DOT), b.to(DOT), input_precision="ieee")
    return tl.dot(a.to(DOT), b.to(DOT))


@triton.jit
def _pair_rows(x, t0, T, row_stride, f0, K: tl.constexpr, C: tl.constexpr, QB: tl.constexpr):
    """([C, QB], [C, QB]) fp32: x_a and x_b of the quadratic features f0 .. f0 + QB (f = a K + b, counted
    from the first quadratic feature) at positions t0 .. t0 + C; zero past T."""
    rows = t0 + tl.arange(0, C)
    f = f0 + tl.arange(0, QB)
    ptrs = x + rows.to(tl.int64)[:, None] * row_stride
    inside = (rows < T)[:, None]
    xa = tl.load(ptrs + (f // K)[None, :], mask=inside, other=0.0).to(tl.float32)
    xb = tl.load(ptrs + (f % K)[None, :], mask=inside, other=0.0).to(tl.float32)
    return xa, xb


@triton.jit
def _quad_grad(x, t0, T, row_stride, G, S, Z, w, V, K: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
               C: tl.constexpr, DOT: tl.constexpr):
    """[C, BK]: y[i, a] = sum_b x_ib (S2[a K + b] . G_i + Z2[a K + b] w_i), S2 and Z2 the quadratic rows of
    the state at S and of the normaliser at Z (symmetric in a, b), x = rows t0 .. t0 + C of a (., K) tensor.

    One product per b, x_b G [C, V] times the [V, K] slice S2[. K + b]^T: no K^2-wide tile and no K x K
    reshape of one (a reshape-and-sum of such a product gave wrong gradients on the H200 and faulted)."""
    rows = t0 + tl.arange(0, C)
    inside = rows < T
    vc = tl.arange(0, BV)
    kc = tl.arange(0, BK)
    y = tl.zeros([C, BK], dtype=tl.float32)
    for b in range(0, K):
        xb = tl.load(x + rows.to(tl.int64) * row_stride + b, mask=inside, other=0.0).to(tl.float32)
        S2b_t = tl.load(S + (1 + K + kc[None, :] * K + b) * V + vc[:, None], mask=(vc < V)[:, None] & (kc < K)[None, :],
                        other=0.0)
        y += _dot(DOT, xb[:, None] * G, S2b_t)
    x_c = _load_rows(x, t0, T, row_stride, K, C, BK).to(tl.float32)
    Z2 = tl.load(Z + 1 + K + kc[:, None] * K + kc[None, :], mask=(kc < K)[:, None] & (kc < K)[None, :], other=0.0)
    return y + w[:, None] * tl.dot(x_c, Z2, input_precision="ieee")


@triton.jit
def _sequence_row(pid_bh, T, H):
    """The row of position 0 of sequence pid_bh = b H + h in a (B, T, H, .) tensor, in int64."""
    return (pid_bh // H).to(tl.int64) * T * H + pid_bh % H


@triton.jit
def _chunk_state(pid_bh, n, N, K: tl.constexpr):
    """The row of feature 0 of chunk n's state of sequence pid_bh in the (B H, N, P, .) state buffers."""
    return pid_bh.to(tl.int64) * N * (1 + K + K * K) + n * (1 + K + K * K)


@triton.jit
def _state_scan(
    x, y, r_in, delta_in, states, norms,
    T, H, V, scale, N,
    K: tl.constexpr, R: tl.constexpr, BV: tl.constexpr, C: tl.constexpr, REVERSE: tl.constexpr,
    DOT: tl.constexpr,
):
    """Forward (REVERSE false): x = k, y = v; stores S_n = sum_{m < n} phi_k(K_m)^T V_m and z_n (weights 1).
    Reverse: x = q, y = do; stores dS_n = sum_{m > n} phi_q(Q~_m)^T (r do)_m and dz_n (weights h)."""
    pid_f = tl.program_id(0)
    pid_v = tl.program_id(1)
    pid_bh = tl.program_id(2)
    row = _sequence_row(pid_bh, T, H)
    x += row * K
    y += row * V
    r_in += pid_bh.to(tl.int64) * T
    delta_in += pid_bh.to(tl.int64) * T
    P = 1 + K + K * K
    f = pid_f * R + tl.arange(0, R)
    linear = (f >= 1) & (f <= K)
    quad = (f > K) & (f < P)
    ia = tl.where(linear, f - 1, tl.where(quad, (f - 1 - K) // K, 0))
    ib = tl.where(quad, (f - 1 - K) % K, 0)
    if REVERSE:  # phi_q of q~ = scale q
        c1 = scale
        c2 = 0.5 * scale * scale
    else:
        c1 = 1.0
        c2 = 1.0
    cols = pid_v * BV + tl.arange(0, BV)
    state_rows = _chunk_state(pid_bh, 0, N, K) + f
    store_mask = (f < P)[:, None] & (cols < V)[None, :]
    acc = tl.zeros([R, BV], dtype=tl.float32)
    z = tl.zeros([R], dtype=tl.float32)
    for m in range(0, N):
        if REVERSE:
            n = N - 1 - m
        else:
            n = m
        rows = state_rows + n * P
        tl.store(states + rows[:, None] * V + cols[None, :], acc.to(states.dtype.element_ty), mask=store_mask)
        if pid_v == 0:
            tl.store(norms + rows, z, mask=f < P)
        t = n * C + tl.arange(0, C)
        inside = t < T
        xrow = x + t.to(tl.int64)[None, :] * (H * K)
        xa = tl.load(xrow + ia[:, None], mask=inside[None, :] & (linear | quad)[:, None], other=0.0).to(tl.float32)
        xb = tl.load(xrow + ib[:, None], mask=inside[None, :] & quad[:, None], other=0.0).to(tl.float32)
        phi_t = tl.where(linear[:, None], c1 * xa, c2 * xa * xb)
        phi_t = tl.where((f == 0)[:, None] & inside[None, :], 1.0, phi_t)
        yy = tl.load(y + t.to(tl.int64)[:, None] * (H * V) + cols[None, :],
                     mask=inside[:, None] & (cols < V)[None, :], other=0.0)
        if REVERSE:
            r = _load_vec(r_in, n * C, T, C)
            w = -r * _load_vec(delta_in, n * C, T, C)
            yy = yy.to(tl.float32) * r[:, None]
        else:
            w = inside.to(tl.float32)
        acc += _dot(DOT, phi_t, yy)
        z += tl.sum(phi_t * w[None, :], 1)


@triton.jit
def _chunk_forward_dq(
    q, k, v, do, states, norms, r_out, delta_out, dq,
    T, H, V, scale, N,
    K: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, C: tl.constexpr, QB: tl.constexpr,
    DOT: tl.constexpr,
):
    n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    row = _sequence_row(pid_bh, T, H)
    q, k, dq = q + row * K, k + row * K, dq + row * K
    v, do = v + row * V, do + row * V
    r_out += pid_bh.to(tl.int64) * T
    delta_out += pid_bh.to(tl.int64) * T
    state = _chunk_state(pid_bh, n, N, K)  # S_n
    S, Z = states + state * V, norms + state
    t0 = n * C

    i_idx = tl.arange(0, C)
    causal = i_idx[:, None] >= i_idx[None, :]  # [i, j]
    vc = tl.arange(0, BV)
    kc = tl.arange(0, BK)
    q_c = _load_rows(q, t0, T, H * K, K, C, BK)
    k_c = _load_rows(k, t0, T, H * K, K, C, BK)
    k_t = _load_cols(k, t0, T, H * K, K, BK, C)
    v_c = _load_rows(v, t0, T, H * V, V, C, BV)
    v_t = _load_cols(v, t0, T, H * V, V, BV, C)
    do_c = _load_rows(do, t0, T, H * V, V, C, BV).to(tl.float32)
    lin_mask = (kc < K)[:, None] & (vc < V)[None, :]
    S0 = tl.load(S + vc, mask=vc < V, other=0.0).to(tl.float32)
    S1 = tl.load(S + (1 + kc)[:, None] * V + vc[None, :], mask=lin_mask, other=0.0)
    z0 = tl.load(Z)
    z1 = tl.load(Z + 1 + kc, mask=kc < K, other=0.0)

    # num and den of the chunk: read-out of the state before it + the intra-chunk quadratic form
    s = scale * _dot(DOT, q_c, k_t)
    A = tl.where(causal, 1.0 + s + 0.5 * s * s, 0.0)
    num = S0[None, :] + scale * _dot(DOT, q_c, S1) + _dot(DOT, A, v_c)
    den = z0 + scale * tl.sum(q_c.to(tl.float32) * z1[None, :], 1) + tl.sum(A, 1)
    for f0 in range(0, K * K, QB):
        qa, qb = _pair_rows(q, t0, T, H * K, f0, K, C, QB)
        quad_q = (0.5 * scale * scale) * qa * qb
        fq = 1 + K + f0 + tl.arange(0, QB)
        num += _dot(DOT, quad_q, tl.load(S + fq[:, None] * V + vc[None, :], mask=(vc < V)[None, :], other=0.0))
        den += tl.sum(quad_q * tl.load(Z + fq)[None, :], 1)
    r = 1.0 / (den + _EPS)
    delta = r * tl.sum(do_c * num, 1)
    inside = t0 + i_idx < T
    tl.store(r_out + t0 + i_idx, r, mask=inside)
    tl.store(delta_out + t0 + i_idx, delta, mask=inside)

    # dq~ = intra-chunk ds k + the state's part S1 g + z1 h + M q~
    g = do_c * r[:, None]
    hn = -r * delta
    ds = tl.where(causal, (_dot(DOT, g, v_t) + hn[:, None]) * (1.0 + s), 0.0)
    S1_t = tl.load(S + (1 + kc)[None, :] * V + vc[:, None], mask=(vc < V)[:, None] & (kc < K)[None, :], other=0.0)
    dqs = _dot(DOT, ds, k_c) + _dot(DOT, g, S1_t) + hn[:, None] * z1[None, :]
    dqs += scale * _quad_grad(q, t0, T, H * K, g, S, Z, hn, V, K, BK, BV, C, DOT)
    _store_rows(dq, scale * dqs, t0, T, H * K, K, C, BK)


@triton.jit
def _chunk_dkdv(
    q, k, v, do, states, norms, r_in, delta_in, dk, dv,
    T, H, V, scale, N,
    K: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, C: tl.constexpr, QB: tl.constexpr,
    DOT: tl.constexpr,
):
    n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    row = _sequence_row(pid_bh, T, H)
    q, k, dk = q + row * K, k + row * K, dk + row * K
    v, do, dv = v + row * V, do + row * V, dv + row * V
    r_in += pid_bh.to(tl.int64) * T
    delta_in += pid_bh.to(tl.int64) * T
    state = _chunk_state(pid_bh, n, N, K)  # dS_n
    dS, dZ = states + state * V, norms + state
    t0 = n * C

    i_idx = tl.arange(0, C)
    causal_t = i_idx[None, :] >= i_idx[:, None]  # [j, i]
    vc = tl.arange(0, BV)
    kc = tl.arange(0, BK)
    q_c = _load_rows(q, t0, T, H * K, K, C, BK)
    q_t = _load_cols(q, t0, T, H * K, K, BK, C)
    k_c = _load_rows(k, t0, T, H * K, K, C, BK)
    v_c = _load_rows(v, t0, T, H * V, V, C, BV)
    r = _load_vec(r_in, t0, T, C)
    hn = -r * _load_vec(delta_in, t0, T, C)
    g = _load_rows(do, t0, T, H * V, V, C, BV).to(tl.float32) * r[:, None]
    g_t = _load_cols(do, t0, T, H * V, V, BV, C).to(tl.float32) * r[None, :]
    lin_mask = (kc < K)[:, None] & (vc < V)[None, :]
    dS0 = tl.load(dS + vc, mask=vc < V, other=0.0).to(tl.float32)
    dS1 = tl.load(dS + (1 + kc)[:, None] * V + vc[None, :], mask=lin_mask, other=0.0)
    dS1_t = tl.load(dS + (1 + kc)[None, :] * V + vc[:, None], mask=(vc < V)[:, None] & (kc < K)[None, :], other=0.0)
    dz1 = tl.load(dZ + 1 + kc, mask=kc < K, other=0.0)

    # as [j, i]: the chunk's A^T and ds^T
    s_t = scale * _dot(DOT, k_c, q_t)
    a_t = tl.where(causal_t, 1.0 + s_t + 0.5 * s_t * s_t, 0.0)
    ds_t = tl.where(causal_t, (_dot(DOT, v_c, g_t) + hn[None, :]) * (1.0 + s_t), 0.0)
    dv_c = _dot(DOT, a_t, g) + dS0[None, :] + _dot(DOT, k_c, dS1)
    dk_c = scale * _dot(DOT, ds_t, q_c) + _dot(DOT, v_c, dS1_t) + dz1[None, :]
    for f0 in range(0, K * K, QB):
        ka, kb = _pair_rows(k, t0, T, H * K, f0, K, C, QB)
        fq = 1 + K + f0 + tl.arange(0, QB)
        dv_c += _dot(DOT, ka * kb, tl.load(dS + fq[:, None] * V + vc[None, :], mask=(vc < V)[None, :], other=0.0))
    ones = tl.full([C], 1.0, tl.float32)
    dk_c += 2.0 * _quad_grad(k, t0, T, H * K, v_c.to(tl.float32), dS, dZ, ones, V, K, BK, BV, C, DOT)
    _store_rows(dk, dk_c, t0, T, H * K, K, C, BK)
    _store_rows(dv, dv_c, t0, T, H * V, V, C, BV)


class Config(NamedTuple):
    """One launch plan: the chunk C, quadratic features per step QB, and each kernel's warps; the scans'
    feature rows and V columns per program."""

    chunk: int = 64
    quad_block: int = 64
    warps: int = 8
    scan_rows: int = 64
    scan_bv: int = 64
    scan_warps: int = 8


# The launch the public op uses, per feature size K, and the alternatives the benchmark times beside it.
# 64 quadratic features a step: 7.93 against 8.42 ms (32 a step) at (4, 8192, 24, 16, 128) and 4.60 against
# 4.81 ms at (4, 8192, 32, 8, 128); chunks of 32 on 4 warps: 9.42 and 5.44 ms (bench/results/
# 2026-11-29-29be16b-based, "other config" rows).
DEFAULT_CONFIG = {8: Config(), 16: Config()}
CONFIG_CHOICES = [Config(quad_block=32), Config(chunk=32, warps=4)]
# V is held whole by a chunk program (delta_i = do_i . o_i needs all of it); wider V takes the reference.
MAX_V = 256


def launch_plan(K: int, V: int, dtype: torch.dtype, config: Config | None = None) -> dict:
    """{kernel name: (jit function, constexpr arguments, num_warps)} for the four launches."""
    cfg = config or DEFAULT_CONFIG[K]
    DOT = tl.float32 if dtype == torch.float32 else tl.bfloat16
    BV = max(16, triton.next_power_of_2(V))
    scan = dict(K=K, R=cfg.scan_rows, BV=min(cfg.scan_bv, BV), C=cfg.chunk, DOT=DOT)
    chunk = dict(K=K, BK=max(16, K), BV=BV, C=cfg.chunk, QB=min(cfg.quad_block, K * K), DOT=DOT)
    return {
        "forward_scan": (_state_scan, dict(scan, REVERSE=False), cfg.scan_warps),
        "forward_dq": (_chunk_forward_dq, chunk, cfg.warps),
        "reverse_scan": (_state_scan, dict(scan, REVERSE=True), cfg.scan_warps),
        "dkdv": (_chunk_dkdv, chunk, cfg.warps),
    }


def based_backward_triton(q, k, v, do, scale: float, config: Config | None = None):
    """(dq, dk, dv) for contiguous (B, T, H, K) q, k and (B, T, H, V) v, do with K in {8, 16}, any T >= 1,
    1 <= V <= MAX_V. Outputs in the inputs' dtype. `config` overrides DEFAULT_CONFIG[K]."""
    if q.dtype == torch.float16:
        # Run as bf16, which the matmul operands are in either way: launched on fp16 tensors the kernels gave
        # a wrong dq on the H200 (bench/results/2026-11-29-29be16b-based-pytest.log) where bf16 passed.
        grads = based_backward_triton(*(x.to(torch.bfloat16) for x in (q, k, v, do)), scale, config)
        return tuple(g.to(torch.float16) for g in grads)
    B, T, H, K = q.shape
    V = v.shape[-1]
    if V > MAX_V:
        raise ValueError(f"the fused backward holds V whole in a program: V <= {MAX_V}, got V={V}")
    plan = launch_plan(K, V, q.dtype, config)
    C = plan["forward_dq"][1]["C"]
    N, BH, P = triton.cdiv(T, C), B * H, 1 + K + K * K
    f32 = dict(device=q.device, dtype=torch.float32)
    states = torch.empty(BH, N, P, V, device=q.device, dtype=torch.float32 if q.dtype == torch.float32 else torch.bfloat16)
    norms = torch.empty(BH, N, P, **f32)
    r, delta = torch.empty(BH, T, **f32), torch.empty(BH, T, **f32)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    scan = plan["forward_scan"][1]
    scan_grid = (triton.cdiv(P, scan["R"]), triton.cdiv(V, scan["BV"]), BH)
    common = (T, H, V, scale, N)

    def launch(name, grid, *args):
        fn, meta, warps = plan[name]
        fn[grid](*args, *common, **meta, num_warps=warps, num_stages=1)

    launch("forward_scan", scan_grid, k, v, r, delta, states, norms)
    launch("forward_dq", (N, BH), q, k, v, do, states, norms, r, delta, dq)
    launch("reverse_scan", scan_grid, q, do, r, delta, states, norms)  # overwrites S_n with dS_n
    launch("dkdv", (N, BH), q, k, v, do, states, norms, r, delta, dk, dv)
    return dq, dk, dv
