"""The fused Based backward in Triton: two sequential scans over chunks, each program one (V block, b, h).

Notation as in reference.py: q~ = scale q, A_ij = 1 + s_ij + s_ij^2 / 2 (j <= i), r_i = 1 / (den_i + 1e-6),
delta_i = do_i . o_i, g_i = r_i do_i, h_i = -r_i delta_i. The P = 1 + K + K^2 feature state is never formed
as such: it is kept as its three blocks, S0 = sum v (V), S1 = sum k v^T (K x V), S2 = sum (k (x) k) v^T
(K^2 x V), with phi's 1/sqrt(2) folded into a factor 1/2 at the read-out. Every program owns the columns
v0 .. v0 + BV of V, so the state it carries is (1 + K + K^2) x BV in fp32 registers.

Kernel 1, `_forward_scan` (chunks in order, carrying S and the normaliser z = (z1 = sum k, Z2 = sum k k^T)):
  recomputes num and den, hence r and this V block's part of delta, and the parts of dq that need the
  forward state: dq~_i = r_i (U_i - delta_i W_i) with
      U_i = S1 do_i + M_i q~_i + sum_{j<=i in chunk} (do_i . v_j)(1 + s_ij) k_j,   M_i[a, b] = S2[ab] . do_i
      W_i = z1 + Z2 q~_i + sum_{j<=i in chunk} (1 + s_ij) k_j                        (V-independent)
  U is linear in do, so each V block writes its partial U; delta is still unknown here, so the
  combination waits for kernel 2.
Kernel 2, `_reverse_scan` (chunks in reverse, carrying dS = (dS0, dS1, dS2) = sum over later queries of
  (g, q g^T, (q (x) q) g^T) and dz = (dz1 = sum q h, dZ2 = sum h q q^T)): delta is now complete (the sum of
  kernel 1's partials), so it computes dv (complete for its V block), its partial of dk (the numerator
  terms; the V-independent normaliser terms are added by the V block 0 only) and, in V block 0, the final
  dq = scale r (sum U - delta W).
The partial dk of the V blocks are summed by the launcher (NV x K floats per position).

Matmuls take bf16 operands with fp32 accumulation; the states, the normaliser, den, r, delta and every
square (s^2, the outer products feeding z and den) are fp32. The normaliser's quadratic block is kept as the
K x K matrix Z2 (and dZ2), not as a K^2 vector: its products with q and k are then small exact fp32 matmuls
instead of K^2 x C tiles, which the register file cannot hold beside the states. No transpose of a register tensor is needed:
where a product wants the other orientation, the tile is loaded transposed from memory instead.
"""

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
def _store_cols(base, xT, t0, T, row_stride, ncols, W: tl.constexpr, R: tl.constexpr):
    rows = t0 + tl.arange(0, R)
    cols = tl.arange(0, W)
    ptrs = base + rows.to(tl.int64)[None, :] * row_stride + cols[:, None]
    tl.store(ptrs, xT.to(base.dtype.element_ty), mask=(cols[:, None] < ncols) & (rows[None, :] < T))


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
def _dot_f32(a, b):
    """a @ b in exact fp32 (the normaliser's products, whatever the input dtype)."""
    return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")


@triton.jit
def _outer_rows(x, R: tl.constexpr, K: tl.constexpr):
    """[R, K] -> [R, K*K], column a*K + b = x_a x_b (fp32 in, fp32 out)."""
    return tl.reshape(x[:, :, None] * x[:, None, :], (R, K * K))


@triton.jit
def _outer_cols(xT, K: tl.constexpr, R: tl.constexpr):
    """[K, R] -> [K*K, R], row a*K + b = x_a x_b."""
    return tl.reshape(xT[:, None, :] * xT[None, :, :], (K * K, R))


@triton.jit
def _contract(MT, xT, K: tl.constexpr, BK: tl.constexpr, R: tl.constexpr):
    """y[a, r] = sum_b MT[a*K + b, r] xT[b, r]: [K*K, R] x [K, R] -> [BK, R], rows K .. BK zero."""
    y = tl.sum(tl.reshape(MT, (K, K, R)) * xT[None, :, :], axis=1)
    if BK != K:  # widen to the padded feature width that the linear-block matmuls produce
        select = (tl.arange(0, BK)[:, None] == tl.arange(0, K)[None, :]).to(tl.float32)
        y = tl.sum(select[:, :, None] * y[None, :, :], axis=1)
    return y


