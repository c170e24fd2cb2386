"""The chunk transform in Triton: A = (I + L)^-1 of each chunk, L = strict_lower((beta P) K^T * E), solved in fp32
by 16 x 16 blocks, one warp a chunk, and stored in A's dtype (bf16, a tensor-core operand of the scans' terms and of
the adjoint, as fla uses it; beta and the decay are applied to the other operand there). A lives in HBM: solved in
the scans, it would sit on their serial path.

A non-finite input at step t reaches no row of A before t (`reference.py` states the rule): L's entries are taken
finite (`common.finite.finite_part`: a masked weight of 0 times a non-finite k_j, or a non-finite row's entries,
would reach the earlier rows through the solve's products), and A's rows from the chunk's first step with a
non-finite k, p, beta or g (g = -inf excepted) on are stored NaN (`common.finite.reached`), which carries the value
to every later use of those rows. The step is found in the diagonal blocks of (beta P) K^T, whose row t holds
k_t, p_t and beta_t, and in g as stored (`chunk.gate_edge`): on a clean chunk the guard is isfinite selects on
16 x 16 blocks, five reductions to one row and a select at the store."""

import triton
import triton.language as tl

from ..common.finite import finite_part, reached
from ..common.tf32 import tf32_high
from .chunk import (BT, call_rows, chunk_offsets, gate_edge, gates, group, key_head, load_rows, read_log_decay,
                    row_ptrs, row_ptrs_t, rows_args)

# One warp a chunk: faster than 2 or 4.
TRANSFORM_WARPS = 1
# The columns of P and K in one slice of L's products, by K: all of K at 64 and 128; at K = 256 four slices of 64,
# the products summed over them before `_l_block` applies beta and the decay. Each dot operand is whole in every
# warp: whole [16, 256] tiles would spill at one warp, slices of 64 keep within its registers.
TRANSFORM_SLICE = {64: 64, 128: 128, 256: 64}

SUB = tl.constexpr(16)  # sub-block of the blocked transform: 4 x 4 blocks of 16 x 16 per chunk


@triton.jit
def _l_block(pk, bk, gr_i, gc_j, DIAGONAL: tl.constexpr):
    """(Block (i, j) of L = strict_lower((beta P) K^T * E), the first of its rows whose (beta P) K^T holds a
    non-finite entry on or below the diagonal, SUB if none) from pk = P K^T on block i's rows and block j's columns
    (fp32 [SUB, SUB], summed over the slices of K), beta on block i's rows applied in fp32 after the product; a
    diagonal block keeps only its strictly lower part. gr_i is the read's log-decay on block i's rows (gc in the
    spec's order). The block's non-finite entries are zeroed: their rows are NaN in A (`_transform_kernel`). A
    diagonal block's row r holds p_r, beta_r and k_r in (beta P) K^T's diagonal entry, so the diagonal blocks' rows
    see every non-finite k, p and beta of the chunk at its own step."""
    pkb = pk * bk[:, None]
    diff = gr_i[:, None] - gc_j[None, :]
    if DIAGONAL:
        r = tl.arange(0, SUB)
        diff = tl.where(r[:, None] > r[None, :], diff, float("-inf"))
        pkb_seen = tl.where(r[:, None] >= r[None, :], pkb, 0.0)
    else:
        pkb_seen = pkb
    _, edge = finite_part(pkb_seen, SUB, False)
    block, _ = finite_part(pkb * tl.exp(diff), SUB, False)
    return block, edge


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
def _store_block(A, a_base, i: tl.constexpr, j: tl.constexpr, blk, edge):
    """Block (i, j) of A, NaN on the chunk's rows from `edge` on."""
    r = tl.arange(0, SUB)
    blk = reached(blk, edge - i * SUB, SUB, False)
    tl.store(A + a_base + (r + i * SUB)[:, None] * BT + (r + j * SUB)[None, :], blk.to(A.dtype.element_ty))


@triton.jit
def _p_block(p, base, t0, t_end, HD, KS: tl.constexpr):
    """The [SUB, KS] block of P on the SUB rows from t0, columns base.. (bf16)."""
    return load_rows(row_ptrs(p, base, t0, HD, KS, SUB), t0, t_end, SUB).to(tl.bfloat16)


