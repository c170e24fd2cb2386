"""The chunk states of Based's feature maps, in HBM: their layout and the scan that fills them.

With phi_k(k) = [1, k, k (x) k] and phi_q(q~) = [1, q~, q~ (x) q~ / 2] (the Taylor term's 1/2 on the query side),
A_ij = phi_q(q~_i) . phi_k(k_j). Both maps are symmetric in the pair (a, b) of a product x_a x_b, so a state keeps
one row per unordered pair: P = 1 + K + K (K + 1) / 2 rows, row 0 the constant, rows 1 .. K the linear block,
then the pairs a <= b row by row (`_pair_row`); 153 rows at K = 16 instead of 273. A (B H, N, P, V) buffer holds
chunk n's state at rows `_chunk_state(bh, n)`; an fp32 (B H, N, P) buffer its normaliser.

`_state_scan_kernel` forward stores S_n = sum over earlier chunks of phi_k(K)^T V and z_n = sum of phi_k(k) (the
forward's output and dq read them); reverse, dS_n = sum over later chunks of phi_q(Q~)^T G and dz_n = sum of
phi_q(q~) h (dk and dv read them). Each program owns a block of feature rows and of V columns, so the scan is
parallel over (features, V, b h); only the running sum is serial, and it is fp32 in registers. A step reads the
chunk's x as one coalesced tile and gathers each feature row's factors from it in registers (`_scan_loads`).

Packed sequences may also be scanned in segments of at most G chunks (`Packing.segment_chunks`): the state is a
plain sum (no decay), so a segment's start is the sequence's start plus the totals of the segments before it
(reverse: after it). Two launches of the same kernel: TOTAL_ONLY sums each segment's chunks into an fp32 scratch
row and stores no state; then SEGMENTED scans each segment from its start (the given start plus the earlier
segments' totals, added in the scan's order), storing its chunks' states. The serial depth becomes G chunks (plus
one load of a total per earlier segment) instead of the longest sequence's chunk count, at the cost of reading the
chunks twice (all but a sequence's last segment's forward, its first segment's reverse: no other segment reads
their totals).
"""

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ..common.checks import bounded_offsets
from .tiles import _dot, _sequence_row, operand_type


@triton.jit
def _pair_row(a, b, K: tl.constexpr):
    """The state row of the quadratic feature x_a x_b (either order): after the constant and the K linear
    rows, the pairs a' <= b' row by row (a' = 0 first, with K pairs)."""
    lo = tl.minimum(a, b)
    hi = tl.maximum(a, b)
    return 1 + K + lo * K - lo * (lo - 1) // 2 + (hi - lo)


@triton.jit
def _chunk_state(pid_bh, n, N, P: tl.constexpr):
    """The row of feature 0 of chunk n's state of sequence pid_bh in the (B H, N, P, .) state buffers."""
    return (pid_bh.to(tl.int64) * N + n) * P


@triton.jit
def _chunk_at(n, pid_bh, T, H, N, chunk_index, cu_seqlens, C: tl.constexpr, P: tl.constexpr, VARLEN: tl.constexpr):
    """Chunk n of sequence pid_bh = b H + h for the chunk kernels: the row of the sequence's position 0
    (`_sequence_row`), its length, the offset of its position 0 in a (B H, T) per-position tensor, the row of
    the chunk's state (`_chunk_state`) and its first position relative to the sequence. VARLEN: chunk n of the
    packed buffers of head pid_bh = h (B = 1), at `chunk_index`'s place in its sequence; a first position < 0
    marks a chunk past the last one."""
    if VARLEN:
        seq = tl.load(chunk_index + 2 * n)
        place = tl.load(chunk_index + 2 * n + 1)
        bos = tl.load(cu_seqlens + seq).to(tl.int64)
        length = (tl.load(cu_seqlens + seq + 1) - bos).to(tl.int32)
        return bos * H + pid_bh, length, pid_bh.to(tl.int64) * T + bos, _chunk_state(pid_bh, n, N, P), place * C
    else:
        return _sequence_row(pid_bh, T, H), T, pid_bh.to(tl.int64) * T, _chunk_state(pid_bh, n, N, P), n * C


