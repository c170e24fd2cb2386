"""The chunk transform in Gluon: A = (I + L)^-1 of each chunk, as `portable.transform._transform_kernel` computes it
(one warp a chunk, 16 x 16 blocks, the diagonal blocks' inverses as (I - L)(I + L^2)(I + L^4)(I + L^8) and the
off-diagonal blocks from them, every product fp32-accurate by three TF32 products), with no data moved between threads.

The Triton kernel converts each product's result from the MMA accumulator layout to an operand layout before the next
product, and those shuffles and selects are nearly half of its instructions. Here no operand is converted; it is
relabelled. A thread holds columns 2b and 2b + 1 of each 8 of an accumulator, where the TF32 A operand wants columns b
and b + 4 of each 8: so an accumulator X is taken, as it lies in registers, for the A operand X P^T, with P the
permutation that takes each 8 columns 2b + c to 4c + b, and an accumulator Z for the B operand P Z^T, whence
(X P^T)(P Z^T) = X Z^T. Every product is thus `mm(x, z, acc) = acc + x z^T` of two accumulators, and the kernel keeps
each block in the orientation its products take it in: a block needed both ways is computed both ways (X Z^T and Z X^T
are products of the same two accumulators). Fifty products where the Triton kernel makes forty, but fewer instructions
a chunk.

A non-finite input at step t reaches no row of A before t, as in `portable.transform`: a chunk holding a non-finite k, p
or beta, or a NaN or +inf g, is solved a second time over the first solve's A, with L's non-finite entries zeroed as the
Triton kernel zeroes them (a masked weight of 0 times a non-finite entry would reach the earlier rows through the
products) and A's rows from that step on stored NaN. Whether to is read from the chunk's checksum, the sum of the four
diagonal blocks' inverses, which every non-finite k, p or beta of their rows reaches, and a NaN or +inf g through block
0's beta. On a clean chunk the guard is that sum and a branch. The kernel compiles without FMA contraction
(`enable_fp_fusion=False`): the guarded solve's zeroing selects sit between products and the sums that take them, where
a contraction would round the first solve's rows differently, so the rows of A before the bad step are the clean
inputs' bit for bit.

The kernel is written for K = 64, where it is faster than the Triton kernel (A within its bf16 rounding of the Triton
one's); at K = 128 it spills and is slower, and K = 128 keeps the Triton kernel. L's blocks are made up front, not
where they are used, to keep a margin of registers; the blocks are made in the order that lets the four diagonal
chains overlap, which costs occupancy (no spill, 8 CTAs an SM) but is faster than an order that keeps fewer live.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from .chunk import BT, FLOOR, finite_or_zero, scal_base
from ..reference import CHUNK
from ..common.tf32 import tf32_high

SUB = gl.constexpr(16)  # the blocks: 4 x 4 of them a chunk
MMA = gl.constexpr(gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8]))
ROW = gl.constexpr(gl.SliceLayout(1, MMA.value))
COL = gl.constexpr(gl.SliceLayout(0, MMA.value))
TF32_A = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=MMA.value, k_width=1))
TF32_B = gl.constexpr(gl.DotOperandLayout(operand_index=1, parent=MMA.value, k_width=1))
BF16_A = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=MMA.value, k_width=2))
BF16_B = gl.constexpr(gl.DotOperandLayout(operand_index=1, parent=MMA.value, k_width=2))


@gluon.jit
def _relabel(x):
    """x [16, 16] with the columns of each 8 taken from 2b + c to 4c + b (no data moves)."""
    return gl.reshape(gl.permute(gl.reshape(x, [SUB, 2, 4, 2]), [0, 1, 3, 2]), [SUB, SUB])


@gluon.jit
def _tf32_dot(x, z, acc):
    """acc + (x P^T)(P z^T), one TF32 product of two accumulators taken as its operands where they lie."""
    a = gl.convert_layout(_relabel(x), TF32_A, assert_trivial=True)
    b = gl.convert_layout(gl.permute(_relabel(z), [1, 0]), TF32_B, assert_trivial=True)
    return mma_v2(a, b, acc, input_precision="tf32")


@gluon.jit
def mm(x, z, acc):
    """acc + x z^T in fp32 (x, z, acc [16, 16] accumulators) by three TF32 products, as `portable.transform._mm`."""
    x_hi = tf32_high(x)
    z_hi = tf32_high(z)
    acc = _tf32_dot(x - x_hi, z_hi, acc)
    acc = _tf32_dot(x_hi, z - z_hi, acc)
    return _tf32_dot(x_hi, z_hi, acc)


@gluon.jit
def _block_gates(g, beta, base, r0, H, offset):
    """Of the 16 rows from r0: gc (offset plus the inclusive cumsum of g) in the row and in the column slice, beta in
    the row slice, offset plus the block's sum of g (the next block's offset), and g's checksum in the column slice:
    NaN or +inf where g is NaN or +inf, 0 elsewhere (g = -inf is a reset)."""
    r = gl.arange(0, SUB, layout=ROW)
    c = gl.arange(0, SUB, layout=COL)
    g_raw = gl.load(g + base + (r0 + c) * H)
    g_c = gl.maximum(g_raw, FLOOR)
    gc_r = offset + gl.sum(gl.where(c[None, :] <= r[:, None], g_c[None, :], 0.0), 1)
    beta_r = gl.load(beta + base + (r0 + r) * H).to(gl.float32)
    g_check = gl.where(g_raw < float("inf"), 0.0, g_raw)  # NaN fails the test
    return gc_r, gl.convert_layout(gc_r, COL), beta_r, offset + gl.sum(g_c, 0), g_check


@gluon.jit
def _block_edge(pk, beta_r, g_check, i: gl.constexpr):
    """The chunk's first row in block i holding a non-finite k, p or beta, or a NaN or +inf g, BT if none (so that a
    clean block leaves the chunk's edge where the other blocks put it), from the diagonal block P_i K_i^T (whose entry
    (r, r) is p_r . k_r), beta and g's checksum (`_block_gates`), as `portable.transform` finds that row."""
    r = gl.arange(0, SUB, layout=ROW)
    c = gl.arange(0, SUB, layout=COL)
    diag_ok = gl.min(((gl.abs(pk) < float("inf")) | (r[:, None] != c[None, :])).to(gl.int32), 1)
    row_ok = (diag_ok > 0) & (gl.abs(beta_r) < float("inf"))
    first_row = gl.min(gl.where(row_ok, BT, r + i * SUB), 0)
    return gl.minimum(first_row, gl.min(gl.where(g_check == 0.0, BT, c + i * SUB), 0))


