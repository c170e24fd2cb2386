"""dg in Triton, chunk-parallel: the reverse cumsum inside each chunk of the d gc terms that the three gradient parts
(`grads`) leave in fp32 scratch."""

import triton
import triton.language as tl

from ..reference import CHUNK
from .chunk import BT, chunk_offsets, part_stride, rows_args, store_rows


@triton.jit
def _reverse_cumsum(x):
    """dg from d gc: the sum over the chunk's later rows, each row included (gc is an inclusive cumsum)."""
    return tl.sum(x, 0) - tl.cumsum(x, 0) + x


@triton.jit
def _dg_kernel(dgc_parts, dg, N, H, T=None, layout=None, READ_FIRST: tl.constexpr = False,
               PACKED: tl.constexpr = False, MASKED: tl.constexpr = False):
    """dg of one chunk from the three parts' terms of d gc. dgc_parts is (3, B * H, N * BT), so that a chunk's rows
    are contiguous for the loads (in a (B, T, H) tensor they lie H apart). In fla's read order (READ_FIRST) a fourth
    row holds the terms of d gr, gr = gc - g the read's log-decay, already counted in the third row as if gr were gc:
    g_t feeds gr_i for i > t only, so dg takes them off again at t. dg is stored on the chunk's rows as
    `chunk.chunk_rows` finds them (PACKED, MASKED)."""
    scal_base, t0, t_end, _, rows = chunk_offsets(N, T, H, layout, 1, PACKED, MASKED)
    if not MASKED:
        t_end = None
    n_pos = part_stride(N * BT, H)
    dgc = tl.load(dgc_parts + rows) + tl.load(dgc_parts + n_pos + rows) + tl.load(dgc_parts + 2 * n_pos + rows)
    dg_c = _reverse_cumsum(dgc)
    if READ_FIRST:
        dg_c -= tl.load(dgc_parts + 3 * n_pos + rows)
    store_rows(dg + scal_base + (t0 + tl.arange(0, BT)) * H, dg_c, t0, t_end)


def launch(dgc_parts, dg, packing=None):
    """dg (B, T, H) from the gradient parts' terms of d gc (3, BH, N * 64), or (4, BH, N * 64) in fla's read order
    (`_dg_kernel`), on N chunks (T = N * 64, or fewer rows: `transform.launch`; with `packing`, packed sequences)."""
    B, T, H = dg.shape
    N = dgc_parts.shape[2] // CHUNK
    order = {"READ_FIRST": True} if dgc_parts.shape[0] == 4 else {}
    _dg_kernel[(N, B * H)](dgc_parts, dg, N, H, **rows_args(T, N, packing), **order, num_warps=1, num_stages=1)
