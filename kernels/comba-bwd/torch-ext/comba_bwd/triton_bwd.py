"""The fused Comba backward in Triton: four chunk kernels (chunk length 64), no autograd.

Notation as in reference.py: per (b, h) and chunk n, gc the inclusive cumsum of g inside the chunk,
gam = exp(gc), Gam = exp(gc[-1]), E_ij = exp(gc_i - gc_j) (j <= i), L = strict_lower((beta P) K^T * E),
A = (I + L)^-1, Vn = A (beta V) - A (beta gam P) S, X = A^T dVn.

  1. _transform_kernel   (chunk-parallel)  A of each chunk by forward substitution in fp32 -> HBM (fp32).
  2. _forward_scan_kernel (serial over chunks, per (b, h, V block))  S_n (bf16) and Vn (bf16) -> HBM.
  3. _reverse_scan_kernel (serial over chunks, reversed)  dS'_n (bf16) and dVn (bf16) -> HBM; dS in fp32.
  4. _grads_kernel       (chunk-parallel)  all six gradients of the chunk; dbeta and dg reduced in fp32.
     With Config.split_grads, step 4 is two kernels: _adjoint_kernel (X = A^T dVn, dv and the v-part of dbeta;
     X -> HBM in bf16) and _grads_kernel reading X, which then holds neither A nor dVn (less register pressure).

The launch plan (warps, scan V block, loop pipelining, state dtype, split) is a named entry of CONFIGS; the
benchmark times them side by side and the CUDA tests check every one against the spec.

Design choices (the GPU run must confirm them; see README "Design"):
- The per-chunk A and states are materialised in HBM (the issue allows it "if measured faster"): the solve is
  a 63-step dependent loop, too slow to sit on the serial path of the scans, and the chunk-parallel gradient
  kernel needs the state of its chunk without a scan of its own.
- The adjoint needs ONE system solved transposed: X = A^T dVn. The other adjoint pieces follow from it
  (A^T dW = -X S^T, dL = -strict_lower(X Vn^T)), so no second solve and no A^T dA A^T product.
- Products with A use A split into two bf16 halves (hi + lo), which keeps A's fp32 accuracy on bf16 tensor
  cores; the decay and beta scalings are folded into A's columns (fp32) before the split.
- No tl.trans of a dot result (Triton 3.6 Hopper miscompile, fla #640): every transposed operand is either
  loaded transposed from memory or is an elementwise product of loaded data.
"""

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .reference import CHUNK, pad_time

BT = tl.constexpr(CHUNK)


@triton.jit
def _dot_split(a, b):
    """a @ b with fp32 `a` carried as two bf16 halves (about 16 mantissa bits) and bf16 `b`."""
    hi = a.to(tl.bfloat16)
    lo = (a - hi.to(tl.float32)).to(tl.bfloat16)
    return tl.dot(hi, b) + tl.dot(lo, b)


@triton.jit
def _dot_split_right(a, b):
    """a @ b with bf16 `a` and fp32 `b` carried as two bf16 halves."""
    hi = b.to(tl.bfloat16)
    lo = (b - hi.to(tl.float32)).to(tl.bfloat16)
    return tl.dot(a, hi) + tl.dot(a, lo)


@triton.jit
def _gates(g, beta, scal_base, t0, H):
    """gc (inclusive cumsum of g in the chunk), the chunk's total log-decay, and beta, all fp32 [BT]."""
    r = tl.arange(0, BT)
    gk = tl.load(g + scal_base + (t0 + r) * H).to(tl.float32)
    bk = tl.load(beta + scal_base + (t0 + r) * H).to(tl.float32)
    return tl.cumsum(gk, 0), tl.sum(gk, 0), bk


@triton.jit
def _decay(gc, upper: tl.constexpr, strict: tl.constexpr):
    """E (lower) or E^T (upper), with the diagonal unless strict; the exponent is masked before exp."""
    i = tl.arange(0, BT)[:, None]
    j = tl.arange(0, BT)[None, :]
    if upper:  # E^T[a, b] = exp(gc_b - gc_a) for b >= a
        diff = gc[None, :] - gc[:, None]
        keep = j >= i
        if strict:
            keep = j > i
    else:
        diff = gc[:, None] - gc[None, :]
        keep = i >= j
        if strict:
            keep = i > j
    return tl.exp(tl.where(keep, diff, float("-inf")))


@triton.jit
def _rows(x, base, t0, HD, D: tl.constexpr, R: tl.constexpr = BT):
    """Pointers to the [R, D] rows t0.. of a (B, T, H, D) tensor (base = (b*T*H + h)*D)."""
    r = tl.arange(0, R)
    return x + base + (t0 + r)[:, None] * HD + tl.arange(0, D)[None, :]


@triton.jit
def _rows_t(x, base, t0, HD, D: tl.constexpr, R: tl.constexpr = BT):
    """Pointers to the same rows as _rows, transposed: [D, R]."""
    r = tl.arange(0, R)
    return x + base + (t0 + r)[None, :] * HD + tl.arange(0, D)[:, None]


