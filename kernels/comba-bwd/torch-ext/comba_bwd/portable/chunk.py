"""What the Triton kernels of the forward and the backward share: the chunk, the rows of a chunk in the call's tensors,
the gates of a chunk, its decay, the pointers to its rows, the offsets of a chunk-parallel program, and the scans' V
blocks and pipeline depth.

The kernels run over a layout of whole chunks of 64 rows, chunk n of value head bh at rows bh * N * 64 + n * 64 of the
scratch they share (A, U, -W, dVlocal, S_n, Vn, dS'_n, dVn, X, dbeta's v part, d gc's terms). Chunk n reads its rows
of the call's inputs (q, k, v, p, beta, g, dO) and writes its rows of the outputs (o, dq, dk, dv, dp, dbeta, dg) where
they are (`chunk_rows`): rows t0 = n * 64 on of a (B, T, H, ...) tensor; where T is not a multiple of the chunk
(MASKED), the rows of the last chunk from T on are read as zeros and not written; for sequences packed in a batch of
one (PACKED), each sequence's chunks start at its first row and its last chunk ends with it (`Packing`'s table in
`pipeline`). Zero q, k, v, p, beta and g leave the state as it is, so the rows read as zeros are the padding of whole
chunks: the kernels compute on them what they would on zero-padded inputs, and each packed sequence has its chunks and
its scan alone.

Notation as in reference.py: per (b, h) and chunk n, gc the inclusive cumsum of g inside the chunk, gam = exp(gc),
Gam = exp(gc[-1]), E_ij = exp(gc_i - gc_j) (j <= i). In fla's read order (READ_FIRST: the state read before the
step's decay) the read's log-decay is gr = gc - g, the exclusive cumsum: the chunk transform's L and W take
exp(gr_i - gc_j) (j < i) and exp(gr) where the spec's order takes E and gam, each formed from a difference before
exp, so every factor stays <= 1 (never as p exp(-g), which overflows at strong decay); everything else is the same.

No tl.trans of a dot result (Triton 3.6 Hopper miscompile, fla #640): every transposed operand of these kernels is
either loaded transposed from memory or is an elementwise product of loaded data.
"""

import torch
import triton
import triton.language as tl

from ..common.devices import gpu
from ..reference import CHUNK, G_FLOOR

BT = tl.constexpr(CHUNK)
FLOOR = tl.constexpr(G_FLOOR)  # the log-decay floor of reference.G_FLOOR: -inf is a hard reset

# The scans cut V across their programs in blocks of SCAN_BLOCK[K] columns (at most V), so that a program's
# (K, block) state has 128 x 64 entries at K = 64 and 128. At K = 64 one program then takes all of V = 128 and loads
# the chunk's k, and W or q, once instead of twice, which is faster; blocks of 32 at K = 128 (twice the programs)
# are slower than 64. At K = 256 the blocks stay 64 wide: Triton 3.6 miscompiles both scans on sm_90 with blocks of
# 16 or 32 there (wrong outputs, out-of-range shared-memory reads under compute-sanitizer).
SCAN_BLOCK = {64: 128, 128: 64, 256: 64}
SCAN_WARPS = 4

# What the pipelined scans need by K: the shared memory of a block (the reverse scan's, the larger), and the one GPU
# generation they run on where that is not every one (None). 113 KB at K = 128 (105 KB at 64), more than a block may
# have on sm_86 / sm_89 / sm_120 (99 KB); 193 KB at K = 256, more than sm_80's 163 KB too, and there on Hopper alone,
# where the GPU suite verified them: on sm_100 Triton 3.9 lays them out in more than its blocks' 227 KB. Elsewhere the
# scans run unpipelined (STAGES = 1).
PIPELINED_SCANS = {64: (116 * 1024, None), 128: (116 * 1024, None), 256: (193 * 1024, 9)}


