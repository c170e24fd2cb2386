"""The chunk transform in Triton: A = (I + L)^-1 of each chunk, L = strict_lower((beta P) K^T * E), solved in fp32
by 16 x 16 blocks, one warp a chunk, and stored in A's dtype (bf16, a tensor-core operand of the scans, as fla uses
it; beta and the decay are applied to the other operand there). A lives in HBM: solved in the scans, it would sit on
their serial path."""

import triton
import triton.language as tl

from ..common.tf32 import tf32_high
from ..reference import CHUNK
from .chunk import BT, chunk_offsets, gates, group, key_head, read_log_decay, row_ptrs, row_ptrs_t

# One warp a chunk: faster than 2 or 4.
TRANSFORM_WARPS = 1
# The columns of P and K in one slice of L's products, by K: all of K at 64 and 128; at K = 256 four slices of 64,
# each product accumulated over them, beta and the decay applied after the last (`_l_block`). Each dot operand is
# whole in every warp, so whole [16, 256] tiles spill about 1.4 KB at one warp (250 B at four), slices of 128 about
# 700 B, slices of 64 under 50 B (tools.compile_offline, sm_90a).
TRANSFORM_SLICE = {64: 64, 128: 128, 256: 64}

SUB = tl.constexpr(16)  # sub-block of the blocked transform: 4 x 4 blocks of 16 x 16 per chunk