@triton.jit
def _transform_kernel(k, p, beta, g, A, N, H, K: tl.constexpr):
    n, bh = tl.program_id(0), tl.program_id(1)
    T = N * BT
    b, h = bh // H, bh % H
    scal_base = b.to(tl.int64) * T * H + h
    t0 = n * BT
    gc, _, bk = _gates(g, beta, scal_base, t0, H)
    kt = tl.load(_rows_t(k, scal_base * K, t0, H * K, K)).to(tl.bfloat16)
    pk = tl.load(_rows(p, scal_base * K, t0, H * K, K)).to(tl.bfloat16)
    L = tl.dot(pk, kt) * bk[:, None] * _decay(gc, False, True)          # strict_lower((beta P) K^T * E)
    r = tl.arange(0, BT)
    # Forward substitution, one row at a time: row i of A = e_i - L[i, :] A (rows j < i are final).
    Ainv = tl.where(r[:, None] == r[None, :], 1.0, 0.0)
    for i in range(1, BT):
        l_i = tl.sum(tl.where(r[:, None] == i, L, 0.0), 0)              # L[i, :] as a column vector
        a_i = tl.sum(l_i[:, None] * Ainv, 0)                             # (L[i, :] A)
        Ainv = tl.where(r[:, None] == i, Ainv - a_i[None, :], Ainv)
    a_base = (bh.to(tl.int64) * N + n) * BT * BT
    tl.store(A + a_base + r[:, None] * BT + r[None, :], Ainv)


SUB = tl.constexpr(16)  # sub-block of the blocked transform: 4 x 4 blocks of 16 x 16 per chunk


@triton.jit
def _sub_gates(g, beta, scal_base, t0, H, offset):
    """gc on rows t0 .. t0 + SUB (offset = the chunk's log-decay before them), beta, and the new offset."""
    r = tl.arange(0, SUB)
    gk = tl.load(g + scal_base + (t0 + r) * H).to(tl.float32)
    bk = tl.load(beta + scal_base + (t0 + r) * H).to(tl.float32)
    return offset + tl.cumsum(gk, 0), bk, offset + tl.sum(gk, 0)


@triton.jit
def _l_block(pk, bk, gc_i, kt, gc_j, DIAGONAL: tl.constexpr):
    """Block (i, j) of L = strict_lower((beta P) K^T * E) from P and beta on block i's rows (pk bf16 [SUB, K])
    and K^T on block j's ([K, SUB]), beta applied in fp32 after the product as in _transform_kernel; a
    diagonal block keeps only its strictly lower part."""
    diff = gc_i[:, None] - gc_j[None, :]
    if DIAGONAL:
        diff = tl.where(tl.arange(0, SUB)[:, None] > tl.arange(0, SUB)[None, :], diff, float("-inf"))
    return tl.dot(pk, kt) * bk[:, None] * tl.exp(diff)


@triton.jit
def _inv_unit_lower(Lb):
    """(I + Lb)^-1 of a strictly lower [SUB, SUB] block in fp32: Lb is nilpotent (Lb^16 = 0), so the inverse
    is sum_k (-Lb)^k = (I - Lb)(I + Lb^2)(I + Lb^4)(I + Lb^8), six products of depth four. A row-by-row
    substitution is 15 dependent steps of two cross-thread reductions each, which made the transform the
    second slowest stage (0.72 ms at (8, 2048, 32, 128, 128) in bench/results/2026-11-29-f6e6021)."""
    r = tl.arange(0, SUB)
    eye = tl.where(r[:, None] == r[None, :], 1.0, 0.0)
    L2 = _mm(Lb, Lb)
    L4 = _mm(L2, L2)
    D = _mm(eye - Lb, eye + L2)
    D = _mm(D, eye + L4)
    return _mm(D, eye + _mm(L4, L4))


@triton.jit
def _mm(a, b):
    return tl.dot(a, b, input_precision="ieee")


@triton.jit
def _store_block(A, a_base, i: tl.constexpr, j: tl.constexpr, blk):
    r = tl.arange(0, SUB)
    tl.store(A + a_base + (r + i * SUB)[:, None] * BT + (r + j * SUB)[None, :], blk)


