"""The chunk transform's adjoint in Triton, chunk-parallel: per (b, h, chunk), X = A^T dVn (bf16 -> HBM) from the dVn
the reverse scan leaves in HBM, with dv = beta X and dbeta's v part sum_v(v X) (fp32, one part, `chunk.part_rows`)
where the gradient kernel does not make them. X is off the reverse scan's carried chain (dS needs -W^T dVn, not X),
and made in the scan it would cost each V-block program a product a chunk and A's and v's tiles in its pipeline
(shared memory for 2 CTAs an SM at K <= 128); made here it costs dVn's round trip through HBM ([64, V] bf16 a chunk,
written by the scan in place of X) and A read once a chunk for all of V. One program a chunk loops over V in blocks of
ADJOINT_BLOCK, so dbeta's v part is summed over all of V in registers.

A^T dW = -X S^T and dL = -strict_lower(X Vn^T) follow from X (`grads`): the adjoint takes this one transposed solve,
no second solve and no A^T dA A^T product."""

import triton
import triton.language as tl

from .chunk import BT, chunk_offsets, load_rows, part_rows, rows_args, store_rows

ADJOINT_BLOCK = tl.constexpr(64)
ADJOINT_WARPS = 4


@triton.jit
def _adjoint_kernel(v, beta, A, dVn, X, dv, dbeta_v, N, H, V: tl.constexpr, V_ADJOINT: tl.constexpr, T=None,
                    layout=None, PACKED: tl.constexpr = False, MASKED: tl.constexpr = False):
    """X = A^T dVn of one chunk and, where V_ADJOINT, dv = beta X and sum_v(v X). The chunk's rows of v, beta and dv
    as `chunk.chunk_rows` finds them (PACKED, MASKED); dVn and X on whole chunks of the scratch."""
    scal_base, t0, t_end, chunk, rows = chunk_offsets(N, T, H, layout, 1, PACKED, MASKED)
    if not MASKED:
        t_end = None
    r = tl.arange(0, BT)
    a_t = tl.load(A + chunk * BT * BT + r[None, :] * BT + r[:, None])              # A^T
    bk = load_rows(beta + scal_base + (t0 + r) * H, t0, t_end).to(tl.float32)
    v_x = tl.zeros([BT], dtype=tl.float32)
    for v0 in tl.range(0, V, ADJOINT_BLOCK):
        cv = v0 + tl.arange(0, ADJOINT_BLOCK)
        x = tl.dot(a_t, tl.load(dVn + rows[:, None] * V + cv[None, :]))
        tl.store(X + rows[:, None] * V + cv[None, :], x.to(X.dtype.element_ty))
        if V_ADJOINT:
            vk = load_rows(v + scal_base * V + (t0 + r)[:, None] * (H * V) + cv[None, :], t0, t_end).to(tl.float32)
            store_rows(dv + scal_base * V + (t0 + r)[:, None] * (H * V) + cv[None, :],
                       (bk[:, None] * x).to(dv.dtype.element_ty), t0, t_end)
            v_x += tl.sum(vk * x, 1)
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
