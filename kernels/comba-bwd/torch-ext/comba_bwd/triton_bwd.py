"""The fused Comba backward in Triton: five chunk kernels (chunk length 64), no autograd.

Notation as in reference.py: per (b, h) and chunk n, gc the inclusive cumsum of g inside the chunk,
gam = exp(gc), Gam = exp(gc[-1]), E_ij = exp(gc_i - gc_j) (j <= i), L = strict_lower((beta P) K^T * E),
A = (I + L)^-1, Vn = A (beta V) - A (beta gam P) S, X = A^T dVn.

  1. _transform_kernel    (chunk-parallel)  A of each chunk in fp32 by 16 x 16 blocks -> HBM in bf16.
  2. _forward_scan_kernel (serial over chunks, per (b, h, V block))  S_n (bf16) and Vn (bf16) -> HBM.
  3. _reverse_scan_kernel (serial over chunks, reversed, dS in fp32)  dS'_n (bf16) -> HBM, and the chunk
     transform's adjoint X = A^T dVn of its V block: X (bf16), dv = beta X, and the block's part of
     sum_v(v X) (fp32) -> HBM (the last two left to `gluon_grads64` where it runs); dVn never leaves registers.
  4. _grads_kernel        (chunk-parallel, three programs a chunk)  dq, dk, dp and dbeta, by three parts
     (_q_part, _k_part, _pb_part) that run side by side, each with its terms of d gc (fp32 scratch).
  5. _dg_kernel           (chunk-parallel)  dg from the three parts' terms of d gc.
  The gradient parts loop over V in blocks, accumulating their products over V in fp32, so that no whole
  (K, V) state or [64, V] tile is live at once.
On Hopper with bf16 inputs and V = 128, Gluon kernels run instead of stages 2 to 5 at K = 128: `gluon_forward` and
`gluon_reverse`, one CTA a (b, h) over all of V, and `gluon_grads`, stages 4 and 5 in one kernel; at K = 64
`gluon_transform` (no data moved between threads) instead of stage 1, `gluon_forward` (one warpgroup a CTA) instead of
stage 2 and `gluon_grads64` (one warpgroup a CTA, two CTAs an SM, dv and dbeta's v part from X as well) instead of
stages 4 and 5.

Design choices (see README "Design"):
- The per-chunk A and states are materialised in HBM: the solve would sit on the serial path of the scans,
  and the chunk-parallel gradient kernels need the states of their chunk without a scan of their own.
- The adjoint needs ONE system solved transposed: X = A^T dVn. The other adjoint pieces follow from it
  (A^T dW = -X S^T, dL = -strict_lower(X Vn^T), W^T dVn = (beta gam P)^T X), so no second solve and no
  A^T dA A^T product.
- A is solved in fp32 and used as a bf16 tensor-core operand (as fla does); beta and the decay are applied
  to the other operand.
- No tl.trans of a dot result (Triton 3.6 Hopper miscompile, fla #640): every transposed operand is either
  loaded transposed from memory or is an elementwise product of loaded data.
"""

import functools

import torch
import triton
import triton.language as tl

from .dispatch import FAST_PATHS
from .common.fast_paths import falls_back
from .reference import CHUNK, G_FLOOR, pad_time
from .common.tf32 import tf32_high

try:  # Gluon, Triton's explicit-layout dialect: the scans and the gradients on Hopper (gluon_common.takes)
    from . import gluon_common, gluon_forward, gluon_grads, gluon_grads64, gluon_reverse, gluon_transform
except ImportError:  # a Triton without it: the Triton kernels everywhere
    gluon_common = None

BT = tl.constexpr(CHUNK)
FLOOR = tl.constexpr(G_FLOOR)  # the log-decay floor of reference.G_FLOOR: -inf is a hard reset