@triton.jit
def _k_block_t(k, base, t0, t_end, HD, KS: tl.constexpr):
    """The [KS, SUB] block of K^T on the SUB rows from t0, columns base.. (bf16)."""
    return load_rows(row_ptrs_t(k, base, t0, HD, KS, SUB), t0, t_end, SUB, True).to(tl.bfloat16)


@triton.jit
def _transform_kernel(k, p, beta, g, A, N, H, K: tl.constexpr, KS: tl.constexpr, T=None, layout=None,
                      GROUP: tl.constexpr = 1, READ_FIRST: tl.constexpr = False, PACKED: tl.constexpr = False,
                      MASKED: tl.constexpr = False):
    """A = (I + L)^-1 of one chunk by 16 x 16 blocks, in fp32: the four diagonal blocks D_i by _inv_unit_lower,
    then the off-diagonal blocks from them by block products (_mm, fp32-accurate); stored in A's dtype (bf16
    for the scans' tensor-core operands, fp32 in the tests). H value heads, GROUP of them a key head. In fla's read
    order (READ_FIRST) L's rows take the read's log-decay gr (`chunk.read_log_decay`). A's rows from the chunk's
    first step with a non-finite k, p, beta or g on are NaN (the module docstring). The chunk's rows of the inputs
    as `chunk.chunk_rows` finds them (PACKED, MASKED)."""
    scal_base, t0, t_end, chunk, _ = chunk_offsets(N, T, H, layout, 1, PACKED, MASKED)
    if not MASKED:
        t_end = None
    kb, HK = key_head(scal_base, tl.program_id(1), call_rows(T, N, MASKED), H, GROUP)
    kbase = kb * K
    gc0, off, b0 = gates(g, beta, scal_base, t0, H, SUB, t_end=t_end)
    gc1, off, b1 = gates(g, beta, scal_base, t0 + SUB, H, SUB, off, t_end)
    gc2, off, b2 = gates(g, beta, scal_base, t0 + 2 * SUB, H, SUB, off, t_end)
    gc3, _, b3 = gates(g, beta, scal_base, t0 + 3 * SUB, H, SUB, off, t_end)
    gr0 = read_log_decay(g, scal_base, t0, H, gc0, READ_FIRST, SUB, t_end)
    gr1 = read_log_decay(g, scal_base, t0 + SUB, H, gc1, READ_FIRST, SUB, t_end)
    gr2 = read_log_decay(g, scal_base, t0 + 2 * SUB, H, gc2, READ_FIRST, SUB, t_end)
    gr3 = read_log_decay(g, scal_base, t0 + 3 * SUB, H, gc3, READ_FIRST, SUB, t_end)
    edge = gate_edge(g, beta, scal_base, t0, H, t_end=t_end)
    # Every block of L first, so that the P and K tiles are dead before the substitutions, by columns, with P on each
    # block's rows and K^T on each block's columns (loaded transposed) each loaded at its first use. A tile goes to its
    # dot operand layout through shared memory; loaded at its first use, it leaves shared memory at once under every
    # supported Triton (8 KB at K = 128), where from 3.7, which moves each read of such a buffer to the tile's first
    # use, tiles loaded up front would sit there together (32 KB: 6 CTAs an SM, not the 8 that registers allow).
    # P K^T by blocks, summed over slices of KS columns of P and K (`TRANSFORM_SLICE`): one slice up to K = 128, four
    # at K = 256.
    PK00, PK10, PK20, PK30, PK11 = None, None, None, None, None
    PK21, PK31, PK22, PK32, PK33 = None, None, None, None, None
    for ks in tl.static_range(0, K, KS):
        p0 = _p_block(p, kbase + ks, t0, t_end, HK * K, KS)
        kt = _k_block_t(k, kbase + ks, t0, t_end, HK * K, KS)
        PK00 = tl.dot(p0, kt, PK00)
        p1 = _p_block(p, kbase + ks, t0 + SUB, t_end, HK * K, KS)
        PK10 = tl.dot(p1, kt, PK10)
        p2 = _p_block(p, kbase + ks, t0 + 2 * SUB, t_end, HK * K, KS)
        PK20 = tl.dot(p2, kt, PK20)
        p3 = _p_block(p, kbase + ks, t0 + 3 * SUB, t_end, HK * K, KS)
        PK30 = tl.dot(p3, kt, PK30)
        kt = _k_block_t(k, kbase + ks, t0 + SUB, t_end, HK * K, KS)
        PK11 = tl.dot(p1, kt, PK11)
        PK21 = tl.dot(p2, kt, PK21)
        PK31 = tl.dot(p3, kt, PK31)
        kt = _k_block_t(k, kbase + ks, t0 + 2 * SUB, t_end, HK * K, KS)
        PK22 = tl.dot(p2, kt, PK22)
        PK32 = tl.dot(p3, kt, PK32)
        kt = _k_block_t(k, kbase + ks, t0 + 3 * SUB, t_end, HK * K, KS)
        PK33 = tl.dot(p3, kt, PK33)
    L00, e0 = _l_block(PK00, b0, gr0, gc0, True)
    L10, _ = _l_block(PK10, b1, gr1, gc0, False)
    L20, _ = _l_block(PK20, b2, gr2, gc0, False)
    L30, _ = _l_block(PK30, b3, gr3, gc0, False)
    L11, e1 = _l_block(PK11, b1, gr1, gc1, True)
    L21, _ = _l_block(PK21, b2, gr2, gc1, False)
    L31, _ = _l_block(PK31, b3, gr3, gc1, False)
    L22, e2 = _l_block(PK22, b2, gr2, gc2, True)
    L32, _ = _l_block(PK32, b3, gr3, gc2, False)
    L33, e3 = _l_block(PK33, b3, gr3, gc3, True)
    edge = tl.minimum(edge, tl.where(e0 < SUB, e0, BT))
    edge = tl.minimum(edge, tl.where(e1 < SUB, e1 + SUB, BT))
    edge = tl.minimum(edge, tl.where(e2 < SUB, e2 + 2 * SUB, BT))
    edge = tl.minimum(edge, tl.where(e3 < SUB, e3 + 3 * SUB, BT))
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
    _store_block(A, a_base, 0, 0, D0, edge)
    _store_block(A, a_base, 0, 1, zero, edge)
    _store_block(A, a_base, 0, 2, zero, edge)
    _store_block(A, a_base, 0, 3, zero, edge)
    _store_block(A, a_base, 1, 0, A10, edge)
    _store_block(A, a_base, 1, 1, D1, edge)
    _store_block(A, a_base, 1, 2, zero, edge)
    _store_block(A, a_base, 1, 3, zero, edge)
    _store_block(A, a_base, 2, 0, A20, edge)
    _store_block(A, a_base, 2, 1, A21, edge)
    _store_block(A, a_base, 2, 2, D2, edge)
    _store_block(A, a_base, 2, 3, zero, edge)
    _store_block(A, a_base, 3, 0, A30, edge)
    _store_block(A, a_base, 3, 1, A31, edge)
    _store_block(A, a_base, 3, 2, A32, edge)
    _store_block(A, a_base, 3, 3, D3, edge)


def launch(k, p, beta, g, A, read_first: bool = False, packing=None):
    """A (B * HV, N, 64, 64) of inputs k, p (B, T, H, K), beta and g (B, T, HV), HV a multiple of H, in A's dtype, on
    the N chunks of A: T = N * 64, or fewer rows, those of the last chunk from T on read as zeros; with `packing`
    (`pipeline.Packing`, B = 1), each packed sequence on chunks of its own. read_first: fla's read order."""
    B, T, HV = beta.shape
    N = A.shape[1]
    order = {"READ_FIRST": True} if read_first else {}
    K = k.shape[-1]
    _transform_kernel[(N, B * HV)](k, p, beta, g, A, N, HV, K, TRANSFORM_SLICE[K], **rows_args(T, N, packing),
                                   **group(k, beta), **order, num_warps=TRANSFORM_WARPS, num_stages=1)