@gluon.jit
def _p_tile(p, kbase, r0, HK, K: gl.constexpr):
    """P on the 16 rows from r0 as a bf16 A operand [16, K]."""
    r = gl.arange(0, SUB, layout=gl.SliceLayout(1, BF16_A))
    f = gl.arange(0, K, layout=gl.SliceLayout(0, BF16_A))
    return gl.load(p + kbase + (r0 + r)[:, None] * HK + f[None, :]).to(gl.bfloat16)


@gluon.jit
def _kt_tile(k, kbase, r0, HK, K: gl.constexpr):
    """K^T on the 16 rows from r0 as a bf16 B operand [K, 16]."""
    f = gl.arange(0, K, layout=gl.SliceLayout(1, BF16_B))
    r = gl.arange(0, SUB, layout=gl.SliceLayout(0, BF16_B))
    return gl.load(k + kbase + (r0 + r)[None, :] * HK + f[:, None]).to(gl.bfloat16)


@gluon.jit
def _kp(p_i, kt_i, acc):
    """acc + K_i P_i^T, from the same two tiles: a bf16 A operand transposed lies as the B operand, and back."""
    k_i = gl.convert_layout(gl.permute(kt_i, [1, 0]), BF16_A, assert_trivial=True)
    pt_i = gl.convert_layout(gl.permute(p_i, [1, 0]), BF16_B, assert_trivial=True)
    return mma_v2(k_i, pt_i, acc)