@triton.jit
def _forward_scan(
    q, k, v, do, r_out, delta_part, u_part, w_out,
    T, H, V, scale,
    K: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, C: tl.constexpr,
    DOT: tl.constexpr,
):
    pid_v = tl.program_id(0)
    pid_bh = tl.program_id(1)
    B = tl.num_programs(1) // H
    b = pid_bh // H
    h = pid_bh % H
    v0 = pid_v * BV
    nv = V - v0
    row = (b.to(tl.int64) * T * H + h)  # position 0 of (b, h) in a (B, T, H, .) tensor, in rows
    qk_base, v_base = row * K, row * V + v0
    q, k, v, do = q + qk_base, k + qk_base, v + v_base, do + v_base
    r_out += pid_bh.to(tl.int64) * T
    delta_part += (pid_v.to(tl.int64) * B * H + pid_bh) * T
    u_part += pid_v.to(tl.int64) * B * T * H * K + qk_base
    w_out += qk_base

    i_idx = tl.arange(0, C)
    causal = i_idx[:, None] >= i_idx[None, :]  # [i, j]
    causal_t = i_idx[None, :] >= i_idx[:, None]  # [j, i]
    S0 = tl.zeros([BV], dtype=tl.float32)
    S1 = tl.zeros([BK, BV], dtype=tl.float32)
    S2 = tl.zeros([K * K, BV], dtype=tl.float32)
    z1 = tl.zeros([BK], dtype=tl.float32)
    Z2 = tl.zeros([BK, BK], dtype=tl.float32)
    for t0 in range(0, T, C):
        q_c = _load_rows(q, t0, T, H * K, K, C, BK)
        q_t = _load_cols(q, t0, T, H * K, K, BK, C)
        qe = _load_rows(q, t0, T, H * K, K, C, K).to(tl.float32)
        qe_t = _load_cols(q, t0, T, H * K, K, K, C).to(tl.float32)
        k_c = _load_rows(k, t0, T, H * K, K, C, BK)
        k_t = _load_cols(k, t0, T, H * K, K, BK, C)
        ke_t = _load_cols(k, t0, T, H * K, K, K, C).to(tl.float32)
        v_c = _load_rows(v, t0, T, H * V, nv, C, BV)
        do_c = _load_rows(do, t0, T, H * V, nv, C, BV).to(tl.float32)
        do_t = _load_cols(do, t0, T, H * V, nv, BV, C)

        # the output of this chunk: intra-chunk quadratic form + read-out of the state before it
        s = scale * _dot(DOT, q_c, k_t)
        A = tl.where(causal, 1.0 + s + 0.5 * s * s, 0.0)
        qq = _outer_rows(qe, C, K)
        den = (t0 + scale * tl.sum(q_c.to(tl.float32) * z1[None, :], 1)
               + (0.5 * scale * scale) * tl.sum(_dot_f32(q_c, Z2) * q_c.to(tl.float32), 1) + tl.sum(A, 1))
        num = (S0[None, :] + scale * _dot(DOT, q_c, S1)
               + (0.5 * scale * scale) * _dot(DOT, qq, S2)
               + _dot(DOT, A, v_c))
        r = 1.0 / (den + _EPS)
        tl.store(delta_part + t0 + i_idx, tl.sum(do_c * num, 1) * r, mask=t0 + i_idx < T)
        if pid_v == 0:
            tl.store(r_out + t0 + i_idx, r, mask=t0 + i_idx < T)

        # dq's numerator part U (this V block's share) and normaliser part W, both as [feature, i]
        s_t = scale * _dot(DOT, k_c, q_t)
        p_t = tl.where(causal_t, _dot(DOT, v_c, do_t) * (1.0 + s_t), 0.0)
        u = (_dot(DOT, S1, do_t) + _dot(DOT, k_t, p_t)
             + scale * _contract(_dot(DOT, S2, do_t), qe_t, K, BK, C))
        _store_cols(u_part, u, t0, T, H * K, K, BK, C)
        if pid_v == 0:
            w = (z1[:, None] + scale * _dot_f32(Z2, q_t)  # Z2 is symmetric
                 + _dot(DOT, k_t, tl.where(causal_t, 1.0 + s_t, 0.0)))
            _store_cols(w_out, w, t0, T, H * K, K, BK, C)

        # fold this chunk's keys into the state
        kk_t = _outer_cols(ke_t, K, C)
        S0 += tl.sum(v_c.to(tl.float32), 0)
        S1 += _dot(DOT, k_t, v_c)
        S2 += _dot(DOT, kk_t, v_c)
        z1 += tl.sum(k_t.to(tl.float32), 1)
        Z2 += _dot_f32(k_t, k_c)


