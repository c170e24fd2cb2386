"""dg in Triton, chunk-parallel: the reverse cumsum inside each chunk of the d gc terms that the three gradient parts
(`grads`) leave in fp32 scratch."""

import triton
import triton.language as tl

from ..reference import CHUNK
from .chunk import BT, chunk_offsets, part_stride


@triton.jit
def _reverse_cumsum(x):
    """dg from d gc: the sum over the chunk's later rows, each row included (gc is an inclusive cumsum)."""
    return tl.sum(x, 0) - tl.cumsum(x, 0) + x


@triton.jit
def _dg_kernel(dgc_parts, dg, N, H, READ_FIRST: tl.constexpr = False):
    """dg of one chunk from the three parts' terms of d gc. dgc_parts is (3, B * H, T), so that a chunk's rows
    are contiguous for the loads (in a (B, T, H) tensor they lie H apart). In fla's read order (READ_FIRST) a fourth
    row holds the terms of d gr, gr = gc - g the read's log-decay, already counted in the third row as if gr were gc:
    g_t feeds gr_i for i > t only, so dg takes them off again at t."""
    scal_base, t0, _, rows = chunk_offsets(N, H)
    n_pos = part_stride(N * BT, H)
    dgc = tl.load(dgc_parts + rows) + tl.load(dgc_parts + n_pos + rows) + tl.load(dgc_parts + 2 * n_pos + rows)
    dg_c = _reverse_cumsum(dgc)
    if READ_FIRST:
        dg_c -= tl.load(dgc_parts + 3 * n_pos + rows)
    tl.store(dg + scal_base + (t0 + tl.arange(0, BT)) * H, dg_c)


def launch(dgc_parts, dg):
    """dg (B, T, H), T a multiple of the chunk, from the gradient parts' terms of d gc (3, BH, T), or (4, BH, T) in
    fla's read order (`_dg_kernel`)."""
    B, T, H = dg.shape
    N = T // CHUNK
    order = {"READ_FIRST": True} if dgc_parts.shape[0] == 4 else {}
    _dg_kernel[(N, B * H)](dgc_parts, dg, N, H, **order, num_warps=1, num_stages=1)
