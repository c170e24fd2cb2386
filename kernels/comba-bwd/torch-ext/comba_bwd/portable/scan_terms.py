"""The scans' chunk-local terms in Triton, chunk-parallel: from the chunk transform's A, U = A (beta V) and
-W = -A (beta gam P) ([64, V] and [64, K] a chunk) for the forward scan, -W for the reverse scan, and in the backward
dVlocal = (scale lower(Q K^T) * E)^T dO ([64, V]), the part of dVn that does not depend on the state; each in its
scratch's dtype (`pipeline.state_scratch`: U fp32, the others bf16). With them the forward scan's loop is two products
a chunk (Vn = U - W S_n, S_{n+1} = Gam S_n + (K Gam / gam)^T Vn), and the reverse scan takes W^T dVn from -W and
dVn from dVlocal + (K Gam / gam) dS', rather than forming them chunk by chunk on its serial path, where each of a
chunk's V-block programs would form them again. W is stored negated, so that both scans accumulate its products into
their other term in place.

A kernel of its own rather than the transform's epilogue: the transform runs one warp a chunk, its A held as 16 x 16
fp32 blocks across that warp, and [64, K] and [64, V] products (K up to 256, V up to 512) in one warp would take
most of the transform's time and spill; here each term is a program of 4 warps a chunk that reads A (8 KB) again,
and the stage runs wherever a Triton scan does, after either transform (the Gluon one included). The terms are up to
three programs a chunk, next to each other in the grid, each looping over its columns in blocks of TERMS_BLOCK: U's
(only where the Triton forward scan runs), -W's, dVlocal's (only in the backward, where the Triton reverse scan runs;
Q K^T made once a chunk for all of V). W takes the read's decay, exp(gr) in fla's order (READ_FIRST). Where
`dispatch.Plan.local_terms` says so (a plain call at K = 64, one scan program holding all of V) the stage does not
run: the scans form the terms in their loops with the same helpers (`u_term`, `neg_w_term`, `local_scores_t`).

A non-finite input at step t reaches no row of U or W before t, as it reaches none of Vn's: A's rows from the
chunk's first non-finite k, p, beta or g on are NaN (`transform`), which carries those to U's and W's rows; A's
products take the finite part of beta V and beta gam P (`common.finite.finite_part`), and U is NaN from beta V's first
row holding a non-finite entry on (`common.finite.reached`, by blocks of columns: v, the one input A does not see).
dVlocal, a gradient, sums the later rows of dO, as the reverse scan's products do."""

import triton
import triton.language as tl

from ..common.finite import finite_part, reached
from .chunk import (BT, call_rows, chunk_a, chunk_offsets, decay, gates, group, key_head, load_rows, read_log_decay,
                    row_ptrs, row_ptrs_t, rows_args)

# The columns of one product of a term: [64, 64] tiles at every K and V.
TERMS_BLOCK = tl.constexpr(64)
TERMS_WARPS = 4

# The terms, by their part index; a launch runs a contiguous range of them.
U_PART, W_PART, DV_LOCAL_PART = 0, 1, 2


@triton.jit
def u_term(a, v, bk, scal_base, t0, t_end, cv, H, V: tl.constexpr):
    """U = A (beta V) on the columns cv of a chunk (fp32 [64, len(cv)]), from its A and beta; NaN from beta V's first
    row holding a non-finite entry (in those columns) on."""
    r = tl.arange(0, BT)
    vk = load_rows(v + scal_base * V + (t0 + r)[:, None] * (H * V) + cv[None, :], t0, t_end)
    bv, v_edge = finite_part((vk * bk[:, None]).to(tl.bfloat16), BT, False)
    return reached(tl.dot(a, bv), v_edge, BT, False)


@triton.jit
def neg_w_term(a, p, bk, gam, base, t0, t_end, HK, KB: tl.constexpr, TRANSPOSED: tl.constexpr = False):
    """-W = -A (beta gam P) on the KB key columns of p from `base` (`row_ptrs`, HK the row stride), fp32 [64, KB]; with
    TRANSPOSED, -W^T = -(beta gam P)^T A^T [KB, 64] from a = A^T, P loaded transposed (no tl.trans of a dot result:
    `chunk`). P's non-finite rows are NaN rows of A already, so the product takes P's finite part alone."""
    if TRANSPOSED:
        pt = load_rows(row_ptrs_t(p, base, t0, HK, KB), t0, t_end, TRANSPOSED=True)
        bp, _ = finite_part((pt * -(bk * gam)[None, :]).to(tl.bfloat16), BT, False, TRANSPOSED=True)
        return tl.dot(bp, a)
    else:
        pk = load_rows(row_ptrs(p, base, t0, HK, KB), t0, t_end)
        bp, _ = finite_part((pk * -(bk * gam)[:, None]).to(tl.bfloat16), BT, False)
        return tl.dot(a, bp)


@triton.jit
def local_scores_t(kq_t, gc, scale):
    """The operand of dVlocal = (scale lower(Q K^T) * E)^T dO: (K Q^T) * scale * E^T from K Q^T (fp32 [64, 64]),
    rounded to bf16 as the reverse scan's operands are."""
    return (kq_t * scale * decay(gc, True, False)).to(tl.bfloat16)


@triton.jit
def _u_part(v, beta, A, U, scal_base, t0, t_end, chunk, rows, H, V: tl.constexpr):
    """U = A (beta V), stored, by blocks of TERMS_BLOCK columns (`u_term`)."""
    r = tl.arange(0, BT)
    bk = load_rows(beta + scal_base + (t0 + r) * H, t0, t_end).to(tl.float32)
    a = chunk_a(A, chunk)
    for v0 in tl.range(0, V, TERMS_BLOCK):
        cv = v0 + tl.arange(0, TERMS_BLOCK)
        u = u_term(a, v, bk, scal_base, t0, t_end, cv, H, V)
        tl.store(U + rows[:, None] * V + cv[None, :], u.to(U.dtype.element_ty))