@gluon.jit
def _decayed(pk, beta_r, gc_r, gc_c, DIAGONAL: gl.constexpr, GUARDED: gl.constexpr):
    """Block (i, j) of L from P_i K_j^T: beta on its rows, E = exp(gc_i - gc_j), strictly lower if DIAGONAL; GUARDED,
    its non-finite entries zeroed."""
    diff = gc_r[:, None] - gc_c[None, :]
    if DIAGONAL:
        r = gl.arange(0, SUB, layout=ROW)
        c = gl.arange(0, SUB, layout=COL)
        diff = gl.where(r[:, None] > c[None, :], diff, float("-inf"))
    block = pk * beta_r[:, None] * gl.exp(diff)
    if GUARDED:
        block = finite_or_zero(block)
    return block


@gluon.jit
def _decayed_t(kp, beta_c, gc_r, gc_c, GUARDED: gl.constexpr):
    """The diagonal block of L transposed, from K_i P_i^T: beta on its columns, E^T, strictly upper; GUARDED, its
    non-finite entries zeroed."""
    r = gl.arange(0, SUB, layout=ROW)
    c = gl.arange(0, SUB, layout=COL)
    upper = c[None, :] > r[:, None]
    block = kp * beta_c[None, :] * gl.exp(gl.where(upper, gc_c[None, :] - gc_r[:, None], float("-inf")))
    if GUARDED:
        block = finite_or_zero(block)
    return block


@gluon.jit
def _with_unit_diagonal(x):
    """I + x for x with a zero diagonal."""
    r = gl.arange(0, SUB, layout=ROW)
    c = gl.arange(0, SUB, layout=COL)
    return gl.where(r[:, None] == c[None, :], 1.0, x)


@gluon.jit
def _inverse_chain(lo, lo_t):
    """For the diagonal block L (lo) and L^T (lo_t): (D_b, L^8 transposed), where D_b = (I - L)(I + L^2)(I + L^4) and
    (I + L)^-1 = D_b (I + L^8) (`_inverse`, `_inverse_t`)."""
    zero = gl.zeros([SUB, SUB], gl.float32, MMA)
    l2 = mm(lo, lo_t, zero)
    l2_t = mm(lo_t, lo, zero)
    l4 = mm(l2, l2_t, zero)
    l4_t = mm(l2_t, l2, zero)
    i_minus_l = _with_unit_diagonal(-lo)
    d = mm(i_minus_l, l2_t, i_minus_l)         # (I - L)(I + L^2)
    d = mm(d, l4_t, d)                         # ... (I + L^4)
    return d, mm(l4_t, l4, zero)


@gluon.jit
def _inverse(d_b, l8_t):
    """(I + L)^-1 = D_b (I + L^8)."""
    return mm(d_b, l8_t, d_b)


@gluon.jit
def _inverse_t(d_b, l8_t):
    """((I + L)^-1)^T = (I + (L^8)^T) D_b^T."""
    return mm(_with_unit_diagonal(l8_t), d_b, gl.zeros([SUB, SUB], gl.float32, MMA))


@gluon.jit
def _store_block(A, a_base, i: gl.constexpr, j: gl.constexpr, blk, edge, TRANSPOSED: gl.constexpr = False):
    """Block (i, j) of the chunk's A; blk holds it, or its transpose where TRANSPOSED; with an `edge` (not None), NaN on
    the chunk's rows from edge on."""
    r = gl.arange(0, SUB, layout=ROW)
    c = gl.arange(0, SUB, layout=COL)
    if TRANSPOSED:
        rows = c[None, :] + i * SUB
        offs = rows * BT + (r[:, None] + j * SUB)
    else:
        rows = r[:, None] + i * SUB
        offs = rows * BT + (c[None, :] + j * SUB)
    if edge is not None:
        blk = gl.where(rows >= edge, float("nan"), blk)
    gl.store(A + a_base + offs, blk.to(A.dtype.element_ty))


