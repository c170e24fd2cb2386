"""The chunk transform's adjoint in Triton, chunk-parallel: per (b, h, chunk), X = A^T dVn (bf16 -> HBM) from the dVn
the reverse scan leaves in HBM, with dv = beta X and dbeta's v part sum_v(v X) (fp32, one part, `chunk.part_rows`)
where the gradient kernel does not make them. X is off the reverse scan's carried chain (dS needs -W^T dVn, not X),
and made in the scan it would cost each V-block program a product a chunk and A's and v's tiles in its pipeline
(shared memory for 2 CTAs an SM at K <= 128); made here it costs dVn's round trip through HBM ([64, V] bf16 a chunk,
written by the scan in place of X) and A read once a chunk for all of V. One program a chunk loops over V in blocks of
ADJOINT_BLOCK, so dbeta's v part is summed over all of V in registers. Where `dispatch.Plan.local_terms` says so (a
plain call at K = 64, one reverse-scan program holding all of V, the terms formed in its loop) the stage does not run:
the reverse scan makes the same with `chunk_adjoint` from the dVn in its registers.

A^T dW = -X S^T and dL = -strict_lower(X Vn^T) follow from X (`grads`): the adjoint takes this one transposed solve,
no second solve and no A^T dA A^T product."""

import triton
import triton.language as tl

from .chunk import BT, chunk_a, chunk_offsets, load_rows, part_rows, rows_args, store_rows

ADJOINT_BLOCK = tl.constexpr(64)
ADJOINT_WARPS = 4


@triton.jit
def chunk_adjoint(a_t, dvn, bk, v, X, dv, scal_base, t0, t_end, rows, cv, H, V: tl.constexpr,
                  V_ADJOINT: tl.constexpr):
    """On the columns cv of one chunk, from A^T and dVn (bf16): X = A^T dVn, stored at the chunk's rows `rows` of the
    scratch, and where V_ADJOINT dv = beta X, stored at its rows of the call's dv (`chunk.chunk_rows`); returns
    sum_v(v X) over those columns (fp32 [64], zeros where not V_ADJOINT)."""
    r = tl.arange(0, BT)
    x = tl.dot(a_t, dvn)
    tl.store(X + rows[:, None] * V + cv[None, :], x.to(X.dtype.element_ty))
    v_x = tl.zeros([BT], dtype=tl.float32)
    if V_ADJOINT:
        vk = load_rows(v + scal_base * V + (t0 + r)[:, None] * (H * V) + cv[None, :], t0, t_end).to(tl.float32)
        store_rows(dv + scal_base * V + (t0 + r)[:, None] * (H * V) + cv[None, :],
                   (bk[:, None] * x).to(dv.dtype.element_ty), t0, t_end)
        v_x = tl.sum(vk * x, 1)
    return v_x


@triton.jit
def _adjoint_kernel(v, beta, A, dVn, X, dv, dbeta_v, N, H, V: tl.constexpr, V_ADJOINT: tl.constexpr, T=None,
                    layout=None, PACKED: tl.constexpr = False, MASKED: tl.constexpr = False):
    """X = A^T dVn of one chunk and, where V_ADJOINT, dv = beta X and sum_v(v X) (`chunk_adjoint`, by blocks of
    ADJOINT_BLOCK columns). The chunk's rows of v, beta and dv as `chunk.chunk_rows` finds them (PACKED, MASKED); dVn
    and X on whole chunks of the scratch."""
    scal_base, t0, t_end, chunk, rows = chunk_offsets(N, T, H, layout, 1, PACKED, MASKED)
    if not MASKED:
        t_end = None
    r = tl.arange(0, BT)
    a_t = chunk_a(A, chunk, TRANSPOSED=True)
    bk = load_rows(beta + scal_base + (t0 + r) * H, t0, t_end).to(tl.float32)
    v_x = tl.zeros([BT], dtype=tl.float32)
    for v0 in tl.range(0, V, ADJOINT_BLOCK):
        cv = v0 + tl.arange(0, ADJOINT_BLOCK)
        v_x += chunk_adjoint(a_t, tl.load(dVn + rows[:, None] * V + cv[None, :]), bk, v, X, dv, scal_base, t0, t_end,
                             rows, cv, H, V, V_ADJOINT)
    if V_ADJOINT:
        tl.store(dbeta_v + part_rows(scal_base + (t0 + r) * H, rows, MASKED), v_x)


def launch(v, beta, A, dVn, X, dv, dbeta_v, v_adjoint: bool, packing=None):
    """X (B * HV, N * 64, V) from dVn (same shape) and A (B * HV, N, 64, 64) on N chunks and, where v_adjoint, dv like
    v (B, T, HV, V) and dbeta's v part dbeta_v (1, B, N * 64, HV) (`chunk.part_rows`), of inputs v and beta (B, T, HV)
    (T = N * 64, or fewer rows: `transform.launch`; with `packing`, packed sequences)."""
    B, T, HV, V = v.shape
    N = A.shape[1]
    _adjoint_kernel[(N, B * HV)](v, beta, A, dVn, X, dv, dbeta_v, N, HV, V=V, V_ADJOINT=v_adjoint,
                                 **rows_args(T, N, packing), num_warps=ADJOINT_WARPS, num_stages=1)