@triton.jit
def _scan_loads(x, y, w_in, n, ia, ib, cols, T, H, V, K: tl.constexpr, R: tl.constexpr, C: tl.constexpr,
                WEIGHTED: tl.constexpr):
    """The loads of chunk n one scan step consumes: the factors x_a and x_b [R, C] of the program's feature rows
    (phi_t = coef x_a x_b), y [C, BV] and the position weights [C] (w_in's, or 1); zero past T.

    x is read once a chunk, as one coalesced [C, K] tile (a position's K features are contiguous), widened in
    registers to fp32 [C, 2 K] by a column of ones at K (zero past T) and zero columns after it. x_a and x_b are
    gathered from that tile along the features (`tl.gather`, column ia and ib of each row): a gather from global
    memory would issue R C scattered 2-byte loads per factor and chunk and bound the scan by its load
    instructions, not by its bytes. The ones column makes x_b = 1 on the linear rows and x_a = x_b = 1 on the
    constant row, the zero columns zero the rows past P, so the rows need no masks."""
    t = n * C + tl.arange(0, C)
    inside = t < T
    features = tl.arange(0, 2 * K)
    tile = tl.load(x + t.to(tl.int64)[:, None] * (H * K) + features[None, :],
                   mask=inside[:, None] & (features < K)[None, :], other=0.0).to(tl.float32)
    tile = tl.where((features == K)[None, :] & inside[:, None], 1.0, tile)
    xa = tl.trans(tl.gather(tile, tl.broadcast_to(ia[None, :], (C, R)), 1))
    xb = tl.trans(tl.gather(tile, tl.broadcast_to(ib[None, :], (C, R)), 1))
    yy = tl.load(y + t.to(tl.int64)[:, None] * (H * V) + cols[None, :], mask=inside[:, None] & (cols < V)[None, :],
                 other=0.0)
    if WEIGHTED:
        w = tl.load(w_in + t, mask=inside, other=0.0)
    else:
        w = inside.to(tl.float32)
    return xa, xb, yy, w