@triton.jit
def _transform_blocked_kernel(k, p, beta, g, A, N, H, K: tl.constexpr):
    """The same A = (I + L)^-1 as _transform_kernel, by blocks: the four diagonal 16 x 16 blocks by forward
    substitution (15 steps each instead of 63 for the whole chunk), then block row i of the lower part from
    A_ij = -D_i sum_{j <= m < i} L_im A_mj, fp32 products on CUDA cores."""
    n, bh = tl.program_id(0), tl.program_id(1)
    T = N * BT
    b, h = bh // H, bh % H
    scal_base = b.to(tl.int64) * T * H + h
    t0 = n * BT
    kbase = scal_base * K
    gc0, b0, off = _sub_gates(g, beta, scal_base, t0, H, 0.0)
    gc1, b1, off = _sub_gates(g, beta, scal_base, t0 + SUB, H, off)
    gc2, b2, off = _sub_gates(g, beta, scal_base, t0 + 2 * SUB, H, off)
    gc3, b3, off = _sub_gates(g, beta, scal_base, t0 + 3 * SUB, H, off)
    # P on each block's rows, K^T on each block's columns (loaded transposed)
    p0 = tl.load(_rows(p, kbase, t0, H * K, K, SUB)).to(tl.bfloat16)
    p1 = tl.load(_rows(p, kbase, t0 + SUB, H * K, K, SUB)).to(tl.bfloat16)
    p2 = tl.load(_rows(p, kbase, t0 + 2 * SUB, H * K, K, SUB)).to(tl.bfloat16)
    p3 = tl.load(_rows(p, kbase, t0 + 3 * SUB, H * K, K, SUB)).to(tl.bfloat16)
    kt0 = tl.load(_rows_t(k, kbase, t0, H * K, K, SUB)).to(tl.bfloat16)
    kt1 = tl.load(_rows_t(k, kbase, t0 + SUB, H * K, K, SUB)).to(tl.bfloat16)
    kt2 = tl.load(_rows_t(k, kbase, t0 + 2 * SUB, H * K, K, SUB)).to(tl.bfloat16)
    kt3 = tl.load(_rows_t(k, kbase, t0 + 3 * SUB, H * K, K, SUB)).to(tl.bfloat16)

    # Every block of L first, so that the P and K tiles are dead before the substitutions.
    L00 = _l_block(p0, b0, gc0, kt0, gc0, True)
    L10 = _l_block(p1, b1, gc1, kt0, gc0, False)
    L20 = _l_block(p2, b2, gc2, kt0, gc0, False)
    L30 = _l_block(p3, b3, gc3, kt0, gc0, False)
    L11 = _l_block(p1, b1, gc1, kt1, gc1, True)
    L21 = _l_block(p2, b2, gc2, kt1, gc1, False)
    L31 = _l_block(p3, b3, gc3, kt1, gc1, False)
    L22 = _l_block(p2, b2, gc2, kt2, gc2, True)
    L32 = _l_block(p3, b3, gc3, kt2, gc2, False)
    L33 = _l_block(p3, b3, gc3, kt3, gc3, True)
    D0 = _inv_unit_lower(L00)
    D1 = _inv_unit_lower(L11)
    D2 = _inv_unit_lower(L22)
    D3 = _inv_unit_lower(L33)
    A10 = -_mm(D1, _mm(L10, D0))
    A21 = -_mm(D2, _mm(L21, D1))
    A20 = -_mm(D2, _mm(L20, D0) + _mm(L21, A10))
    A32 = -_mm(D3, _mm(L32, D2))
    A31 = -_mm(D3, _mm(L31, D1) + _mm(L32, A21))
    A30 = -_mm(D3, _mm(L30, D0) + _mm(L31, A10) + _mm(L32, A20))

    a_base = (bh.to(tl.int64) * N + n) * BT * BT
    zero = tl.zeros([SUB, SUB], dtype=tl.float32)
    _store_block(A, a_base, 0, 0, D0)
    _store_block(A, a_base, 0, 1, zero)
    _store_block(A, a_base, 0, 2, zero)
    _store_block(A, a_base, 0, 3, zero)
    _store_block(A, a_base, 1, 0, A10)
    _store_block(A, a_base, 1, 1, D1)
    _store_block(A, a_base, 1, 2, zero)
    _store_block(A, a_base, 1, 3, zero)
    _store_block(A, a_base, 2, 0, A20)
    _store_block(A, a_base, 2, 1, A21)
    _store_block(A, a_base, 2, 2, D2)
    _store_block(A, a_base, 2, 3, zero)
    _store_block(A, a_base, 3, 0, A30)
    _store_block(A, a_base, 3, 1, A31)
    _store_block(A, a_base, 3, 2, A32)
    _store_block(A, a_base, 3, 3, D3)


@triton.jit
def _scan_chunk(g, beta, state_out, state, n, bh, scal_base, N, H, cv, K: tl.constexpr, V: tl.constexpr):
    """Chunk n of either scan: store the carried state (S_n, or dS'_n in the reverse scan), return the chunk's
    first position, its gates and its index: (t0, gc, glast, bk, gam, chunk)."""
    t0 = n * BT
    gc, glast, bk = _gates(g, beta, scal_base, t0, H)
    chunk = bh.to(tl.int64) * N + n
    ck = tl.arange(0, K)
    tl.store(state_out + (chunk * K + ck[:, None]) * V + cv[None, :], state.to(state_out.dtype.element_ty))
    return t0, gc, glast, bk, tl.exp(gc), chunk


@triton.jit
def _forward_step(k, v, p, beta, g, A, S_out, Vn_out, S, n, bh, scal_base, N, H, cv, K: tl.constexpr,
                  V: tl.constexpr):
    """Chunk n of the forward scan: store S_n and Vn, return S_{n+1}."""
    T = N * BT
    r = tl.arange(0, BT)
    t0, gc, glast, bk, gam, chunk = _scan_chunk(g, beta, S_out, S, n, bh, scal_base, N, H, cv, K, V)
    Ainv = tl.load(A + chunk * BT * BT + r[:, None] * BT + r[None, :])
    vk = tl.load(v + scal_base * V + (t0 + r)[:, None] * (H * V) + cv[None, :]).to(tl.bfloat16)
    pk = tl.load(_rows(p, scal_base * K, t0, H * K, K)).to(tl.bfloat16)
    U = _dot_split(Ainv * bk[None, :], vk)
    W = _dot_split(Ainv * (bk * gam)[None, :], pk)
    Vn = U - tl.dot(W.to(tl.bfloat16), S.to(tl.bfloat16))
    tl.store(Vn_out + (bh.to(tl.int64) * T + t0 + r)[:, None] * V + cv[None, :], Vn.to(Vn_out.dtype.element_ty))
    kt = tl.load(_rows_t(k, scal_base * K, t0, H * K, K))
    kt_to_end = (kt * tl.exp(glast - gc)[None, :]).to(tl.bfloat16)       # (K * Gam / gam)^T
    return tl.exp(glast) * S + tl.dot(kt_to_end, Vn.to(tl.bfloat16))