@triton.jit
def _gates(g, beta, scal_base, t0, H, R: tl.constexpr = BT, offset=None):
    """On the R rows from t0 (a chunk, or a block of one), all fp32 [R]: gc (inclusive cumsum of g), the
    log-decay to the last row, and beta; `offset` is the log-decay before t0 inside the chunk (for a block)."""
    r = tl.arange(0, R)
    gk = tl.maximum(tl.load(g + scal_base + (t0 + r) * H).to(tl.float32), FLOOR)
    bk = tl.load(beta + scal_base + (t0 + r) * H).to(tl.float32)
    gc, total = tl.cumsum(gk, 0), tl.sum(gk, 0)
    if offset is not None:
        gc, total = offset + gc, offset + total
    return gc, total, bk


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
def _chunk_offsets(N, H, PER_CHUNK: tl.constexpr = 1):
    """This program's chunk (grid: chunk times PER_CHUNK programs, b * H + h): the (B, T, H) offset of its (b, h),
    its first row, its index among all chunks, and the rows of its positions in a (B * H, T, ...) tensor."""
    n, bh = tl.program_id(0) // PER_CHUNK, tl.program_id(1)
    T = N * BT
    scal_base = (bh // H).to(tl.int64) * T * H + bh % H
    return scal_base, n * BT, bh.to(tl.int64) * N + n, bh.to(tl.int64) * T + n * BT + tl.arange(0, BT)


@triton.jit
def _n_pos(T, H):
    """B * T * H (T padded to whole chunks), the stride between dbeta_v's parts, one per scan V block: B taken
    from the grid, whose axis 1 is b * H + h in the scans and the chunk kernels alike, rather than passed as one
    more launch argument."""
    return tl.num_programs(1) // H * T * H


SUB = tl.constexpr(16)  # sub-block of the blocked transform: 4 x 4 blocks of 16 x 16 per chunk


@triton.jit
def _l_block(pk, bk, gc_i, kt, gc_j, DIAGONAL: tl.constexpr):
    """Block (i, j) of L = strict_lower((beta P) K^T * E) from P and beta on block i's rows (pk bf16 [SUB, K])
    and K^T on block j's ([K, SUB]), beta applied in fp32 after the product; a
    diagonal block keeps only its strictly lower part."""
    diff = gc_i[:, None] - gc_j[None, :]
    if DIAGONAL:
        diff = tl.where(tl.arange(0, SUB)[:, None] > tl.arange(0, SUB)[None, :], diff, float("-inf"))
    return tl.dot(pk, kt) * bk[:, None] * tl.exp(diff)


@triton.jit
def _inv_unit_lower(Lb):
    """(I + Lb)^-1 of a strictly lower [SUB, SUB] block in fp32: Lb is nilpotent (Lb^16 = 0), so the inverse
    is sum_k (-Lb)^k = (I - Lb)(I + Lb^2)(I + Lb^4)(I + Lb^8), six products of depth four, where a row-by-row
    substitution is 15 dependent steps of two cross-thread reductions each."""
    r = tl.arange(0, SUB)
    eye = tl.where(r[:, None] == r[None, :], 1.0, 0.0)
    L2 = _mm(Lb, Lb)
    L4 = _mm(L2, L2)
    D = _mm(eye - Lb, eye + L2)
    D = _mm(D, eye + L4)
    return _mm(D, eye + _mm(L4, L4))


@triton.jit
def _mm(a, b):
    """fp32 product of two 16 x 16 blocks by 3xTF32: each operand split into a TF32 high part and the residual,
    three tensor-core products summed in fp32, which keeps fp32's accuracy (the solve is fp32; one TF32 product is
    not). At one warp a chunk it is faster than fp32 FMA products, whose operands go through shared memory in
    replicated layouts. The split is `tf32_high`'s: faster than Triton's tf32x3 at the same accuracy, and as fast as
    truncated high parts while more accurate."""
    a_hi, b_hi = tf32_high(a), tf32_high(b)
    product = tl.dot(a - a_hi, b_hi, input_precision="tf32")
    product = tl.dot(a_hi, b - b_hi, product, input_precision="tf32")
    return tl.dot(a_hi, b_hi, product, input_precision="tf32")


@triton.jit
def _store_block(A, a_base, i: tl.constexpr, j: tl.constexpr, blk):
    r = tl.arange(0, SUB)
    tl.store(A + a_base + (r + i * SUB)[:, None] * BT + (r + j * SUB)[None, :], blk.to(A.dtype.element_ty))


@triton.jit
def _transform_kernel(k, p, beta, g, A, N, H, K: tl.constexpr):
    """A = (I + L)^-1 of one chunk by 16 x 16 blocks, in fp32: the four diagonal blocks D_i by _inv_unit_lower,
    then the off-diagonal blocks from them by block products (_mm, fp32-accurate); stored in A's dtype (bf16
    for the scans' tensor-core operands, fp32 in the tests)."""
    scal_base, t0, chunk, _ = _chunk_offsets(N, H)
    kbase = scal_base * K
    gc0, off, b0 = _gates(g, beta, scal_base, t0, H, SUB)
    gc1, off, b1 = _gates(g, beta, scal_base, t0 + SUB, H, SUB, off)
    gc2, off, b2 = _gates(g, beta, scal_base, t0 + 2 * SUB, H, SUB, off)
    gc3, _, b3 = _gates(g, beta, scal_base, t0 + 3 * SUB, H, SUB, off)
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
    # The two 32 x 32 diagonal halves, then the lower-left half -Bot (Lbl Top) by 16 x 16 blocks, M = Lbl Top:
    # eight dependent products deep where block row i's substitution from the rows above would be ten.
    A10 = -_mm(D1, _mm(L10, D0))
    A32 = -_mm(D3, _mm(L32, D2))
    M00 = _mm(L20, D0) + _mm(L21, A10)
    M01 = _mm(L21, D1)
    M10 = _mm(L30, D0) + _mm(L31, A10)
    M11 = _mm(L31, D1)
    A20 = -_mm(D2, M00)
    A21 = -_mm(D2, M01)
    A30 = -(_mm(A32, M00) + _mm(D3, M10))
    A31 = -(_mm(A32, M01) + _mm(D3, M11))

    a_base = chunk * BT * BT
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
    a = tl.load(A + chunk * BT * BT + r[:, None] * BT + r[None, :])
    vk = tl.load(v + scal_base * V + (t0 + r)[:, None] * (H * V) + cv[None, :])
    pk = tl.load(_rows(p, scal_base * K, t0, H * K, K))
    # Both products accumulate into the other term in place, so that no second [BT | K, BV] fp32 tile is live (the
    # scan does not spill at K = 64).
    U = tl.dot(a, (vk * bk[:, None]).to(tl.bfloat16))                      # A (beta V)
    W_neg = tl.dot(a, (pk * -(bk * gam)[:, None]).to(tl.bfloat16))         # -A (beta gam P)
    Vn = tl.dot(W_neg.to(tl.bfloat16), S.to(tl.bfloat16), acc=U).to(tl.bfloat16)
    tl.store(Vn_out + (bh.to(tl.int64) * T + t0 + r)[:, None] * V + cv[None, :], Vn.to(Vn_out.dtype.element_ty))
    kt = tl.load(_rows_t(k, scal_base * K, t0, H * K, K))
    kt_to_end = (kt * tl.exp(glast - gc)[None, :]).to(tl.bfloat16)       # (K * Gam / gam)^T
    return tl.dot(kt_to_end, Vn, acc=tl.exp(glast) * S)


# The scans' loops are pipelined STAGES deep (`_scan_stages`): the next chunk's tiles are copied into shared
# memory while one is computed, and 2 CTAs an SM still fit (at most 115 KB of shared memory each). N is not
# specialized: one compile for every T. The gates are loaded with the chunk: loaded a chunk ahead by hand, as the
# Gluon forward scan loads them, they make the reverse scan slower.
@triton.jit(do_not_specialize=["N"])
def _forward_scan_kernel(k, v, p, beta, g, A, S_out, Vn_out, N, H, K: tl.constexpr, V: tl.constexpr,
                         BV: tl.constexpr, STAGES: tl.constexpr):
    iv, bh = tl.program_id(0), tl.program_id(1)
    scal_base = (bh // H).to(tl.int64) * N * BT * H + bh % H
    cv = iv * BV + tl.arange(0, BV)
    S = tl.zeros([K, BV], dtype=tl.float32)
    for n in tl.range(0, N, num_stages=STAGES):
        S = _forward_step(k, v, p, beta, g, A, S_out, Vn_out, S, n, bh, scal_base, N, H, cv, K, V)


@triton.jit
def _reverse_step(q, k, v, p, beta, g, do, A, dS_out, X_out, dv, dbeta_v, dS, n, bh, iv, scal_base, scale, N,
                  H, cv, K: tl.constexpr, V: tl.constexpr, W_FIRST: tl.constexpr, V_ADJOINT: tl.constexpr):
    """Chunk n of the reverse scan: store dS'_n, X = A^T dVn and, where V_ADJOINT, dv and this V block's part of
    sum_v(v X) (else the gradient kernel makes them from X); return the gradient of the state before the chunk."""
    T = N * BT
    r = tl.arange(0, BT)
    t0, gc, glast, bk, gam, chunk = _scan_chunk(g, beta, dS_out, dS, n, bh, scal_base, N, H, cv, K, V)
    kk = tl.load(_rows(k, scal_base * K, t0, H * K, K))
    qt = tl.load(_rows_t(q, scal_base * K, t0, H * K, K))
    dok = tl.load(do + scal_base * V + (t0 + r)[:, None] * (H * V) + cv[None, :]).to(tl.bfloat16)
    # dVn = (scale lower(Q K^T) * E)^T dO + (K * Gam / gam) dS'
    # Ordered so that few tiles are live at once: dS' in bf16 for dVn, then dS updated in place (fp32).
    dS_b = dS.to(tl.bfloat16)
    scores_t = (tl.dot(kk.to(tl.bfloat16), qt.to(tl.bfloat16)) * scale * _decay(gc, True, False)).to(tl.bfloat16)
    dS = tl.dot((qt * (gam * scale)[None, :]).to(tl.bfloat16), dok, acc=tl.exp(glast) * dS)
    dVn = tl.dot(scores_t, dok, acc=tl.dot((kk * tl.exp(glast - gc)[:, None]).to(tl.bfloat16), dS_b))
    # dS = Gam dS' + scale (gam Q)^T dO - W^T dVn, with W = A (beta gam P). Where this program holds all of V
    # (W_FIRST), -W^T is formed apart from dS' as -(beta gam P)^T A^T, and dS waits on one product after dVn;
    # else W^T dVn = (beta gam P)^T X, which spares the V blocks' programs a product each of them would repeat.
    # Each form is the faster one where it is taken.
    a_t = tl.load(A + chunk * BT * BT + r[None, :] * BT + r[:, None])              # A^T
    if W_FIRST:
        pt = tl.load(_rows_t(p, scal_base * K, t0, H * K, K))
        w_t = tl.dot((pt * -(bk * gam)[None, :]).to(tl.bfloat16), a_t).to(tl.bfloat16)   # -W^T
        dVn = dVn.to(tl.bfloat16)  # after -W^T: this order compiles to the faster schedule
        dS = tl.dot(w_t, dVn, acc=dS)
    else:
        dVn = dVn.to(tl.bfloat16)
    # The chunk transform's adjoint on this V block: X = A^T dVn, dv = beta X, dbeta's v part.
    X = tl.dot(a_t, dVn)
    tl.store(X_out + (bh.to(tl.int64) * T + t0 + r)[:, None] * V + cv[None, :], X.to(X_out.dtype.element_ty))
    if V_ADJOINT:
        vk = tl.load(v + scal_base * V + (t0 + r)[:, None] * (H * V) + cv[None, :]).to(tl.float32)
        tl.store(dv + scal_base * V + (t0 + r)[:, None] * (H * V) + cv[None, :],
                 (bk[:, None] * X).to(dv.dtype.element_ty))
        tl.store(dbeta_v + iv * _n_pos(T, H) + scal_base + (t0 + r) * H, tl.sum(vk * X, 1))
    if not W_FIRST:
        pt = tl.load(_rows_t(p, scal_base * K, t0, H * K, K))
        dS = tl.dot((pt * -(bk * gam)[None, :]).to(tl.bfloat16), X.to(tl.bfloat16), acc=dS)
    return dS


@triton.jit(do_not_specialize=["N"])
def _reverse_scan_kernel(q, k, v, p, beta, g, do, A, dS_out, X_out, dv, dbeta_v, scale, N, H, K: tl.constexpr,
                         V: tl.constexpr, BV: tl.constexpr, STAGES: tl.constexpr, V_ADJOINT: tl.constexpr):
    iv, bh = tl.program_id(0), tl.program_id(1)
    scal_base = (bh // H).to(tl.int64) * N * BT * H + bh % H
    cv = iv * BV + tl.arange(0, BV)
    dS = tl.zeros([K, BV], dtype=tl.float32)
    for i in tl.range(0, N, num_stages=STAGES):  # chunks N - 1 down to 0
        dS = _reverse_step(q, k, v, p, beta, g, do, A, dS_out, X_out, dv, dbeta_v, dS, N - 1 - i, bh, iv, scal_base,
                           scale, N, H, cv, K, V, BV == V, V_ADJOINT)


@triton.jit
def _state_t(state, chunk, cv, K: tl.constexpr, V: tl.constexpr):
    """The [BV, K] block (columns cv of the chunk's (K, V) state, transposed) of S_n or dS'_n."""
    return tl.load(state + (chunk * K + tl.arange(0, K)[None, :]) * V + cv[:, None])


# The V loops of the gradient parts are pipelined GRADS_V_STAGES deep (the next V block's tiles copied while
# one is multiplied).
GRADS_V_STAGES = tl.constexpr(2)


@triton.jit
def _q_part(q, k, do, S_in, Vn_in, dq, gc, scal_base, t0, chunk, rows, scale, H, K: tl.constexpr, V: tl.constexpr,
            BV: tl.constexpr):
    """dq = scale [gam (dO S^T) + (lower(dO Vn^T) * E) K] (stored) and its term of d gc, q . dq."""
    do_s = tl.zeros([BT, K], dtype=tl.float32)
    do_vn = tl.zeros([BT, BT], dtype=tl.float32)
    for v0 in tl.range(0, V, BV, num_stages=GRADS_V_STAGES):
        cv = v0 + tl.arange(0, BV)
        dok = tl.load(do + scal_base * V + (t0 + tl.arange(0, BT))[:, None] * (H * V) + cv[None, :]).to(tl.bfloat16)
        do_s += tl.dot(dok, _state_t(S_in, chunk, cv, K, V))
        do_vn += tl.dot(dok, tl.load(Vn_in + rows[None, :] * V + cv[:, None]))
    qk = tl.load(_rows(q, scal_base * K, t0, H * K, K))
    kk = tl.load(_rows(k, scal_base * K, t0, H * K, K)).to(tl.bfloat16)
    dq_c = tl.dot((do_vn * _decay(gc, False, False) * scale).to(tl.bfloat16), kk,
                  acc=(scale * tl.exp(gc))[:, None] * do_s)
    tl.store(_rows(dq, scal_base * K, t0, H * K, K), dq_c.to(dq.dtype.element_ty))
    return tl.sum(qk.to(tl.float32) * dq_c, 1)


@triton.jit
def _k_part(q, k, p, do, dS_in, Vn_in, X_in, dk, gc, glast, bk, scal_base, t0, chunk, rows, scale, H,
            K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr):
    """dk = scale (lower(dO Vn^T) * E)^T Q + (Gam / gam) Vn dS'^T + dR^T (beta P), with dR = dL * E and
    dL = -strict_lower(X Vn^T) (the chunk transform's K side), stored; returns its terms of d gc."""
    vn_do = tl.zeros([BT, BT], dtype=tl.float32)                                # (dO Vn^T)^T
    vn_x = tl.zeros([BT, BT], dtype=tl.float32)                                 # (X Vn^T)^T
    vn_ds = tl.zeros([BT, K], dtype=tl.float32)
    for v0 in tl.range(0, V, BV, num_stages=GRADS_V_STAGES):
        cv = v0 + tl.arange(0, BV)
        vn = tl.load(Vn_in + rows[:, None] * V + cv[None, :])
        do_t = tl.load(do + scal_base * V + (t0 + tl.arange(0, BT))[None, :] * (H * V) + cv[:, None])
        vn_do += tl.dot(vn, do_t.to(tl.bfloat16))
        vn_x += tl.dot(vn, tl.load(X_in + rows[None, :] * V + cv[:, None]))
        vn_ds += tl.dot(vn, _state_t(dS_in, chunk, cv, K, V))
    # The [BT, BT] products weighted by the decay and rounded to bf16 first, so that the fp32 ones die before
    # the [BT, K] work. The read part's is scaled before the rounding, as in _q_part: then (dO Vn^T * E * scale)
    # is rounded to the same bf16 values on both sides, and their terms of d gc (q . dq against k . dk, which
    # nearly cancel) keep cancelling; scaled on one side only, dg's error is about three times larger. Scaled
    # before the rounding, the read part accumulates into dk in place, which with _pb_part's dL * L from dLE keeps
    # the gradient kernel's spill small.
    r = tl.arange(0, BT)
    E_t = _decay(gc, True, False)
    read = (vn_do * E_t * scale).to(tl.bfloat16)
    dR_t = tl.where(r[:, None] < r[None, :], -vn_x * E_t, 0.0).to(tl.bfloat16)
    qk = tl.load(_rows(q, scal_base * K, t0, H * K, K)).to(tl.bfloat16)
    kk = tl.load(_rows(k, scal_base * K, t0, H * K, K)).to(tl.bfloat16)
    # The gate terms of d gc take k . dk of the state part and of the read part; the read part's as
    # sum_i read_ji (k_j . q_i), from a [BT, BT] product, so that no fp32 copy of k stays live.
    k_read = tl.sum(read.to(tl.float32) * tl.dot(kk, tl.trans(qk)), 1)
    # One [BT, K] tile, accumulated in place: the state part, the read part, the transform's K side.
    dk_c = tl.exp(glast - gc)[:, None] * vn_ds
    k_state = tl.sum(kk.to(tl.float32) * dk_c, 1)
    dk_c = tl.dot(read, qk, acc=dk_c)
    pk = tl.load(_rows(p, scal_base * K, t0, H * K, K))
    dk_c = tl.dot(dR_t, (pk * bk[:, None]).to(tl.bfloat16), acc=dk_c)
    tl.store(_rows(dk, scal_base * K, t0, H * K, K), dk_c.to(dk.dtype.element_ty))
    return tl.where(r == BT - 1, tl.sum(k_state, 0), 0.0) - k_read - k_state


@triton.jit
def _reverse_cumsum(x):
    """dg from d gc: the sum over the chunk's later rows, each row included (gc is an inclusive cumsum)."""
    return tl.sum(x, 0) - tl.cumsum(x, 0) + x


@triton.jit
def _store_dp_dbeta(x_s, dLE, kk, pk, pk_kt, gc, bk, dbeta_v, dp_rows, dbeta, rows_h, n_pos, NV: tl.constexpr):
    """The transform's P side: dp = beta (gam Y + dLE K) with Y = A^T dW = -X S^T (x_s = X S^T, fp32) and
    dLE = dL * E (bf16), and dbeta = p . (gam Y + dLE K) plus the scans' V-block parts (dbeta_v, NV of them,
    n_pos apart); stores both and returns dbeta's gate term of d gc, beta gam (p . Y). p . (dLE K) is taken as
    sum_j dLE_ij (p_i . k_j) from pk_kt = P K^T (fp32), so that no fp32 copy of P stays live."""
    z = -tl.exp(gc)[:, None] * x_s
    p_y = tl.sum(pk.to(tl.float32) * z, 1)
    db = p_y + tl.sum(dLE.to(tl.float32) * pk_kt, 1)
    for iv in range(NV):
        db += tl.load(dbeta_v + iv * n_pos + rows_h)
    tl.store(dbeta + rows_h, db.to(dbeta.dtype.element_ty))
    z = tl.dot(dLE, kk, acc=z)
    tl.store(dp_rows, (bk[:, None] * z).to(dp_rows.dtype.element_ty))
    return bk * p_y


@triton.jit
def _pb_part(k, p, S_in, dS_in, Vn_in, X_in, dbeta_v, dp, dbeta, gc, glast, bk, scal_base, t0, chunk, rows, N, H,
             K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, NV: tl.constexpr):
    """dp and dbeta (A^T dW = -X S^T; the chunk transform's P side), stored; returns their terms of d gc and the
    decay of the carried state's, Gam <S_n, dS'_n>, on the chunk's last row."""
    x_s = tl.zeros([BT, K], dtype=tl.float32)
    x_vn = tl.zeros([BT, BT], dtype=tl.float32)
    s_ds = tl.zeros([K], dtype=tl.float32)                                       # <S_n, dS'_n> by column
    for v0 in tl.range(0, V, BV, num_stages=GRADS_V_STAGES):
        cv = v0 + tl.arange(0, BV)
        xk = tl.load(X_in + rows[:, None] * V + cv[None, :])
        s_t = _state_t(S_in, chunk, cv, K, V)
        x_s += tl.dot(xk, s_t)
        x_vn += tl.dot(xk, tl.load(Vn_in + rows[None, :] * V + cv[:, None]))
        s_ds += tl.sum(s_t.to(tl.float32) * _state_t(dS_in, chunk, cv, K, V).to(tl.float32), 0)
    r = tl.arange(0, BT)
    E = _decay(gc, False, False)
    pk = tl.load(_rows(p, scal_base * K, t0, H * K, K)).to(tl.bfloat16)
    kk = tl.load(_rows(k, scal_base * K, t0, H * K, K)).to(tl.bfloat16)
    dLE = tl.where(r[:, None] > r[None, :], -x_vn * E, 0.0)                      # dL * E
    pk_kt = tl.dot(pk, tl.trans(kk))
    dL_L = dLE * pk_kt * bk[:, None]                                             # dL * L
    rows_h = scal_base + (t0 + r) * H
    dgc = tl.sum(dL_L, 1) - tl.sum(dL_L, 0) + _store_dp_dbeta(
        x_s, dLE.to(tl.bfloat16), kk, pk, pk_kt, gc, bk, dbeta_v, _rows(dp, scal_base * K, t0, H * K, K), dbeta,
        rows_h, _n_pos(N * BT, H), NV)
    return dgc + tl.where(r == BT - 1, tl.exp(glast) * tl.sum(s_ds, 0), 0.0)


@triton.jit
def _grads_kernel(q, k, p, beta, g, do, S_in, dS_in, Vn_in, X_in, dbeta_v, dq, dk, dp, dbeta, dgc_parts,
                 scale, N, H, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, NV: tl.constexpr):
    """Every gradient of the chunk but dv: the three parts (_q_part, _k_part, _pb_part) as three programs of one
    launch, next to each other in the grid. They run at the same time, so what two of them read (S, dS', Vn, X,
    dO and the chunk's q, k, p) comes from HBM once and from L2 after, while each program holds the registers of
    one part only: faster than three kernels one after the other, whose inputs come from HBM each time, and than
    the three parts in turn in one program, which spills. Their terms of d gc go to dgc_parts, one row of it a
    part, summed by _dg_kernel. Each part loads the gates and stores its terms itself: loaded once before the
    branches, the gates would stay live across all three and the kernel would spill more."""
    part = tl.program_id(0) % 3
    scal_base, t0, chunk, rows = _chunk_offsets(N, H, 3)
    n_pos = _n_pos(N * BT, H)
    if part == 0:
        gc, _, _ = _gates(g, beta, scal_base, t0, H)
        dgc = _q_part(q, k, do, S_in, Vn_in, dq, gc, scal_base, t0, chunk, rows, scale, H, K, V, BV)
        tl.store(dgc_parts + rows, dgc)
    elif part == 1:
        gc, glast, bk = _gates(g, beta, scal_base, t0, H)
        dgc = _k_part(q, k, p, do, dS_in, Vn_in, X_in, dk, gc, glast, bk, scal_base, t0, chunk, rows, scale, H, K, V,
                      BV)
        tl.store(dgc_parts + n_pos + rows, dgc)
    else:
        gc, glast, bk = _gates(g, beta, scal_base, t0, H)
        dgc = _pb_part(k, p, S_in, dS_in, Vn_in, X_in, dbeta_v, dp, dbeta, gc, glast, bk, scal_base, t0, chunk, rows,
                       N, H, K, V, BV, NV)
        tl.store(dgc_parts + 2 * n_pos + rows, dgc)


@triton.jit
def _dg_kernel(dgc_parts, dg, N, H):
    """dg of one chunk from the three parts' terms of d gc. dgc_parts is (3, B * H, T), so that a chunk's rows
    are contiguous for the loads (in a (B, T, H) tensor they lie H apart)."""
    scal_base, t0, _, rows = _chunk_offsets(N, H)
    n_pos = _n_pos(N * BT, H)
    dgc = tl.load(dgc_parts + rows) + tl.load(dgc_parts + n_pos + rows) + tl.load(dgc_parts + 2 * n_pos + rows)
    tl.store(dg + scal_base + (t0 + tl.arange(0, BT)) * H, _reverse_cumsum(dgc))


# The scans run 4 warps a program; the gradient parts loop over V in blocks of V_BLOCK. The transform runs 1 warp a
# chunk, faster than 2 or 4; the gradient parts 4 warps, faster than 8 capped at 128 registers for 2 CTAs an SM.
SCAN_WARPS = 4
TRANSFORM_WARPS = 1
GRADS_WARPS = 4
V_BLOCK = 64

# The scans cut V across their programs in blocks of SCAN_STATE // K columns (at most V), so that a program's
# (K, block) state has 128 x 64 entries at either K. At K = 64 one program then takes all of V = 128 and loads
# the chunk's q, k, p and A once instead of twice, which is faster; blocks of 32 at K = 128 (twice the programs)
# are slower than 64.
SCAN_STATE = 128 * 64

# The gradient kernel's register cap by K. At K = 64 its shared memory (64 KB) lets 3 CTAs share an SM if each
# takes at most 168 registers, which is faster though it spills more (a cap of 200, still 2 CTAs an SM, is
# slower than none). At K = 128 its 80 KB allow 2 CTAs whatever the cap, and a cap of 168 spills heavily.
GRADS_MAXNREG = {64: 168, 128: None}


# The pipelined reverse scan takes 115 KB of shared memory (either K, its state block being the same size):
# more than a block may have on sm_86 / sm_89 (99 KB), where the scans run unpipelined (64 KB at most).
PIPELINED_SCAN_SHARED = 116 * 1024


@functools.cache
def _scan_stages(device: torch.device) -> int:
    """How deep the scans pipeline their chunk loop on `device` (2; 1 where shared memory is too small)."""
    if device.type != "cuda":
        return 2  # the interpreter, or an offline compile for sm_90
    return 2 if torch.cuda.get_device_properties(device).shared_memory_per_block_optin >= PIPELINED_SCAN_SHARED else 1


def comba_backward_stages(q, k, v, p, beta, g, do, scale: float, grads=None):
    """The backward as ordered launches: ({stage name: fn() launching it}, the six gradients once all ran).

    Each stage reads only what earlier stages wrote, so after one full pass any stage can be re-run (timed)
    alone. Inputs contiguous, K and V in {64, 128}; the gradients are (dq, dk, dv, dp, dbeta, dg) with dg in
    float32, padded in time to a multiple of the chunk (comba_backward_triton trims them); `grads`, when given,
    are contiguous tensors of those shapes and dtypes to write them into.
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    q, k, v, p, beta, g, do = (pad_time(x) for x in (q, k, v, p, beta, g, do))
    Tp = q.shape[1]
    N, BH = Tp // CHUNK, B * H
    BV, SBV = min(V_BLOCK, V), min(V, SCAN_STATE // K)
    dev = q.device
    gluon = _gluon_stages(q, V)
    # dv = beta X and dbeta's v part, v . X, come from the reverse scan (the latter in parts, one per V block of it),
    # or from the K = 64 Gluon gradient kernel, which reads X anyway, where that kernel runs (`gluon_grads64`).
    v_adjoint_in_grads = "grads" in gluon and K == 64
    NV = 0 if v_adjoint_in_grads else 1 if "reverse_scan" in gluon else V // SBV
    A = torch.empty(BH, N, CHUNK, CHUNK, device=dev, dtype=torch.bfloat16)
    S = torch.empty(BH, N, K, V, device=dev, dtype=torch.bfloat16)
    dS = torch.empty_like(S)
    Vn = torch.empty(BH, Tp, V, device=dev, dtype=torch.bfloat16)
    X = torch.empty_like(Vn)
    dbeta_v = torch.empty(NV, *beta.shape, device=dev, dtype=torch.float32)
    dq, dk, dv, dp, dbeta, dg = _gradients_like(q, k, v, p, beta, g) if grads is None else grads
    scan = dict(K=K, V=V, BV=SBV, STAGES=_scan_stages(dev), num_warps=SCAN_WARPS, num_stages=1)
    parts = dict(K=K, V=V, BV=BV, num_warps=GRADS_WARPS, num_stages=1, maxnreg=GRADS_MAXNREG[K])
    chunks = (N, BH)
    t = gluon_common.tiles(q, k, p, v, do, A, S, dS, Vn, X) if gluon else None
    if "transform" in gluon:
        stages = {"transform": lambda: gluon_transform.launch(k, p, beta, g, A)}
    else:
        stages = {"transform": lambda: _transform_kernel[chunks](k, p, beta, g, A, N, H, K,
                                                                num_warps=TRANSFORM_WARPS, num_stages=1)}
    if "forward_scan" in gluon:
        stages["forward_scan"] = lambda: gluon_forward.launch(t, k, v, beta, g)
    else:
        stages["forward_scan"] = lambda: _forward_scan_kernel[(V // SBV, BH)](k, v, p, beta, g, A, S, Vn, N, H, **scan)
    if "reverse_scan" in gluon:
        stages["reverse_scan"] = lambda: gluon_reverse.launch(t, q, v, beta, g, dv, dbeta_v, scale)
    else:
        stages["reverse_scan"] = lambda: _reverse_scan_kernel[(V // SBV, BH)](
            q, k, v, p, beta, g, do, A, dS, X, dv, dbeta_v, scale, N, H, V_ADJOINT=not v_adjoint_in_grads, **scan)
    if v_adjoint_in_grads:
        stages["grads"] = lambda: gluon_grads64.launch(t, q, beta, g, dq, dk, dv, dp, dbeta, dg, scale)
    elif "grads" in gluon:
        stages["grads"] = lambda: gluon_grads.launch(t, q, do, beta, g, dbeta_v, dq, dk, dp, dbeta, dg, scale)
    else:
        dgc_parts = torch.empty(3, BH, Tp, device=dev, dtype=torch.float32)  # d gc terms, per gradient part
        stages["grads"] = lambda: _grads_kernel[(3 * N, BH)](q, k, p, beta, g, do, S, dS, Vn, X, dbeta_v, dq, dk, dp,
                                                             dbeta, dgc_parts, scale, N, H, NV=NV, **parts)
        stages["dg"] = lambda: _dg_kernel[chunks](dgc_parts, dg, N, H, num_warps=1, num_stages=1)
    return stages, (dq, dk, dv, dp, dbeta, dg)


def _gradients_like(q, k, v, p, beta, g):
    """Uninitialised (dq, dk, dv, dp, dbeta, dg): each like its input, dg in float32."""
    return (*(torch.empty_like(x) for x in (q, k, v, p, beta)), torch.empty_like(g, dtype=torch.float32))


# The batch is cut in BATCH_PIECES pieces. On CUDA each piece is launched on a stream of its own, and its reverse
# scan on one more stream beside its forward scan (the scans depend only on the transform). The stages are
# bound by different things (the transform by its chain of small products, the scans by their serial chunk loop and
# HBM, the gradient kernel by L2), and a scan's last wave is partial, so stages of the two pieces fill each other's
# idle SMs; three pieces are no faster than two. The reverse scan's side stream pays in one piece as well.
BATCH_PIECES = 2


def _gluon_stages(q, V: int) -> tuple:
    """The stages a Gluon kernel runs for a call with these q (B, T, H, K) and V (`gluon_common.takes`)."""
    return gluon_common.takes(q.device, q.dtype, q.shape[-1], V) if gluon_common is not None else ()


def _batch_pieces(q, V: int) -> int:
    """How many pieces the batch is cut in: BATCH_PIECES, but one where Gluon kernels run at K = 128. There the host
    takes about as long to launch two pieces as the GPU takes to run them, so a second piece gains nothing and makes
    the time vary from run to run; at K = 64 the GPU's time is well above the host's, and two pieces are faster."""
    return 1 if _gluon_stages(q, V) and q.shape[-1] == 128 else BATCH_PIECES


@functools.cache
def _side_streams(device: torch.device, n: int) -> tuple:
    """n streams of `device`, made once and reused by every call."""
    return tuple(torch.cuda.Stream(device) for _ in range(n))


def _launch_on_streams(pieces, device: torch.device):
    """Launch each piece's stages ({name: launch}) on a pair of streams, the first piece's pair starting with the
    current stream, the others forked from it, and join them back into it."""
    main = torch.cuda.current_stream(device)
    streams = (main, *_side_streams(device, 2 * len(pieces) - 1))
    for own in streams[2::2]:
        own.wait_stream(main)
    for stages, own, side in zip(pieces, streams[0::2], streams[1::2]):
        with torch.cuda.stream(own):
            stages["transform"]()
            side.wait_stream(own)
            with torch.cuda.stream(side):
                stages["reverse_scan"]()
            stages["forward_scan"]()
            own.wait_stream(side)
            for name, launch in stages.items():
                if name not in ("transform", "forward_scan", "reverse_scan"):  # the gradient stages
                    launch()
    for own in streams[2::2]:
        main.wait_stream(own)


def comba_backward_triton(q, k, v, p, beta, g, do, scale: float):
    """(dq, dk, dv, dp, dbeta, dg) in their inputs' dtypes (dg float32); inputs contiguous, K, V in {64, 128}.

    A Gluon kernel compiles at its first launch of a specialization; if a call that takes Gluon kernels raises, the
    Gluon path is switched off for the process (`dispatch.FAST_PATHS.failed`, one warning) and the call runs on the
    Triton kernels, after the device has finished what the failed attempt launched (its scratch is freed)."""
    if not _gluon_stages(q, v.shape[-1]):
        return _backward(q, k, v, p, beta, g, do, scale)
    try:
        return _backward(q, k, v, p, beta, g, do, scale)
    except Exception as error:
        if not falls_back(error):
            raise
        FAST_PATHS.failed("gluon", error)
        if q.is_cuda and not torch.cuda.is_current_stream_capturing():
            torch.cuda.synchronize(q.device)
        return _backward(q, k, v, p, beta, g, do, scale)


def _backward(q, k, v, p, beta, g, do, scale: float):
    B, T = q.shape[:2]
    inputs = [pad_time(x) for x in (q, k, v, p, beta, g, do)]
    grads = _gradients_like(*inputs[:6])
    n = min(_batch_pieces(q, v.shape[-1]), B)
    cuts = [B * i // n for i in range(n + 1)]
    # Every piece's scratch is allocated before the launches and referenced until the streams are joined, so the
    # allocator cannot hand one piece's freed scratch to another piece's stream while it still runs.
    pieces = [comba_backward_stages(*(x[a:b] for x in inputs), scale, tuple(x[a:b] for x in grads))[0]
              for a, b in zip(cuts, cuts[1:])]
    if q.is_cuda:
        _launch_on_streams(pieces, q.device)
    else:
        for stages in pieces:
            for launch in stages.values():
                launch()
    if grads[0].shape[1] == T:
        return grads
    return tuple(x[:, :T].contiguous() for x in grads)