@gluon.jit
def _transform_chunk(k, p, beta, g, A, N, H, K: gl.constexpr, GUARDED: gl.constexpr):
    """Solve this program's chunk and store its A. Returns the chunk's checksum, finite unless the chunk holds a
    non-finite k, p or beta or a NaN or +inf g; GUARDED (a chunk whose checksum is not), the solve zeroes L's non-finite
    entries and stores A NaN from the chunk's first such step on (`_block_edge`), and returns 0."""
    n, bh = gl.program_id(0), gl.program_id(1)
    base = scal_base(bh // H, bh % H, N, H)
    t0 = n * BT
    kbase = base * K
    HK = H * K
    gc0_r, gc0_c, b0, off, g_check = _block_gates(g, beta, base, t0, H, 0.0)
    gc1_r, gc1_c, b1, off, g_check1 = _block_gates(g, beta, base, t0 + SUB, H, off)
    gc2_r, gc2_c, b2, off, g_check2 = _block_gates(g, beta, base, t0 + 2 * SUB, H, off)
    gc3_r, gc3_c, b3, off, g_check3 = _block_gates(g, beta, base, t0 + 3 * SUB, H, off)
    if not GUARDED:
        # A NaN or +inf g makes block 0's beta, so the chunk's checksum, non-finite (an exact no-op otherwise).
        b0 += gl.sum(g_check + g_check1 + g_check2 + g_check3, 0)

    # P_i K_j^T for the ten blocks on or below the diagonal, and K_i P_i^T for the diagonal's transposes; K_j^T is
    # loaded for its column of blocks, so that only one is live with the four P_i.
    zero = gl.zeros([SUB, SUB], gl.float32, MMA)
    p0 = _p_tile(p, kbase, t0, HK, K)
    p1 = _p_tile(p, kbase, t0 + SUB, HK, K)
    p2 = _p_tile(p, kbase, t0 + 2 * SUB, HK, K)
    p3 = _p_tile(p, kbase, t0 + 3 * SUB, HK, K)
    kt = _kt_tile(k, kbase, t0, HK, K)
    pk00, pk10, pk20, pk30 = mma_v2(p0, kt, zero), mma_v2(p1, kt, zero), mma_v2(p2, kt, zero), mma_v2(p3, kt, zero)
    kp00 = _kp(p0, kt, zero)
    kt = _kt_tile(k, kbase, t0 + SUB, HK, K)
    pk11, pk21, pk31 = mma_v2(p1, kt, zero), mma_v2(p2, kt, zero), mma_v2(p3, kt, zero)
    kp11 = _kp(p1, kt, zero)
    kt = _kt_tile(k, kbase, t0 + 2 * SUB, HK, K)
    pk22, pk32 = mma_v2(p2, kt, zero), mma_v2(p3, kt, zero)
    kp22 = _kp(p2, kt, zero)
    kt = _kt_tile(k, kbase, t0 + 3 * SUB, HK, K)
    pk33 = mma_v2(p3, kt, zero)
    kp33 = _kp(p3, kt, zero)
    if GUARDED:
        edge = gl.minimum(gl.minimum(_block_edge(pk00, b0, g_check, 0), _block_edge(pk11, b1, g_check1, 1)),
                          gl.minimum(_block_edge(pk22, b2, g_check2, 2), _block_edge(pk33, b3, g_check3, 3)))
    else:
        edge = None

    # The diagonal blocks' inverses D_i, in the orientations the products below take them in.
    db, l8_t = _inverse_chain(_decayed(pk00, b0, gc0_r, gc0_c, True, GUARDED),
                              _decayed_t(kp00, gl.convert_layout(b0, COL), gc0_r, gc0_c, GUARDED))
    d0_t = _inverse_t(db, l8_t)
    db, l8_t = _inverse_chain(_decayed(pk11, b1, gc1_r, gc1_c, True, GUARDED),
                              _decayed_t(kp11, gl.convert_layout(b1, COL), gc1_r, gc1_c, GUARDED))
    d1 = _inverse(db, l8_t)
    d1_t = _inverse_t(db, l8_t)
    db, l8_t = _inverse_chain(_decayed(pk22, b2, gc2_r, gc2_c, True, GUARDED),
                              _decayed_t(kp22, gl.convert_layout(b2, COL), gc2_r, gc2_c, GUARDED))
    d2 = _inverse(db, l8_t)
    d2_t = _inverse_t(db, l8_t)
    db, l8_t = _inverse_chain(_decayed(pk33, b3, gc3_r, gc3_c, True, GUARDED),
                              _decayed_t(kp33, gl.convert_layout(b3, COL), gc3_r, gc3_c, GUARDED))
    d3 = _inverse(db, l8_t)

    # The off-diagonal blocks, as the Triton kernel assembles them, from -L's blocks (beta negated), so that no product
    # needs negating: A10 = D1 (-L10) D0, A32 = D3 (-L32) D2, -M = (-L) D + (-L) A10 on the lower-left 32 x 32, then
    # A2j = D2 (-M0j), A3j = A32 (-M0j) + D3 (-M1j), the Ms and A10 taken transposed.
    ln10 = _decayed(pk10, -b1, gc1_r, gc0_c, False, GUARDED)
    ln20 = _decayed(pk20, -b2, gc2_r, gc0_c, False, GUARDED)
    ln30 = _decayed(pk30, -b3, gc3_r, gc0_c, False, GUARDED)
    ln21 = _decayed(pk21, -b2, gc2_r, gc1_c, False, GUARDED)
    ln31 = _decayed(pk31, -b3, gc3_r, gc1_c, False, GUARDED)
    ln32 = _decayed(pk32, -b3, gc3_r, gc2_c, False, GUARDED)
    a10_t = mm(mm(d0_t, ln10, zero), d1, zero)
    a32 = mm(d3, mm(d2_t, ln32, zero), zero)
    nm00_t = mm(a10_t, ln21, mm(d0_t, ln20, zero))
    nm01_t = mm(d1_t, ln21, zero)
    nm10_t = mm(a10_t, ln31, mm(d0_t, ln30, zero))
    nm11_t = mm(d1_t, ln31, zero)

    a_base = (bh.to(gl.int64) * N + n) * BT * BT
    _store_block(A, a_base, 0, 0, d0_t, edge, True)
    _store_block(A, a_base, 1, 0, a10_t, edge, True)
    _store_block(A, a_base, 1, 1, d1, edge)
    _store_block(A, a_base, 2, 0, mm(d2, nm00_t, zero), edge)
    _store_block(A, a_base, 2, 1, mm(d2, nm01_t, zero), edge)
    _store_block(A, a_base, 2, 2, d2, edge)
    _store_block(A, a_base, 3, 0, mm(d3, nm10_t, mm(a32, nm00_t, zero)), edge)
    _store_block(A, a_base, 3, 1, mm(d3, nm11_t, mm(a32, nm01_t, zero)), edge)
    _store_block(A, a_base, 3, 2, a32, edge)
    _store_block(A, a_base, 3, 3, d3, edge)
    for i in gl.static_range(3):
        for j in gl.static_range(i + 1, 4):
            _store_block(A, a_base, i, j, zero, edge)
    if GUARDED:
        checksum = 0.0
    else:
        checksum = gl.sum(gl.sum(d0_t + d1 + d2 + d3, 1), 0)
    return checksum


# Not inlined: inlined, the compiler would keep values of the first solve (addresses, tiles) for the second, and the
# kernel would spill.
@gluon.jit(noinline=True)
def _guarded_solve(k, p, beta, g, A, N, H, K: gl.constexpr):
    """The chunk's A solved again, guarded (`_transform_chunk`), each entry stored by the thread that stored it in the
    first solve, so after it."""
    _transform_chunk(k, p, beta, g, A, N, H, K, True)


@gluon.jit
def _transform_gluon_kernel(k, p, beta, g, A, N, H, K: gl.constexpr):
    checksum = _transform_chunk(k, p, beta, g, A, N, H, K, False)
    if not (gl.abs(checksum) < float("inf")):
        # The chunk holds a non-finite input.
        _guarded_solve(k, p, beta, g, A, N, H, K)


def launch(k, p, beta, g, A):
    """A (BH, N, 64, 64) of inputs k, p (B, T, H, 64) with T a multiple of the chunk, beta and g (B, T, H), in A's
    dtype, as `portable.transform._transform_kernel`."""
    B, T, H, K = k.shape
    _transform_gluon_kernel[(T // CHUNK, B * H)](k, p, beta, g, A, T // CHUNK, H, K, num_warps=1,
                                                 enable_fp_fusion=False)