@triton.jit
def _forward_scan_kernel(k, v, p, beta, g, A, S_out, Vn_out, N, H, K: tl.constexpr, V: tl.constexpr,
                         BV: tl.constexpr):
    iv, bh = tl.program_id(0), tl.program_id(1)
    scal_base = (bh // H).to(tl.int64) * N * BT * H + bh % H
    cv = iv * BV + tl.arange(0, BV)
    S = tl.zeros([K, BV], dtype=tl.float32)
    n = 0
    while n < N:  # one compile for every T (a while loop, as checked on the H200)
        S = _forward_step(k, v, p, beta, g, A, S_out, Vn_out, S, n, bh, scal_base, N, H, cv, K, V)
        n += 1


@triton.jit
def _reverse_step(q, k, p, beta, g, do, A, dS_out, dVn_out, dS, n, bh, scal_base, scale, N, H, cv,
                  K: tl.constexpr, V: tl.constexpr):
    """Chunk n of the reverse scan: store dS'_n and dVn, return the gradient of the state before the chunk."""
    T = N * BT
    r = tl.arange(0, BT)
    t0, gc, glast, bk, gam, chunk = _scan_chunk(g, beta, dS_out, dS, n, bh, scal_base, N, H, cv, K, V)
    kk = tl.load(_rows(k, scal_base * K, t0, H * K, K)).to(tl.bfloat16)
    qt = tl.load(_rows_t(q, scal_base * K, t0, H * K, K)).to(tl.bfloat16)
    dok = tl.load(do + scal_base * V + (t0 + r)[:, None] * (H * V) + cv[None, :]).to(tl.bfloat16)
    # dVn = (scale lower(Q K^T) * E)^T dO + (K * Gam / gam) dS'
    scores_t = (tl.dot(kk, qt) * scale * _decay(gc, True, False)).to(tl.bfloat16)
    k_to_end = (kk * tl.exp(glast - gc)[:, None]).to(tl.bfloat16)
    dVn = tl.dot(scores_t, dok) + tl.dot(k_to_end, dS.to(tl.bfloat16))
    tl.store(dVn_out + (bh.to(tl.int64) * T + t0 + r)[:, None] * V + cv[None, :], dVn.to(dVn_out.dtype.element_ty))
    # dS = Gam dS' + scale (gam Q)^T dO - W^T dVn,  W^T = P^T (A diag(beta gam))^T
    a_t = tl.load(A + chunk * BT * BT + r[None, :] * BT + r[:, None])              # A^T
    pt = tl.load(_rows_t(p, scal_base * K, t0, H * K, K)).to(tl.bfloat16)
    w_t = _dot_split_right(pt, a_t * (bk * gam)[:, None])
    qt_gam = (qt * (gam * scale)[None, :]).to(tl.bfloat16)
    return tl.exp(glast) * dS + tl.dot(qt_gam, dok) - tl.dot(w_t.to(tl.bfloat16), dVn.to(tl.bfloat16))


@triton.jit
def _reverse_scan_kernel(q, k, p, beta, g, do, A, dS_out, dVn_out, scale, N, H, K: tl.constexpr,
                         V: tl.constexpr, BV: tl.constexpr):
    iv, bh = tl.program_id(0), tl.program_id(1)
    scal_base = (bh // H).to(tl.int64) * N * BT * H + bh % H
    cv = iv * BV + tl.arange(0, BV)
    dS = tl.zeros([K, BV], dtype=tl.float32)
    n = N - 1
    while n >= 0:
        dS = _reverse_step(q, k, p, beta, g, do, A, dS_out, dVn_out, dS, n, bh, scal_base, scale, N, H, cv, K, V)
        n -= 1


@triton.jit
def _adjoint_kernel(v, beta, A, dVn_in, X_out, dv, dbeta_v, N, H, V: tl.constexpr):
    """The split gradient path, part 1: X = A^T dVn (bf16 -> HBM), dv = beta X and sum_v(v X) (fp32)."""
    n, bh = tl.program_id(0), tl.program_id(1)
    T = N * BT
    scal_base = (bh // H).to(tl.int64) * T * H + bh % H
    t0 = n * BT
    r = tl.arange(0, BT)
    cv = tl.arange(0, V)
    chunk = bh.to(tl.int64) * N + n
    bk = tl.load(beta + scal_base + (t0 + r) * H).to(tl.float32)
    a_t = tl.load(A + chunk * BT * BT + r[None, :] * BT + r[:, None])
    vn_rows = (bh.to(tl.int64) * T + t0 + r)[:, None] * V + cv[None, :]
    X = _dot_split(a_t, tl.load(dVn_in + vn_rows))
    tl.store(X_out + vn_rows, X.to(X_out.dtype.element_ty))
    vk = tl.load(_rows(v, scal_base * V, t0, H * V, V)).to(tl.float32)
    tl.store(_rows(dv, scal_base * V, t0, H * V, V), (bk[:, None] * X).to(dv.dtype.element_ty))
    tl.store(dbeta_v + scal_base + (t0 + r) * H, tl.sum(vk * X, 1))


@triton.jit
def _grads_q_k(qk, kk, pk, bk, dok, Vn, Vn_t, S_t, dS_t, Xb_t, E, E_t, gc, glast, scale):
    """dq and dk of a chunk, and their terms of d gc (the last row's included)."""
    gam = tl.exp(gc)
    # Readout: o = scale [(gam Q) S + (lower(Q K^T) * E) Vn].
    do_vn = (tl.dot(dok, Vn_t) * E).to(tl.bfloat16)                           # lower(dO Vn^T) * E
    do_vn_t = (tl.dot(Vn, tl.trans(dok)) * E_t).to(tl.bfloat16)
    dq_c = scale * (gam[:, None] * tl.dot(dok, S_t.to(tl.bfloat16)) + tl.dot(do_vn, kk))
    dk_read = scale * tl.dot(do_vn_t, qk)
    dk_state = tl.exp(glast - gc)[:, None] * tl.dot(Vn, dS_t.to(tl.bfloat16))
    # The chunk transform's K side: dR = dL * E with dL = -strict_lower(X Vn^T), seen transposed.
    r = tl.arange(0, BT)
    dR_t = tl.where(r[:, None] < r[None, :], -tl.dot(Vn, Xb_t) * E_t, 0.0)
    bp = (pk.to(tl.float32) * bk[:, None]).to(tl.bfloat16)
    dk_c = dk_read + dk_state + tl.dot(dR_t.to(tl.bfloat16), bp)
    k_state = tl.sum(kk.to(tl.float32) * dk_state, 1)
    dgc = tl.sum(qk.to(tl.float32) * dq_c, 1) - tl.sum(kk.to(tl.float32) * dk_read, 1) - k_state
    last = tl.sum(k_state, 0) + tl.exp(glast) * tl.sum(tl.sum(S_t.to(tl.float32) * dS_t.to(tl.float32), 1), 0)
    return dq_c, dk_c, dgc + tl.where(r == BT - 1, last, 0.0)


@triton.jit
def _grads_p_beta(pk, kk, bk, Xb, Vn_t, S_t, E, gam, db_v):
    """dp and dbeta of a chunk (db_v: dbeta's v part), and their terms of d gc."""
    # A^T dW = -X S^T; the chunk transform: L = strict_lower((beta P) K^T * E), dL = -strict_lower(X Vn^T).
    Y = -tl.dot(Xb, S_t.to(tl.bfloat16))
    r = tl.arange(0, BT)
    mask = r[:, None] > r[None, :]
    L = tl.where(mask, tl.dot(pk, tl.trans(kk)) * bk[:, None] * E, 0.0)
    dL = tl.where(mask, -tl.dot(Xb, Vn_t), 0.0)
    dR_k = tl.dot((dL * E).to(tl.bfloat16), kk)
    pf = pk.to(tl.float32)
    dp_c = (bk * gam)[:, None] * Y + bk[:, None] * dR_k
    p_y = tl.sum(pf * Y, 1)
    db_c = db_v + gam * p_y + tl.sum(pf * dR_k, 1)
    dL_L = dL * L
    return dp_c, db_c, tl.sum(dL_L, 1) - tl.sum(dL_L, 0) + bk * gam * p_y


@triton.jit
def _reverse_cumsum(x):
    """dg from d gc: the sum over the chunk's later rows, each row included (gc is an inclusive cumsum)."""
    return tl.sum(x, 0) - tl.cumsum(x, 0) + x


@triton.jit
def _grads_kernel(q, k, v, p, beta, g, do, A, S_in, dS_in, Vn_in, dVn_in, X_in, dbeta_v,
                  dq, dk, dv, dp, dbeta, dg, scale, N, H, K: tl.constexpr, V: tl.constexpr,
                  X_IN_HBM: tl.constexpr):
    """All gradients of one chunk; with X_IN_HBM, X (bf16), dv and sum_v(v X) come from _adjoint_kernel.

    Its algebra is that of _grads_q_k and _grads_p_beta, written inline: this is the form checked on the
    H200 (bench/results/2026-11-29-6d4fa9b-comba-pytest.log). Built from those helpers it compiles
    differently (ptxas, sm_90: 220 against 920 bytes of spill at K = 64, 1,932 against 2,136 at K = 128,
    split, 8 warps), so the switch waits for a GPU run that checks that build."""
    n, bh = tl.program_id(0), tl.program_id(1)
    T = N * BT
    b, h = bh // H, bh % H
    scal_base = b.to(tl.int64) * T * H + h
    t0 = n * BT
    r = tl.arange(0, BT)
    ck = tl.arange(0, K)
    cv = tl.arange(0, V)
    chunk = bh.to(tl.int64) * N + n
    gc, glast, bk = _gates(g, beta, scal_base, t0, H)
    gam = tl.exp(gc)
    E = _decay(gc, False, False)
    E_t = _decay(gc, True, False)

    qk = tl.load(_rows(q, scal_base * K, t0, H * K, K)).to(tl.bfloat16)
    kk = tl.load(_rows(k, scal_base * K, t0, H * K, K)).to(tl.bfloat16)
    pk = tl.load(_rows(p, scal_base * K, t0, H * K, K)).to(tl.bfloat16)
    dok = tl.load(_rows(do, scal_base * V, t0, H * V, V)).to(tl.bfloat16)
    vn_rows = (bh.to(tl.int64) * T + t0 + r)[:, None] * V + cv[None, :]
    vn_cols = (bh.to(tl.int64) * T + t0 + r)[None, :] * V + cv[:, None]
    Vn = tl.load(Vn_in + vn_rows)
    Vn_t = tl.load(Vn_in + vn_cols)
    state_t = (chunk * K + ck[None, :]) * V + cv[:, None]                     # [V, K] view of a (K, V) state
    S_t = tl.load(S_in + state_t)
    dS_t = tl.load(dS_in + state_t)

    # The chunk transform's adjoint: X = A^T dVn (and X^T = dVn^T A), then A^T dW = -X S^T.
    if X_IN_HBM:
        Xb = tl.load(X_in + vn_rows)
        Xb_t = tl.load(X_in + vn_cols)
        db_v = tl.load(dbeta_v + scal_base + (t0 + r) * H)
    else:
        Ainv = tl.load(A + chunk * BT * BT + r[:, None] * BT + r[None, :])
        a_t = tl.load(A + chunk * BT * BT + r[None, :] * BT + r[:, None])
        X = _dot_split(a_t, tl.load(dVn_in + vn_rows))
        Xb = X.to(tl.bfloat16)
        Xb_t = _dot_split_right(tl.load(dVn_in + vn_cols), Ainv).to(tl.bfloat16)
        vk = tl.load(_rows(v, scal_base * V, t0, H * V, V)).to(tl.float32)
        db_v = tl.sum(vk * X, 1)
        tl.store(_rows(dv, scal_base * V, t0, H * V, V), (bk[:, None] * X).to(dv.dtype.element_ty))
    Y = -tl.dot(Xb, S_t.to(tl.bfloat16))
    # Readout: o = scale [(gam Q) S + (lower(Q K^T) * E) Vn].
    do_vn = (tl.dot(dok, Vn_t) * E).to(tl.bfloat16)                           # lower(dO Vn^T) * E
    do_vn_t = (tl.dot(Vn, tl.trans(dok)) * E_t).to(tl.bfloat16)
    dq_c = scale * (gam[:, None] * tl.dot(dok, S_t.to(tl.bfloat16)) + tl.dot(do_vn, kk))
    dk_read = scale * tl.dot(do_vn_t, qk)
    dk_state = tl.exp(glast - gc)[:, None] * tl.dot(Vn, dS_t.to(tl.bfloat16))
    # The chunk transform: L = strict_lower((beta P) K^T * E), dL = -strict_lower(X Vn^T), dR = dL * E.
    mask = r[:, None] > r[None, :]
    L = tl.where(mask, tl.dot(pk, tl.trans(kk)) * bk[:, None] * E, 0.0)
    dL = tl.where(mask, -tl.dot(Xb, Vn_t), 0.0)
    dR_t = tl.where(r[:, None] < r[None, :], -tl.dot(Vn, Xb_t) * E_t, 0.0)
    dR_k = tl.dot((dL * E).to(tl.bfloat16), kk)
    bp = (pk.to(tl.float32) * bk[:, None]).to(tl.bfloat16)
    dk_c = dk_read + dk_state + tl.dot(dR_t.to(tl.bfloat16), bp)
    pf = pk.to(tl.float32)
    dp_c = (bk * gam)[:, None] * Y + bk[:, None] * dR_k
    p_y = tl.sum(pf * Y, 1)
    db_c = db_v + gam * p_y + tl.sum(pf * dR_k, 1)
    dL_L = dL * L
    k_state = tl.sum(kk.to(tl.float32) * dk_state, 1)
    dgc = (tl.sum(dL_L, 1) - tl.sum(dL_L, 0) + bk * gam * p_y + tl.sum(qk.to(tl.float32) * dq_c, 1)
           - tl.sum(kk.to(tl.float32) * dk_read, 1) - k_state)
    last = tl.sum(k_state, 0) + tl.exp(glast) * tl.sum(tl.sum(S_t.to(tl.float32) * dS_t.to(tl.float32), 1), 0)
    dgc += tl.where(r == BT - 1, last, 0.0)
    dg_c = tl.sum(dgc, 0) - tl.cumsum(dgc, 0) + dgc                             # reverse cumsum in the chunk

    tl.store(_rows(dq, scal_base * K, t0, H * K, K), dq_c.to(dq.dtype.element_ty))
    tl.store(_rows(dk, scal_base * K, t0, H * K, K), dk_c.to(dk.dtype.element_ty))
    tl.store(_rows(dp, scal_base * K, t0, H * K, K), dp_c.to(dp.dtype.element_ty))
    tl.store(dbeta + scal_base + (t0 + r) * H, db_c.to(dbeta.dtype.element_ty))
    tl.store(dg + scal_base + (t0 + r) * H, dg_c)


@triton.jit
def _chunk_offsets(N, H, V: tl.constexpr):
    """This program's chunk (grid: chunk, b * H + h): the (B, T, H) offset of its (b, h), its first row, its
    index among all chunks, and the [BT, V] and [V, BT] offsets of its rows in a (B * H, T, V) tensor."""
    n, bh = tl.program_id(0), tl.program_id(1)
    T = N * BT
    rows = bh.to(tl.int64) * T + n * BT + tl.arange(0, BT)
    cv = tl.arange(0, V)
    scal_base = (bh // H).to(tl.int64) * T * H + bh % H
    return scal_base, n * BT, bh.to(tl.int64) * N + n, rows[:, None] * V + cv[None, :], rows[None, :] * V + cv[:, None]


@triton.jit
def _grads_qk_kernel(q, k, p, beta, g, do, S_in, dS_in, Vn_in, X_in, dq, dk, dgc_out, scale, N, H,
                     K: tl.constexpr, V: tl.constexpr):
    """The gradient kernel's first half (plan grads_two): dq, dk and their terms of d gc -> dgc_out (fp32)."""
    scal_base, t0, chunk, vn_rows, vn_cols = _chunk_offsets(N, H, V)
    gc, glast, bk = _gates(g, beta, scal_base, t0, H)
    state_t = (chunk * K + tl.arange(0, K)[None, :]) * V + tl.arange(0, V)[:, None]  # [V, K] view of a (K, V) state
    dq_c, dk_c, dgc = _grads_q_k(
        tl.load(_rows(q, scal_base * K, t0, H * K, K)).to(tl.bfloat16),
        tl.load(_rows(k, scal_base * K, t0, H * K, K)).to(tl.bfloat16),
        tl.load(_rows(p, scal_base * K, t0, H * K, K)).to(tl.bfloat16), bk,
        tl.load(_rows(do, scal_base * V, t0, H * V, V)).to(tl.bfloat16),
        tl.load(Vn_in + vn_rows), tl.load(Vn_in + vn_cols), tl.load(S_in + state_t), tl.load(dS_in + state_t),
        tl.load(X_in + vn_cols), _decay(gc, False, False), _decay(gc, True, False), gc, glast, scale)
    tl.store(_rows(dq, scal_base * K, t0, H * K, K), dq_c.to(dq.dtype.element_ty))
    tl.store(_rows(dk, scal_base * K, t0, H * K, K), dk_c.to(dk.dtype.element_ty))
    tl.store(dgc_out + scal_base + (t0 + tl.arange(0, BT)) * H, dgc)


@triton.jit
def _grads_pb_kernel(k, p, beta, g, S_in, Vn_in, X_in, dbeta_v, dgc_in, dp, dbeta, dg, N, H,
                     K: tl.constexpr, V: tl.constexpr):
    """The second half: dp, dbeta, and dg from both halves' terms of d gc."""
    scal_base, t0, chunk, vn_rows, vn_cols = _chunk_offsets(N, H, V)
    gc, _, bk = _gates(g, beta, scal_base, t0, H)
    rows = scal_base + (t0 + tl.arange(0, BT)) * H
    dp_c, db_c, dgc = _grads_p_beta(
        tl.load(_rows(p, scal_base * K, t0, H * K, K)).to(tl.bfloat16),
        tl.load(_rows(k, scal_base * K, t0, H * K, K)).to(tl.bfloat16), bk,
        tl.load(X_in + vn_rows), tl.load(Vn_in + vn_cols),
        tl.load(S_in + (chunk * K + tl.arange(0, K)[None, :]) * V + tl.arange(0, V)[:, None]),
        _decay(gc, False, False), tl.exp(gc), tl.load(dbeta_v + rows))
    dg_c = _reverse_cumsum(tl.load(dgc_in + rows) + dgc)
    tl.store(_rows(dp, scal_base * K, t0, H * K, K), dp_c.to(dp.dtype.element_ty))
    tl.store(dbeta + rows, db_c.to(dbeta.dtype.element_ty))
    tl.store(dg + rows, dg_c)


class Config(NamedTuple):
    """One launch plan of the backward (see CONFIGS)."""

    transform_warps: int = 4
    scan_warps: int = 4
    scan_bv: int = 64                   # V block of a scan program: V / scan_bv programs per (b, h)
    state_dtype: torch.dtype = torch.bfloat16   # S_n and dS'_n in HBM (the scans carry them in fp32)
    grads_warps: int = 8
    split_grads: bool = False           # X = A^T dVn, dv in _adjoint_kernel; the rest in _grads_kernel
    transform_blocked: bool = False     # A by 16 x 16 blocks (_transform_blocked_kernel)
    grads_two: bool = False             # with split_grads: _grads_qk_kernel, then _grads_pb_kernel


# Every entry is exercised by the CUDA tests at the spec's correct shapes and one measure shape per K, and timed
# side by side by the benchmark; change them only together with a GPU run of those tests. DEFAULT is what
# comba_backward uses.
CONFIGS = {
    "base": Config(),
    # The transform by blocks and the gradient kernel halved, each alone against grads_split (A^T dVn in
    # its own kernel; bench/results/2026-11-29-f6e6021, sweep rows): split_blocked 5.45 / 6.56 ms against
    # 6.65 / 9.01 ms at (8, 2048, 32, 128, 128) / (16, 2048, 32, 64, 128), the transform 1.93 -> 0.72 and
    # 3.81 -> 1.36 ms; grads_two 5.75 / 8.26 ms, the gradient kernel 3.29 -> 1.80 + 0.59 and 3.13 -> 1.39 +
    # 0.98 ms. The two change different stages, so the default takes both.
    "split_blocked": Config(split_grads=True, transform_blocked=True),
    "grads_two": Config(split_grads=True, grads_two=True),
    "blocked_two": Config(split_grads=True, transform_blocked=True, grads_two=True),
}
DEFAULT = "blocked_two"


def comba_backward_stages(q, k, v, p, beta, g, do, scale: float, config: str = DEFAULT):
    """The backward as ordered launches: ({stage name: fn() launching it}, the six gradients once all ran).

    Each stage reads only what earlier stages wrote, so after one full pass any stage can be re-run (timed)
    alone. Inputs contiguous, K and V in {64, 128}; the gradients are (dq, dk, dv, dp, dbeta, dg) with dg in
    float32, padded in time to a multiple of the chunk (comba_backward_triton trims them).
    """
    cfg = CONFIGS[config]
    if cfg.grads_two and not cfg.split_grads:
        raise ValueError(f"plan {config!r}: grads_two reads X and dbeta_v from the adjoint kernel (split_grads)")
    B, T, H, K = q.shape
    V = v.shape[-1]
    q, k, v, p, beta, g, do = (pad_time(x) for x in (q, k, v, p, beta, g, do))
    Tp = q.shape[1]
    N, BH = Tp // CHUNK, B * H
    dev = q.device
    A = torch.empty(BH, N, CHUNK, CHUNK, device=dev, dtype=torch.float32)
    S = torch.empty(BH, N, K, V, device=dev, dtype=cfg.state_dtype)
    dS = torch.empty_like(S)
    Vn = torch.empty(BH, Tp, V, device=dev, dtype=torch.bfloat16)
    dVn = torch.empty_like(Vn)
    X = torch.empty_like(Vn) if cfg.split_grads else dVn            # unread unless split
    dbeta_v = torch.empty(beta.shape, device=dev, dtype=torch.float32) if cfg.split_grads else g
    dq, dk, dp = (torch.empty_like(x) for x in (q, k, p))
    dv, dbeta = torch.empty_like(v), torch.empty_like(beta)
    dg = torch.empty_like(g, dtype=torch.float32)
    dgc_qk = torch.empty_like(dg) if cfg.grads_two else dg          # the first half's terms of d gc
    BV = min(cfg.scan_bv, V)
    scan = dict(K=K, V=V, BV=BV, num_warps=cfg.scan_warps, num_stages=1)
    transform = _transform_blocked_kernel if cfg.transform_blocked else _transform_kernel
    stages = {
        "transform": lambda: transform[(N, BH)](k, p, beta, g, A, N, H, K, num_warps=cfg.transform_warps,
                                                num_stages=1),
        "forward_scan": lambda: _forward_scan_kernel[(V // BV, BH)](k, v, p, beta, g, A, S, Vn, N, H, **scan),
        "reverse_scan": lambda: _reverse_scan_kernel[(V // BV, BH)](q, k, p, beta, g, do, A, dS, dVn, scale, N,
                                                                    H, **scan),
        "adjoint": lambda: _adjoint_kernel[(N, BH)](v, beta, A, dVn, X, dv, dbeta_v, N, H, V, num_warps=4,
                                                    num_stages=1),
        "grads": lambda: _grads_kernel[(N, BH)](q, k, v, p, beta, g, do, A, S, dS, Vn, dVn, X, dbeta_v, dq, dk,
                                                dv, dp, dbeta, dg, scale, N, H, K, V, cfg.split_grads,
                                                num_warps=cfg.grads_warps, num_stages=1),
        "grads_qk": lambda: _grads_qk_kernel[(N, BH)](q, k, p, beta, g, do, S, dS, Vn, X, dq, dk, dgc_qk, scale, N,
                                                      H, K, V, num_warps=cfg.grads_warps, num_stages=1),
        "grads_pb": lambda: _grads_pb_kernel[(N, BH)](k, p, beta, g, S, Vn, X, dbeta_v, dgc_qk, dp, dbeta, dg, N,
                                                      H, K, V, num_warps=cfg.grads_warps, num_stages=1),
    }
    if not cfg.split_grads:
        del stages["adjoint"]
    for name in ("grads_qk", "grads_pb") if not cfg.grads_two else ("grads",):
        del stages[name]
    return stages, (dq, dk, dv, dp, dbeta, dg)


def comba_backward_triton(q, k, v, p, beta, g, do, scale: float, config: str = DEFAULT):
    """(dq, dk, dv, dp, dbeta, dg) in their inputs' dtypes (dg float32); inputs contiguous, K, V in {64, 128}."""
    T = q.shape[1]
    stages, grads = comba_backward_stages(q, k, v, p, beta, g, do, scale, config)
    for launch in stages.values():
        launch()
    if grads[0].shape[1] == T:
        return grads
    return tuple(x[:, :T].contiguous() for x in grads)