def group(keys: torch.Tensor, values: torch.Tensor) -> dict:
    """The launch argument of grouped value heads: {"GROUP": HV // H} for keys (B, T, H, ...) and values
    (B, T, HV, ...) with HV > H, else none (the kernels' default, one value head a key head)."""
    H, HV = keys.shape[2], values.shape[2]
    return {"GROUP": HV // H} if HV != H else {}


def scan_block(K: int, V: int) -> int:
    """The V columns of one scan program (`SCAN_BLOCK`)."""
    return min(V, SCAN_BLOCK[K])


def scan_stages(device: torch.device, K: int) -> int:
    """How deep the scans pipeline their chunk loop at K on `device`: 2 where the GPU has what PIPELINED_SCANS[K]
    asks, else 1 (meta tensors: the GPU they stand for, `devices.meta_gpu`)."""
    if device.type not in ("cuda", "meta"):
        return 2  # the interpreter
    target = gpu(device)
    shared, major = PIPELINED_SCANS[K]
    return 2 if target.shared_per_cta >= shared and major in (None, target.capability[0]) else 1


def rows_args(T: int, N: int, packing=None) -> dict:
    """The launch arguments of the rows that the chunk-parallel kernels and the scans read and write (`chunk_rows`),
    for the call's tensors of T rows on N chunks: packed sequences' (PACKED, their `layout`) where `packing`
    (`pipeline.Packing`) is given, else MASKED where T is not N whole chunks, none where it is."""
    if packing is not None:
        return {"T": T, "layout": packing.layout, "PACKED": True, "MASKED": True}
    return {"T": T, "MASKED": True} if T != N * CHUNK else {}


@triton.jit
def chunk_rows(layout, n, T, PACKED: tl.constexpr):
    """(t0, t_end): chunk n's first row in the call's (B, T, ...) tensors and the end of its rows there, rows
    t0 .. min(t0 + BT, t_end) - 1. Packed sequences (PACKED, a batch of one): read from `layout`, (chunks, 2) int32,
    each chunk's first row and end (`pipeline.Packing`); else n * BT and T. A kernel that is not MASKED takes t_end as
    None (every row of the chunk is there), for which the loads and stores of `load_rows` and `store_rows` take no
    mask."""
    if PACKED:
        return tl.load(layout + 2 * n), tl.load(layout + 2 * n + 1)
    else:
        t0 = n * BT  # assigned, not returned as an expression: the interpreter then makes it a tensor
        return t0, T


@triton.jit
def call_rows(T, N, MASKED: tl.constexpr):
    """The rows of the call's tensors: T, a launch argument of MASKED kernels only (`rows_args`); N * BT in the
    others, whole chunks, which compile as they would without the argument."""
    if MASKED:
        return T
    else:
        return N * BT


@triton.jit
def _kept(ptrs, t0, t_end, R: tl.constexpr, TRANSPOSED: tl.constexpr):
    """The mask of rows t0 .. t0 + R - 1 below t_end, shaped for `ptrs` ([R], [R, D], or [D, R] where TRANSPOSED)."""
    kept = t0 + tl.arange(0, R) < t_end
    if TRANSPOSED:
        return kept[None, :]
    elif len(ptrs.shape) == 2:
        return kept[:, None]
    else:
        return kept


@triton.jit
def load_rows(ptrs, t0, t_end, R: tl.constexpr = BT, TRANSPOSED: tl.constexpr = False):
    """tl.load(ptrs), pointers to rows t0 .. t0 + R - 1 of one of the call's inputs ([R], [R, D], or [D, R] where
    TRANSPOSED), the rows from t_end on read as zeros (`chunk_rows`; None: every row read)."""
    if t_end is None:
        return tl.load(ptrs)
    else:
        return tl.load(ptrs, mask=_kept(ptrs, t0, t_end, R, TRANSPOSED), other=0.0)


@triton.jit
def store_rows(ptrs, x, t0, t_end, R: tl.constexpr = BT):
    """tl.store(ptrs, x), pointers to rows t0 .. t0 + R - 1 of one of the call's outputs ([R] or [R, D]), the rows
    from t_end on left as they are (`chunk_rows`; None: every row written)."""
    if t_end is None:
        tl.store(ptrs, x)
    else:
        tl.store(ptrs, x, mask=_kept(ptrs, t0, t_end, R, False))


@triton.jit
def gates(g, beta, scal_base, t0, H, R: tl.constexpr = BT, offset=None, t_end=None):
    """On the R rows from t0 (a chunk, or a block of one), all fp32 [R]: gc (inclusive cumsum of g), the
    log-decay to the last row, and beta; `offset` is the log-decay before t0 inside the chunk (for a block). Rows
    from t_end on (`chunk_rows`) read as zeros: g = 0 and beta = 0 there."""
    r = tl.arange(0, R)
    gk = tl.maximum(load_rows(g + scal_base + (t0 + r) * H, t0, t_end, R).to(tl.float32), FLOOR)
    bk = load_rows(beta + scal_base + (t0 + r) * H, t0, t_end, R).to(tl.float32)
    gc, total = tl.cumsum(gk, 0), tl.sum(gk, 0)
    if offset is not None:
        gc, total = offset + gc, offset + total
    return gc, total, bk


@triton.jit
def gate_edge(g, beta, scal_base, t0, H, R: tl.constexpr = BT, t_end=None):
    """The first of the R rows from t0 whose beta is non-finite or whose g is NaN or +inf (g = -inf is a reset), R if
    none: read from the values as stored, since `gates`' floor may take a NaN to FLOOR (a GPU's max returns the
    number); rows from t_end on are zeros (`gates`)."""
    r = tl.arange(0, R)
    gk = load_rows(g + scal_base + (t0 + r) * H, t0, t_end, R).to(tl.float32)
    bk = load_rows(beta + scal_base + (t0 + r) * H, t0, t_end, R).to(tl.float32)
    finite = (gk < float("inf")) & (tl.abs(bk) < float("inf"))
    return tl.min(tl.where(finite, R, r), 0)


@triton.jit
def read_log_decay(g, scal_base, t0, H, gc, READ_FIRST: tl.constexpr, R: tl.constexpr = BT, t_end=None):
    """The log-decay that the read of each of the R rows from t0 sees, given their gc: gc itself in the spec's order,
    gr = gc - g (g floored, as `gates` floors it, and zero from t_end on) in fla's (READ_FIRST)."""
    if READ_FIRST:
        r = tl.arange(0, R)
        return gc - tl.maximum(load_rows(g + scal_base + (t0 + r) * H, t0, t_end, R).to(tl.float32), FLOOR)
    else:
        return gc


@triton.jit
def decay(gc, upper: tl.constexpr, strict: tl.constexpr, read=None):
    """E (lower) or E^T (upper), with the diagonal unless strict; the exponent is masked before exp. With `read`
    (`read_log_decay`) the later step's side takes it: exp(read_i - gc_j), the decay of L and dL in fla's order
    (strict there: on the diagonal read - gc = -g, whose exp may overflow)."""
    if read is None:
        read = gc
    i = tl.arange(0, BT)[:, None]
    j = tl.arange(0, BT)[None, :]
    if upper:  # E^T[a, b] = exp(gc_b - gc_a) for b >= a
        diff = read[None, :] - gc[:, None]
        keep = j >= i
        if strict:
            keep = j > i
    else:
        diff = read[:, None] - gc[None, :]
        keep = i >= j
        if strict:
            keep = i > j
    return tl.exp(tl.where(keep, diff, float("-inf")))


@triton.jit
def chunk_a(A, chunk, TRANSPOSED: tl.constexpr = False):
    """The chunk's A [64, 64] (bf16 as the transform stores it), or A^T where TRANSPOSED (loaded transposed)."""
    r = tl.arange(0, BT)
    if TRANSPOSED:
        return tl.load(A + chunk * BT * BT + r[None, :] * BT + r[:, None])
    else:
        return tl.load(A + chunk * BT * BT + r[:, None] * BT + r[None, :])


@triton.jit
def row_ptrs(x, base, t0, HD, D: tl.constexpr, R: tl.constexpr = BT):
    """Pointers to the [R, D] rows t0.. of a (B, T, H, D) tensor (base = (b*T*H + h)*D)."""
    r = tl.arange(0, R)
    return x + base + (t0 + r)[:, None] * HD + tl.arange(0, D)[None, :]


@triton.jit
def row_ptrs_t(x, base, t0, HD, D: tl.constexpr, R: tl.constexpr = BT):
    """Pointers to the same rows as `row_ptrs`, transposed: [D, R]."""
    r = tl.arange(0, R)
    return x + base + (t0 + r)[None, :] * HD + tl.arange(0, D)[:, None]


@triton.jit
def chunk_offsets(N, T, H, layout, PER_CHUNK: tl.constexpr = 1, PACKED: tl.constexpr = False,
                  MASKED: tl.constexpr = False):
    """This program's chunk n of the N of the layout (grid: chunk times PER_CHUNK programs, b * H + h): the
    (B, T, H) offset of its (b, h) in the call's tensors (T their rows, `call_rows`), its first row there and the end
    of its rows (`chunk_rows`), its index among all chunks, and the rows of its positions in a (B * H, N * BT, ...)
    scratch tensor."""
    n, bh = tl.program_id(0) // PER_CHUNK, tl.program_id(1)
    T = call_rows(T, N, MASKED)
    scal_base = (bh // H).to(tl.int64) * T * H + bh % H
    t0, t_end = chunk_rows(layout, n, T, PACKED)
    return scal_base, t0, t_end, bh.to(tl.int64) * N + n, bh.to(tl.int64) * (N * BT) + n * BT + tl.arange(0, BT)


@triton.jit
def scan_offset(bh, N, T, H, MASKED: tl.constexpr):
    """The (B, T, H) offset of a scan program's (b, h) = (bh // H, bh % H) in the call's tensors (`call_rows`)."""
    if MASKED:
        return (bh // H).to(tl.int64) * T * H + bh % H
    else:
        return (bh // H).to(tl.int64) * N * BT * H + bh % H


@triton.jit
def part_rows(rows_h, rows, MASKED: tl.constexpr):
    """The positions of a chunk's rows in one of dbeta's v parts, B * N * BT * H fp32 of scratch on whole chunks: laid
    out as beta is, at the chunk's rows rows_h of the call's (B, T, H) tensors, where T is whole chunks; in a MASKED
    kernel, as the (B * H, N * BT) scratch is, at the chunk's rows `rows` of it (`chunk_offsets`)."""
    if MASKED:
        return rows
    else:
        return rows_h


@triton.jit
def key_head(scal_base, bh, T, H, GROUP: tl.constexpr):
    """The (B, T, HK) offset of the key head (q, k and p) that value head bh % H reads in the call's tensors of T
    rows, and HK: value head hv reads key head hv // GROUP of the HK = H // GROUP key heads (H the value heads of
    the grid). (scal_base, H) where GROUP is 1."""
    if GROUP == 1:
        return scal_base, H
    else:
        HK = H // GROUP
        return (bh // H).to(tl.int64) * T * HK + (bh % H) // GROUP, HK


@triton.jit
def part_stride(T, H):
    """B * T * H (T the layout's rows, N * BT), the stride between the rows of a chunk-parallel kernel's parts of
    scratch (d gc's terms, dbeta's v parts: `part_rows`): B taken from the grid, whose axis 1 is b * H + h, rather
    than passed as one more launch argument."""
    return tl.num_programs(1) // H * T * H


@triton.jit
def scan_range(cu_chunks, N, H, PACKED: tl.constexpr):
    """(head, first, end) of a scan program: the value head whose rows it reads (b * H + h of the (B * H, ...)
    scratch) and the chunks [first, end) it runs over. Unpacked, program b * H + h of the grid's axis 1 runs over all
    N chunks of its row; packed (PACKED: sequences packed in a batch of one, each on chunks of its own), program
    s * H + h runs over sequence s's chunks, cu_chunks[s] to cu_chunks[s + 1]. Either way its carried state is row
    tl.program_id(1) of the (·, H, K, V) states."""
    pid = tl.program_id(1)
    if PACKED:
        seq = pid // H
        return pid % H, tl.load(cu_chunks + seq), tl.load(cu_chunks + seq + 1)
    else:
        return pid, 0, N


@triton.jit
def state_ptrs(state, bh, cv, K: tl.constexpr, V: tl.constexpr):
    """Pointers to the [K, BV] block (columns cv) of head bh's state in a (B, HV, K, V) tensor (a carried state, its
    gradient)."""
    return state + bh.to(tl.int64) * K * V + (tl.arange(0, K)[:, None] * V + cv[None, :])


@triton.jit
def scan_chunk(g, beta, state_out, state, n, bh, scal_base, t0, t_end, N, H, cv, K: tl.constexpr, V: tl.constexpr):
    """Chunk n of either scan, its rows from t0 in the call's tensors (`chunk_rows`): store the carried state (S_n, or
    dS'_n in the reverse scan), return the chunk's gates and its index: (gc, glast, bk, gam, chunk)."""
    gc, glast, bk = gates(g, beta, scal_base, t0, H, t_end=t_end)
    chunk = bh.to(tl.int64) * N + n
    ck = tl.arange(0, K)
    tl.store(state_out + (chunk * K + ck[:, None]) * V + cv[None, :], state.to(state_out.dtype.element_ty))
    return gc, glast, bk, tl.exp(gc), chunk