@triton.jit
def _l_block(pk, bk, gr_i, kt, gc_j, DIAGONAL: tl.constexpr, acc=None, LAST: tl.constexpr = True):
    """Block (i, j) of L = strict_lower((beta P) K^T * E) from P and beta on block i's rows (pk bf16 [SUB, K])
    and K^T on block j's ([K, SUB]), beta applied in fp32 after the product; a diagonal block keeps only its
    strictly lower part. gr_i is the read's log-decay on block i's rows (gc in the spec's order). On slices of K
    (`TRANSFORM_SLICE`) pk and kt are one slice: the product accumulates into acc, that of the earlier slices, and
    beta and the decay are applied after the LAST."""
    if LAST:
        diff = gr_i[:, None] - gc_j[None, :]
        if DIAGONAL:
            diff = tl.where(tl.arange(0, SUB)[:, None] > tl.arange(0, SUB)[None, :], diff, float("-inf"))
        block = tl.dot(pk, kt, acc) * bk[:, None] * tl.exp(diff)
    else:
        block = tl.dot(pk, kt, acc)
    return block


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
def _transform_kernel(k, p, beta, g, A, N, H, K: tl.constexpr, KS: tl.constexpr, GROUP: tl.constexpr = 1,
                      READ_FIRST: tl.constexpr = False):
    """A = (I + L)^-1 of one chunk by 16 x 16 blocks, in fp32: the four diagonal blocks D_i by _inv_unit_lower,
    then the off-diagonal blocks from them by block products (_mm, fp32-accurate); stored in A's dtype (bf16
    for the scans' tensor-core operands, fp32 in the tests). H value heads, GROUP of them a key head. In fla's read
    order (READ_FIRST) L's rows take the read's log-decay gr (`chunk.read_log_decay`)."""
    scal_base, t0, chunk, _ = chunk_offsets(N, H)
    kb, HK = key_head(scal_base, tl.program_id(1), N * BT, H, GROUP)
    kbase = kb * K
    gc0, off, b0 = gates(g, beta, scal_base, t0, H, SUB)
    gc1, off, b1 = gates(g, beta, scal_base, t0 + SUB, H, SUB, off)
    gc2, off, b2 = gates(g, beta, scal_base, t0 + 2 * SUB, H, SUB, off)
    gc3, _, b3 = gates(g, beta, scal_base, t0 + 3 * SUB, H, SUB, off)
    gr0 = read_log_decay(g, scal_base, t0, H, gc0, READ_FIRST, SUB)
    gr1 = read_log_decay(g, scal_base, t0 + SUB, H, gc1, READ_FIRST, SUB)
    gr2 = read_log_decay(g, scal_base, t0 + 2 * SUB, H, gc2, READ_FIRST, SUB)
    gr3 = read_log_decay(g, scal_base, t0 + 3 * SUB, H, gc3, READ_FIRST, SUB)
    # Every block of L first, so that the P and K tiles are dead before the substitutions, by columns, with P on each
    # block's rows and K^T on each block's columns (loaded transposed) each loaded at its first use. A tile goes to its
    # dot operand layout through shared memory; loaded at its first use, it leaves shared memory at once under every
    # supported Triton (8 KB at K = 128), where from 3.7, which moves each read of such a buffer to the tile's first
    # use, tiles loaded up front would sit there together (32 KB: 6 CTAs an SM, not the 8 that registers allow).
    # By slices of KS columns of P and K (`TRANSFORM_SLICE`): one slice up to K = 128, four at K = 256.
    L00, L10, L20, L30, L11, L21, L31, L22, L32, L33 = None, None, None, None, None, None, None, None, None, None
    for ks in tl.static_range(0, K, KS):
        p0 = tl.load(row_ptrs(p, kbase + ks, t0, HK * K, KS, SUB)).to(tl.bfloat16)
        kt = tl.load(row_ptrs_t(k, kbase + ks, t0, HK * K, KS, SUB)).to(tl.bfloat16)
        L00 = _l_block(p0, b0, gr0, kt, gc0, True, L00, ks + KS == K)
        p1 = tl.load(row_ptrs(p, kbase + ks, t0 + SUB, HK * K, KS, SUB)).to(tl.bfloat16)
        L10 = _l_block(p1, b1, gr1, kt, gc0, False, L10, ks + KS == K)
        p2 = tl.load(row_ptrs(p, kbase + ks, t0 + 2 * SUB, HK * K, KS, SUB)).to(tl.bfloat16)
        L20 = _l_block(p2, b2, gr2, kt, gc0, False, L20, ks + KS == K)
        p3 = tl.load(row_ptrs(p, kbase + ks, t0 + 3 * SUB, HK * K, KS, SUB)).to(tl.bfloat16)
        L30 = _l_block(p3, b3, gr3, kt, gc0, False, L30, ks + KS == K)
        kt = tl.load(row_ptrs_t(k, kbase + ks, t0 + SUB, HK * K, KS, SUB)).to(tl.bfloat16)
        L11 = _l_block(p1, b1, gr1, kt, gc1, True, L11, ks + KS == K)
        L21 = _l_block(p2, b2, gr2, kt, gc1, False, L21, ks + KS == K)
        L31 = _l_block(p3, b3, gr3, kt, gc1, False, L31, ks + KS == K)
        kt = tl.load(row_ptrs_t(k, kbase + ks, t0 + 2 * SUB, HK * K, KS, SUB)).to(tl.bfloat16)
        L22 = _l_block(p2, b2, gr2, kt, gc2, True, L22, ks + KS == K)
        L32 = _l_block(p3, b3, gr3, kt, gc2, False, L32, ks + KS == K)
        kt = tl.load(row_ptrs_t(k, kbase + ks, t0 + 3 * SUB, HK * K, KS, SUB)).to(tl.bfloat16)
        L33 = _l_block(p3, b3, gr3, kt, gc3, True, L33, ks + KS == K)
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


def launch(k, p, beta, g, A, read_first: bool = False):
    """A (B * HV, N, 64, 64) of inputs k, p (B, T, H, K) with T a multiple of the chunk, beta and g (B, T, HV), HV a
    multiple of H, in A's dtype; read_first: fla's read order."""
    B, T, HV = beta.shape
    N = T // CHUNK
    order = {"READ_FIRST": True} if read_first else {}
    K = k.shape[-1]
    _transform_kernel[(N, B * HV)](k, p, beta, g, A, N, HV, K, TRANSFORM_SLICE[K], **group(k, beta), **order,
                                   num_warps=TRANSFORM_WARPS, num_stages=1)