@triton.jit
def _reverse_scan(
    q, k, v, do, r_in, delta_part, u_part, w_in, dq, dk_part, dv,
    T, H, V, scale,
    K: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, C: tl.constexpr,
    DOT: tl.constexpr, NV: tl.constexpr,
):
    pid_v = tl.program_id(0)
    pid_bh = tl.program_id(1)
    B = tl.num_programs(1) // H
    b = pid_bh // H
    h = pid_bh % H
    v0 = pid_v * BV
    nv = V - v0
    row = (b.to(tl.int64) * T * H + h)
    qk_base, v_base = row * K, row * V + v0
    q, k, v, do, dv = q + qk_base, k + qk_base, v + v_base, do + v_base, dv + v_base
    r_in += pid_bh.to(tl.int64) * T
    delta_part += pid_bh.to(tl.int64) * T
    u_part += qk_base
    w_in += qk_base
    dq += qk_base
    dk_part += pid_v.to(tl.int64) * B * T * H * K + qk_base
    own_normaliser = pid_v == 0  # the V-independent normaliser terms of dk go in once, from V block 0

    i_idx = tl.arange(0, C)
    causal = i_idx[:, None] >= i_idx[None, :]  # [i, j]
    causal_t = i_idx[None, :] >= i_idx[:, None]  # [j, i]
    dS0 = tl.zeros([BV], dtype=tl.float32)
    dS1 = tl.zeros([BK, BV], dtype=tl.float32)
    dS2 = tl.zeros([K * K, BV], dtype=tl.float32)
    dz1 = tl.zeros([BK], dtype=tl.float32)
    dZ2 = tl.zeros([BK, BK], dtype=tl.float32)
    n_chunks = tl.cdiv(T, C)
    for m in range(0, n_chunks):
        t0 = (n_chunks - 1 - m) * C
        q_c = _load_rows(q, t0, T, H * K, K, C, BK)
        q_t = _load_cols(q, t0, T, H * K, K, BK, C)
        qe_t = _load_cols(q, t0, T, H * K, K, K, C).to(tl.float32)
        k_c = _load_rows(k, t0, T, H * K, K, C, BK)
        k_t = _load_cols(k, t0, T, H * K, K, BK, C)
        ke = _load_rows(k, t0, T, H * K, K, C, K).to(tl.float32)
        ke_t = _load_cols(k, t0, T, H * K, K, K, C).to(tl.float32)
        v_t = _load_cols(v, t0, T, H * V, nv, BV, C)
        do_c = _load_rows(do, t0, T, H * V, nv, C, BV).to(tl.float32)
        r = _load_vec(r_in, t0, T, C)
        delta = tl.zeros([C], dtype=tl.float32)
        for p in tl.static_range(NV):
            delta += _load_vec(delta_part + p * B.to(tl.int64) * H * T, t0, T, C)
        g = (do_c * r[:, None])  # numerator adjoint, [i, V block]
        h_den = -r * delta  # normaliser adjoint, [i]

        # dv (complete for this V block): intra-chunk A^T g + read-out of the reverse state
        s_t = scale * _dot(DOT, k_c, q_t)
        a_t = tl.where(causal_t, 1.0 + s_t + 0.5 * s_t * s_t, 0.0)
        kk = _outer_rows(ke, C, K)
        dv_c = (_dot(DOT, a_t, g) + dS0[None, :] + scale * _dot(DOT, k_c, dS1)
                + (0.5 * scale * scale) * _dot(DOT, kk, dS2))
        _store_rows(dv, dv_c, t0, T, H * V, nv, C, BV)

        # dk as [feature, j]: intra-chunk ds^T q~ + d phi(k)^T (dS v + dz)
        s = scale * _dot(DOT, q_c, k_t)
        ds = _dot(DOT, g, v_t) + tl.where(own_normaliser, h_den, 0.0)[:, None]
        ds = tl.where(causal, ds * (1.0 + s), 0.0)
        dk_t = (scale * (_dot(DOT, q_t, ds) + _dot(DOT, dS1, v_t)
                         + tl.where(own_normaliser, dz1, 0.0)[:, None])
                + (scale * scale) * (_contract(_dot(DOT, dS2, v_t), ke_t, K, BK, C)
                                     + _dot_f32(tl.where(own_normaliser, dZ2, 0.0), k_t)))  # dZ2 symmetric
        _store_cols(dk_part, dk_t, t0, T, H * K, K, BK, C)

        # dq = scale r (U - delta W), U summed over the V blocks' partials from the forward scan
        if pid_v == 0:
            u = tl.zeros([C, BK], dtype=tl.float32)
            for p in tl.static_range(NV):
                u += _load_rows(u_part + p * B.to(tl.int64) * T * H * K, t0, T, H * K, K, C, BK)
            w = _load_rows(w_in, t0, T, H * K, K, C, BK)
            _store_rows(dq, (scale * r)[:, None] * (u - delta[:, None] * w), t0, T, H * K, K, C, BK)

        # fold this chunk's queries into the reverse state
        qq_t = _outer_cols(qe_t, K, C)
        dS0 += tl.sum(g.to(tl.float32), 0)
        dS1 += _dot(DOT, q_t, g)
        dS2 += _dot(DOT, qq_t, g)
        dz1 += tl.sum(q_t.to(tl.float32) * h_den[None, :], 1)
        dZ2 += _dot_f32(q_t.to(tl.float32) * h_den[None, :], q_c)