@triton.jit
def _scan_program(pid_bh, T, H, N, cu_seqlens, chunk_first, seq_order, segment_index, G, C: tl.constexpr,
                  P: tl.constexpr, REVERSE: tl.constexpr, VARLEN: tl.constexpr, SEGMENTED: tl.constexpr):
    """A scan program's part: its sequence b H + h (packed: n H + h for the program's sequence n), the row of
    the sequence's position 0 (`_sequence_row`), its length, the offset of its position 0 in a (B H, T) (or
    (H, T)) per-position tensor, the row of feature 0 of the sequence's first chunk's state; the chunks lo .. hi - 1
    of the sequence the program scans; whether its running sum after them is the sequence's end (forward: after
    its last chunk; reverse: after its first); and the scratch row of the first of the segment totals its start
    adds, and their count (the rows step by H: by -H reverse).

    VARLEN: the sequence n = seq_order[pid_bh // H] (longest first), all of its chunks. SEGMENTED (with VARLEN):
    segment s = pid_bh // H of the `Packing`'s segment table, the sequence's j-th: chunks j G .. (j + 1) G - 1
    (within its chunk count), its start adding the totals of the sequence's segments before it (reverse: after it),
    whose rows are s' H + h as the program's own is s H + h; past the last segment (j < 0) no chunks."""
    if VARLEN:
        if SEGMENTED:
            seq = tl.load(segment_index + 2 * (pid_bh // H))
            j = tl.load(segment_index + 2 * (pid_bh // H) + 1)
        else:
            seq = tl.load(seq_order + pid_bh // H)
        h = pid_bh % H
        bos = tl.load(cu_seqlens + seq).to(tl.int64)
        length = (tl.load(cu_seqlens + seq + 1) - bos).to(tl.int32)
        first = tl.load(chunk_first + seq)
        seq_bh, row, w_row = seq * H + h, bos * H + h, h.to(tl.int64) * T + bos
        state_rows = _chunk_state(h, first, N, P)
        n_chunks = tl.cdiv(length, C)
        if SEGMENTED:
            n_segments = tl.maximum(tl.cdiv(n_chunks, G), 1)  # an empty sequence has one segment, of no chunks
            lo = j * G
            hi = tl.where(j >= 0, tl.minimum(lo + G, n_chunks), lo)
            if REVERSE:  # the later segments, the last first
                ends = j == 0
                folds = tl.where(j >= 0, n_segments - 1 - j, 0)
                fold_first = pid_bh + folds * H
            else:  # the earlier segments, the first first
                ends = j == n_segments - 1
                folds = tl.maximum(j, 0)
                fold_first = pid_bh - folds * H
        else:
            lo, hi, ends, fold_first, folds = 0, n_chunks, True, 0, 0
        return seq_bh, row, length, w_row, state_rows, lo, hi, ends, fold_first, folds
    else:
        return (pid_bh, _sequence_row(pid_bh, T, H), T, pid_bh.to(tl.int64) * T, _chunk_state(pid_bh, 0, N, P), 0,
                N, True, 0, 0)


@triton.jit
def _state_scan_kernel(
    x, y, w_in, states, norms, init_states, init_norms, final_states, final_norms, totals, total_norms, cu_seqlens,
    chunk_first, seq_order, segment_index, T, H, V, scale, N, G,
    K: tl.constexpr, P: tl.constexpr, R: tl.constexpr, BV: tl.constexpr, C: tl.constexpr, REVERSE: tl.constexpr,
    DOT: tl.constexpr, INITIAL: tl.constexpr, FINAL: tl.constexpr, VARLEN: tl.constexpr, SEGMENTED: tl.constexpr,
    TOTAL_ONLY: tl.constexpr,
):
    """Forward (REVERSE false): x = k, y = v; stores S_n = sum_{m < n} phi_k(K_m)^T V_m and z_n (weights 1).
    Reverse: x = q, y = g; stores dS_n = sum_{m > n} phi_q(Q~_m)^T G_m and dz_n (weights w_in = h).

    INITIAL: the running sum starts from the sequence's fp32 init_states / init_norms row block.
    FINAL: the running sum after the sequence's last chunk (reverse: its first) goes to final_states / final_norms.
    VARLEN: program pid_bh runs head h = pid_bh % H of packed sequence n = seq_order[pid_bh // H] of a B = 1 batch
    (offsets cu_seqlens), whose chunks' states start at chunk chunk_first[n] of head h in the (H, N, P, V)
    buffers; its initial and final rows are n H + h's. seq_order puts the longest sequences first, so that the
    longest serial loops start in the first wave.
    SEGMENTED (with VARLEN): program pid_bh runs head h of segment pid_bh // H of segment_index (G chunks at most,
    `_scan_program`). TOTAL_ONLY: it stores no state, only its segment's sum, fp32, at row pid_bh of totals /
    total_norms (zero for the segment that ends its sequence, whose total no other segment reads); else its
    running sum starts from the initial block (INITIAL) plus the totals of the segments before it (reverse:
    after it), and FINAL is stored by the segment that ends the sequence."""
    pid_f = tl.program_id(0)
    pid_v = tl.program_id(1)
    pid_bh = tl.program_id(2)
    seq_bh, row, T_seq, w_row, state_rows, lo, hi, ends, fold_first, folds = _scan_program(
        pid_bh, T, H, N, cu_seqlens, chunk_first, seq_order, segment_index, G, C, P, REVERSE, VARLEN, SEGMENTED)
    if TOTAL_ONLY:
        hi = tl.where(ends, lo, hi)
    x += row * K
    y += row * V
    w_in += w_row
    f = pid_f * R + tl.arange(0, R)
    linear = (f >= 1) & (f <= K)
    quad = (f > K) & (f < P)
    # Packed pair p = f - 1 - K -> (a, b), a <= b: a counts the rows a' >= 1 whose first pair is at or before p.
    p = f - 1 - K
    pa = tl.zeros([R], dtype=tl.int32)
    for a in tl.static_range(1, K):
        pa += (p >= a * K - a * (a - 1) // 2).to(tl.int32)
    # The factors' columns of `_scan_loads`' widened tile: x_a x_b is x_a 1 on a linear row, 1 1 on the constant
    # row and 0 0 past P, so that phi_t = coef x_a x_b with one coefficient a row (phi_q's scale, scale^2 / 2)
    ones, zeros = K, K + 1
    ia = tl.where(linear, f - 1, tl.where(quad, pa, tl.where(f == 0, ones, zeros)))
    ib = tl.where(quad, p - (pa * K - pa * (pa - 1) // 2) + pa, tl.where(f <= K, ones, zeros))
    if REVERSE:  # phi_q of q~ = scale q
        coef = tl.where(linear, scale, tl.where(quad, 0.5 * scale * scale, 1.0))
    else:
        coef = tl.full([R], 1.0, tl.float32)
    cols = pid_v * BV + tl.arange(0, BV)
    state_rows += f
    store_mask = (f < P)[:, None] & (cols < V)[None, :]
    if INITIAL:
        block = init_states + seq_bh.to(tl.int64) * (P * V)
        acc = tl.load(block + (f[:, None] * V + cols[None, :]), mask=store_mask, other=0.0)
        z = tl.load(init_norms + seq_bh.to(tl.int64) * P + f, mask=f < P, other=0.0)
    else:
        acc = tl.zeros([R, BV], dtype=tl.float32)
        z = tl.zeros([R], dtype=tl.float32)
    if SEGMENTED and not TOTAL_ONLY:  # the start adds the totals of the segments before, in the scan's order
        total = fold_first.to(tl.int64) * P + f
        for _ in range(0, folds):
            acc += tl.load(totals + (total[:, None] * V + cols[None, :]), mask=store_mask, other=0.0)
            z += tl.load(total_norms + total, mask=f < P, other=0.0)
            if REVERSE:
                total -= H * P
            else:
                total += H * P
    for m in range(0, hi - lo):
        if REVERSE:
            n = hi - 1 - m
        else:
            n = lo + m
        if not TOTAL_ONLY:
            rows = state_rows + n * P
            tl.store(states + rows[:, None] * V + cols[None, :], acc.to(states.dtype.element_ty), mask=store_mask)
            if pid_v == 0:
                tl.store(norms + rows, z, mask=f < P)
        xa, xb, yy, w = _scan_loads(x, y, w_in, n, ia, ib, cols, T_seq, H, V, K, R, C, REVERSE)
        phi_t = coef[:, None] * xa * xb
        acc += _dot(DOT, phi_t, yy)
        z += tl.sum(phi_t * w[None, :], 1)
    if TOTAL_ONLY:
        own = pid_bh.to(tl.int64) * P + f
        tl.store(totals + own[:, None] * V + cols[None, :], acc, mask=store_mask)
        if pid_v == 0:
            tl.store(total_norms + own, z, mask=f < P)
    # FINAL: offsets of their own, so that none of the initial load's is held through the loop; the scalar `ends`
    # joins the masks through tl.where (a block mask & a scalar boolean is int32 in Triton 3.9's interpreter)
    if FINAL:
        own = seq_bh.to(tl.int64) * P + f
        tl.store(final_states + own[:, None] * V + cols[None, :], acc, mask=tl.where(ends, store_mask, False))
        if pid_v == 0:
            tl.store(final_norms + own, z, mask=tl.where(ends, f < P, False))


def n_features(K: int) -> int:
    """P, the state rows: the constant, K linear features and the K (K + 1) / 2 distinct products x_a x_b
    (a <= b; the state of x_b x_a is the same, so the kernels read one row for both orders)."""
    return 1 + K + K * (K + 1) // 2


def state_buffers(x: torch.Tensor, V: int, chunk: int, packing=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Uninitialised (B H, N, P, V) states for x (B, T, H, K) cut in N = ceil(T / chunk) chunks (fp32 for fp32
    inputs, bf16 otherwise) and fp32 (B H, N, P) normalisers, on x's device. With the `Packing` of packed
    sequences, (H, N, P, V) and (H, N, P) with N its chunk bound."""
    B, T, H, K = x.shape
    BH, N, P = B * H, triton.cdiv(T, chunk), n_features(K)
    if packing is not None:
        BH, N = H, packing.chunks
    dtype = torch.float32 if x.dtype == torch.float32 else torch.bfloat16
    states = torch.empty(BH, N, P, V, device=x.device, dtype=dtype)
    return states, torch.empty(BH, N, P, device=x.device, dtype=torch.float32)


class Packing(NamedTuple):
    """Where the chunks of N packed sequences (B = 1) lie, built on the device from cu_seqlens (no host read):
    cu_seqlens itself (int32), chunk_first (N + 1, int32: sequence n's chunks are chunk_first[n] ..
    chunk_first[n + 1] - 1 of the state buffers), chunk_index (chunks, 2, int32: a chunk's sequence and its
    place in it; (0, -1) past the last chunk), seq_order (N, int32: the sequences longest first, the scan's
    order) and `chunks`, the host-side bound (T + N (C - 1)) // C on the chunk count that sizes the buffers and
    the chunk kernels' grids.

    With segment_chunks = G (None: the scan runs each sequence whole), the scan's segments: sequence n cut into
    max(1, ceil(chunks_n / G)) segments of G chunks (its last one shorter, an empty sequence's one empty),
    numbered sequence by sequence; segment_index (segments, 2, int32: a segment's sequence and its place in it;
    (0, -1) past the last segment) and `segments`, the host-side bound chunks // G + N on their count (sum_n
    max(1, ceil(chunks_n / G)) <= sum_n (chunks_n // G + 1)) that sizes the segmented scan's grid and scratch."""

    cu_seqlens: torch.Tensor
    chunk_first: torch.Tensor
    chunk_index: torch.Tensor
    seq_order: torch.Tensor
    chunks: int
    segment_chunks: int | None = None
    segment_index: torch.Tensor | None = None
    segments: int = 0


def _places(first: torch.Tensor, count: int) -> torch.Tensor:
    """(count, 2) int32: for items 0 .. count - 1 numbered sequence by sequence (sequence n's are first[n] ..
    first[n + 1] - 1, first int32 of N + 1), each one's sequence and its place in it; (0, -1) past the last."""
    N = first.numel() - 1
    g = torch.arange(count, device=first.device, dtype=torch.int32)
    seq = torch.searchsorted(first[1:], g, right=True).to(torch.int32)
    real = seq < N
    seq = torch.where(real, seq, 0)
    place = torch.where(real, g - first[seq.long()], -1)
    return torch.stack([seq, place], 1).contiguous()


def _first(counts: torch.Tensor) -> torch.Tensor:
    """(N + 1) int32: the numbering's starts for N sequences of counts items each."""
    return torch.cat([counts.new_zeros(1), counts.cumsum(0).to(torch.int32)])


def packing(cu_seqlens: torch.Tensor, T: int, chunk: int, segment_chunks: int | None = None) -> Packing:
    """The `Packing` of the sequences cu_seqlens (N + 1 offsets from 0 to T) cut in chunks of `chunk`, and for the
    scan in segments of `segment_chunks` chunks (None: no segments). The offsets are taken bounded
    (`common.checks.bounded_offsets`: a GPU call's are not checked on the host), so that every chunk the kernels read or
    write lies in the packed tensors."""
    cu = bounded_offsets(cu_seqlens, T).to(torch.int32)
    N = cu.numel() - 1
    chunks = max(1, (T + N * (chunk - 1)) // chunk)
    per_seq = (cu[1:] - cu[:-1] + chunk - 1) // chunk
    first = _first(per_seq)
    order = torch.argsort(per_seq, descending=True, stable=True).to(torch.int32)
    plain = Packing(cu, first, _places(first, chunks), order, chunks)
    if segment_chunks is None:
        return plain
    if segment_chunks < 1:
        raise ValueError(f"segment_chunks must be None or >= 1, got {segment_chunks}")
    segments = chunks // segment_chunks + N
    per_seq = torch.clamp((per_seq + segment_chunks - 1) // segment_chunks, min=1)
    return plain._replace(segment_chunks=segment_chunks, segment_index=_places(_first(per_seq), segments),
                          segments=segments)


def launch(x, y, weights, states, norms, scale: float, *, chunk: int, reverse: bool, rows: int, bv: int,
           warps: int, stages: int, initial=None, final=None, packing: Packing | None = None) -> None:
    """The scan over chunks of `chunk` positions of x (B, T, H, K) and y (B, T, H, V) into the `state_buffers`
    states and norms: forward (reverse False) x = k, y = v, weights not read; reverse x = q, y = g, weights the
    fp32 (B H, T) h. A program takes `rows` feature rows and up to `bv` V columns, on `warps` warps, its loop
    pipelined in `stages` stages (Triton's num_stages).

    initial: None or fp32 (S0 (B H, P, V), z0 (B H, P)) in the packed layout, where the running sum starts;
    final: None or fp32 buffers of those shapes that receive the running sum after the last chunk;
    packing: the `Packing` of packed sequences (B = 1; then B H reads N H, sequence-major). With its segment
    table, two launches: the segments' totals into an fp32 scratch, then the segments' scans (`_state_scan_kernel`)."""
    B, T, H, K = x.shape
    _, N, P, V = states.shape
    BH = B * H if packing is None else (packing.chunk_first.numel() - 1) * H
    BV = min(bv, max(16, triton.next_power_of_2(V)))
    cu, first, order = (None,) * 3 if packing is None else (packing.cu_seqlens, packing.chunk_first, packing.seq_order)
    segmented = packing is not None and packing.segment_index is not None
    totals, G, index = (None, None), None, None
    if segmented:
        BH = packing.segments * H
        totals = (torch.empty(BH, P, V, device=x.device, dtype=torch.float32),
                  torch.empty(BH, P, device=x.device, dtype=torch.float32))
        G, index = packing.segment_chunks, packing.segment_index

    def scan(start, end, total_only: bool) -> None:
        _state_scan_kernel[(triton.cdiv(P, rows), triton.cdiv(V, BV), BH)](
            x, y, weights, states, norms, *(start or (None, None)), *(end or (None, None)), *totals, cu, first, order,
            index, T, H, V, scale, N, G,
            K=K, P=P, R=rows, BV=BV, C=chunk, REVERSE=reverse, DOT=operand_type(x.dtype), INITIAL=start is not None,
            FINAL=end is not None, VARLEN=packing is not None, SEGMENTED=segmented, TOTAL_ONLY=total_only,
            num_warps=warps, num_stages=stages)

    if segmented:  # the segments' totals, from zero
        scan(None, None, True)
    scan(initial, final, False)