@triton.jit
def _w_part(p, beta, g, A, W, scal_base, kb, t0, t_end, chunk, rows, H, HK, K: tl.constexpr,
            READ_FIRST: tl.constexpr):
    """-W = -A (beta gam P), stored, by blocks of TERMS_BLOCK columns (`neg_w_term`), gam the read's decay (exp(gr)
    in fla's order)."""
    gc, _, bk = gates(g, beta, scal_base, t0, H, t_end=t_end)
    gam = tl.exp(read_log_decay(g, scal_base, t0, H, gc, READ_FIRST, t_end=t_end))
    a = chunk_a(A, chunk)
    for k0 in tl.static_range(0, K, TERMS_BLOCK):
        w_neg = neg_w_term(a, p, bk, gam, kb * K + k0, t0, t_end, HK * K, TERMS_BLOCK)
        ck = k0 + tl.arange(0, TERMS_BLOCK)
        tl.store(W + rows[:, None] * K + ck[None, :], w_neg.to(W.dtype.element_ty))


@triton.jit
def _dv_local_part(q, k, beta, g, do, dv_local, scale, scal_base, kb, t0, t_end, rows, H, HK, K: tl.constexpr,
                   V: tl.constexpr):
    """dVlocal = (scale lower(Q K^T) * E)^T dO, stored: its operand made once (`local_scores_t`, K Q^T summed over
    blocks of TERMS_BLOCK keys), then one product a block of V."""
    r = tl.arange(0, BT)
    gc, _, _ = gates(g, beta, scal_base, t0, H, t_end=t_end)
    kq_t = tl.zeros([BT, BT], dtype=tl.float32)
    for k0 in tl.static_range(0, K, TERMS_BLOCK):
        kk = load_rows(row_ptrs(k, kb * K + k0, t0, HK * K, TERMS_BLOCK), t0, t_end).to(tl.bfloat16)
        qt = load_rows(row_ptrs_t(q, kb * K + k0, t0, HK * K, TERMS_BLOCK), t0, t_end, TRANSPOSED=True)
        kq_t = tl.dot(kk, qt.to(tl.bfloat16), kq_t)
    scores_t = local_scores_t(kq_t, gc, scale)
    for v0 in tl.range(0, V, TERMS_BLOCK):
        cv = v0 + tl.arange(0, TERMS_BLOCK)
        dok = load_rows(do + scal_base * V + (t0 + r)[:, None] * (H * V) + cv[None, :], t0, t_end).to(tl.bfloat16)
        tl.store(dv_local + rows[:, None] * V + cv[None, :], tl.dot(scores_t, dok).to(dv_local.dtype.element_ty))


@triton.jit
def _scan_terms_kernel(q, k, v, p, beta, g, do, A, W, U, dv_local, scale, N, H, K: tl.constexpr, V: tl.constexpr,
                       FIRST: tl.constexpr, PARTS: tl.constexpr, T=None, layout=None, GROUP: tl.constexpr = 1,
                       READ_FIRST: tl.constexpr = False, PACKED: tl.constexpr = False, MASKED: tl.constexpr = False):
    """Terms FIRST .. FIRST + PARTS - 1 of one chunk (U_PART, W_PART, DV_LOCAL_PART), PARTS programs a chunk next to
    each other in the grid. H value heads, GROUP of them a key head. The chunk's rows of the inputs as
    `chunk.chunk_rows` finds them (PACKED, MASKED); the terms on whole chunks of the scratch."""
    part = FIRST + tl.program_id(0) % PARTS
    scal_base, t0, t_end, chunk, rows = chunk_offsets(N, T, H, layout, PARTS, PACKED, MASKED)
    if not MASKED:
        t_end = None
    kb, HK = key_head(scal_base, tl.program_id(1), call_rows(T, N, MASKED), H, GROUP)
    if part == 0:
        if FIRST == 0:
            _u_part(v, beta, A, U, scal_base, t0, t_end, chunk, rows, H, V)
    elif part == 1:
        _w_part(p, beta, g, A, W, scal_base, kb, t0, t_end, chunk, rows, H, HK, K, READ_FIRST)
    else:
        if FIRST + PARTS == 3:
            _dv_local_part(q, k, beta, g, do, dv_local, scale, scal_base, kb, t0, t_end, rows, H, HK, K, V)


def launch(k, v, p, beta, g, A, W, U=None, read_first: bool = False, packing=None, q=None, do=None, dv_local=None,
           scale: float = 1.0):
    """-W (B * HV, N * 64, K) and, where given, U and dv_local (B * HV, N * 64, V) on the N chunks of A, from the
    inputs k, p (B, T, H, K), v (B, T, HV, V), beta and g (B, T, HV) with HV a multiple of H, and their transform A
    (T = N * 64, or fewer rows: `transform.launch`; with `packing`, packed sequences); dv_local from q (B, T, H, K),
    do (B, T, HV, V) and the output's scale. read_first: fla's read order."""
    B, T, HV, V = v.shape
    K = k.shape[-1]
    N = A.shape[1]
    first = U_PART if U is not None else W_PART
    last = DV_LOCAL_PART if dv_local is not None else W_PART
    order = {"READ_FIRST": True} if read_first else {}
    parts = last - first + 1
    _scan_terms_kernel[(parts * N, B * HV)](q, k, v, p, beta, g, do, A, W, U, dv_local, scale, N, HV, K=K, V=V,
                                            FIRST=first, PARTS=parts, **rows_args(T, N, packing), **group(k, v),
                                            **order, num_warps=TERMS_WARPS, num_stages=1)