# (chunk, V block, warps) per feature size K: the launch the public op uses. Chosen offline from ptxas's
# register report for sm_90a (benchmarks/compile_check.py): the states and the K^2 x C tiles fill the register
# file, and the chunks / V blocks / warps below are the ones whose bf16 kernels do not spill (C = 64 spills
# kilobytes at every V block and warp count). The benchmark times them beside every entry of CONFIG_CHOICES
# (each spills at most ~100 bytes in bf16); on the H200 these two were the fastest (bench/results/
# 2026-11-29-ea4bff7: 11.4 against 12.5-14.1 ms at K = 16, 9.4 against 12.1-17.4 ms at K = 8).
DEFAULT_CONFIG = {8: (32, 16, 4), 16: (16, 16, 4)}
CONFIG_CHOICES = [(16, 16, 4), (16, 32, 8), (32, 16, 8)]


def launch_sizes(K: int, V: int, dtype: torch.dtype, config=None) -> dict:
    """The compile-time sizes and warps both kernels are launched with; `config` = (chunk, V block, warps)
    overrides DEFAULT_CONFIG[K]."""
    C, BV, warps = config or DEFAULT_CONFIG[K]
    return dict(
        K=K,
        BK=max(16, K),  # tl.dot needs 16 along every axis: the linear block is padded at K = 8, K*K is not
        BV=min(BV, max(16, triton.next_power_of_2(V))),
        C=C,
        DOT=tl.float32 if dtype == torch.float32 else tl.bfloat16,
        num_warps=warps,
    )


def based_backward_triton(q, k, v, do, scale: float, config=None):
    """(dq, dk, dv) for contiguous (B, T, H, K) q, k and (B, T, H, V) v, do with K in {8, 16}; any T >= 1,
    any V >= 1. Outputs in the inputs' dtype. `config` = (chunk, V block, warps) overrides the default."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    sizes = launch_sizes(K, V, q.dtype, config)
    NV = triton.cdiv(V, sizes["BV"])
    f32 = dict(device=q.device, dtype=torch.float32)
    r = torch.empty(B * H, T, **f32)
    delta_part = torch.empty(NV, B * H, T, **f32)
    u_part = torch.empty(NV, B, T, H, K, **f32)
    w = torch.empty(B, T, H, K, **f32)
    dq, dv = torch.empty_like(q), torch.empty_like(v)
    dk_part = torch.empty(NV, B, T, H, K, **f32)
    grid = (NV, B * H)
    _forward_scan[grid](q, k, v, do, r, delta_part, u_part, w, T, H, V, scale, **sizes)
    _reverse_scan[grid](q, k, v, do, r, delta_part, u_part, w, dq, dk_part, dv, T, H, V, scale, NV=NV, **sizes)
    return dq, dk_part.sum(0).to(k.dtype), dv
