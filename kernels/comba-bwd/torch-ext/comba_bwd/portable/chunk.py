"""What the Triton kernels of the forward and the backward share: the chunk, the gates of a chunk, its decay, the
pointers to its rows, the offsets of a chunk-parallel program, and the scans' V blocks and pipeline depth.

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
# the chunk's q, k, p and A once instead of twice, which is faster; blocks of 32 at K = 128 (twice the programs)
# are slower than 64. At K = 256 the blocks stay 64 wide: Triton 3.6 miscompiles both scans on sm_90 with blocks of
# 16 or 32 there (wrong outputs, out-of-range shared-memory reads under compute-sanitizer).
SCAN_BLOCK = {64: 128, 128: 64, 256: 64}
SCAN_WARPS = 4

# What the pipelined scans need by K: the shared memory of a block (the reverse scan's, the larger), and the one GPU
# generation they run on where that is not every one (None). 113 KB at K = 64 and 128 (their state blocks being the
# same size), more than a block may have on sm_86 / sm_89 / sm_120 (99 KB); 177 KB at K = 256, more than sm_80's
# 163 KB too, and there on Hopper alone, where the GPU suite verified them: on sm_100 Triton 3.9 lays them out in
# 236 KB, more than its blocks' 227 KB. Elsewhere the scans run unpipelined (STAGES = 1).
PIPELINED_SCANS = {64: (116 * 1024, None), 128: (116 * 1024, None), 256: (177 * 1024, 9)}


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


@triton.jit
def gates(g, beta, scal_base, t0, H, R: tl.constexpr = BT, offset=None):
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
def gate_edge(g, beta, scal_base, t0, H, R: tl.constexpr = BT):
    """The first of the R rows from t0 whose beta is non-finite or whose g is NaN or +inf (g = -inf is a reset), R if
    none: read from the values as stored, since `gates`' floor may take a NaN to FLOOR (a GPU's max returns the
    number)."""
    r = tl.arange(0, R)
    gk = tl.load(g + scal_base + (t0 + r) * H).to(tl.float32)
    bk = tl.load(beta + scal_base + (t0 + r) * H).to(tl.float32)
    finite = (gk < float("inf")) & (tl.abs(bk) < float("inf"))
    return tl.min(tl.where(finite, R, r), 0)


@triton.jit
def read_log_decay(g, scal_base, t0, H, gc, READ_FIRST: tl.constexpr, R: tl.constexpr = BT):
    """The log-decay that the read of each of the R rows from t0 sees, given their gc: gc itself in the spec's order,
    gr = gc - g (g floored, as `gates` floors it) in fla's (READ_FIRST)."""
    if READ_FIRST:
        r = tl.arange(0, R)
        return gc - tl.maximum(tl.load(g + scal_base + (t0 + r) * H).to(tl.float32), FLOOR)
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
def chunk_offsets(N, H, PER_CHUNK: tl.constexpr = 1):
    """This program's chunk (grid: chunk times PER_CHUNK programs, b * H + h): the (B, T, H) offset of its (b, h),
    its first row, its index among all chunks, and the rows of its positions in a (B * H, T, ...) tensor."""
    n, bh = tl.program_id(0) // PER_CHUNK, tl.program_id(1)
    T = N * BT
    scal_base = (bh // H).to(tl.int64) * T * H + bh % H
    return scal_base, n * BT, bh.to(tl.int64) * N + n, bh.to(tl.int64) * T + n * BT + tl.arange(0, BT)


@triton.jit
def key_head(scal_base, bh, T, H, GROUP: tl.constexpr):
    """The (B, T, HK) offset of the key head (q, k and p) that value head bh % H reads, and HK: value head hv reads
    key head hv // GROUP of the HK = H // GROUP key heads (H the value heads of the grid). (scal_base, H) where
    GROUP is 1."""
    if GROUP == 1:
        return scal_base, H
    else:
        HK = H // GROUP
        return (bh // H).to(tl.int64) * T * HK + (bh % H) // GROUP, HK


@triton.jit
def part_stride(T, H, PACKED: tl.constexpr = False):
    """B * T * H (T padded to whole chunks), the stride between dbeta_v's parts, one per scan V block: B taken
    from the grid, whose axis 1 is b * H + h in the scans and the chunk kernels alike, rather than passed as one
    more launch argument; T * H in a scan over packed sequences (PACKED: a batch of one, axis 1 of its grid is
    sequence * H + h)."""
    if PACKED:
        return T * H
    else:
        return tl.num_programs(1) // H * T * H


@triton.jit
def scan_range(cu_chunks, N, H, PACKED: tl.constexpr):
    """(head, first, end) of a scan program: the value head whose rows it reads (b * H + h of the (B * H, ...)
    scratch) and the chunks [first, end) it runs over. Unpacked, program b * H + h of the grid's axis 1 runs over all
    N chunks of its row; packed (PACKED: a batch of one whose sequences are laid out chunk-aligned), program
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
def scan_chunk(g, beta, state_out, state, n, bh, scal_base, N, H, cv, K: tl.constexpr, V: tl.constexpr):
    """Chunk n of either scan: store the carried state (S_n, or dS'_n in the reverse scan), return the chunk's
    first position, its gates and its index: (t0, gc, glast, bk, gam, chunk)."""
    t0 = n * BT
    gc, glast, bk = gates(g, beta, scal_base, t0, H)
    chunk = bh.to(tl.int64) * N + n
    ck = tl.arange(0, K)
    tl.store(state_out + (chunk * K + ck[:, None]) * V + cv[None, :], state.to(state_out.dtype.element_ty))
    return t0, gc, glast, bk, tl.exp(gc), chunk

