"""The chunk states of Based's feature maps, in HBM: their layout and the scan that fills them.

With phi_k(k) = [1, k, k (x) k] and phi_q(q~) = [1, q~, q~ (x) q~ / 2] (the Taylor term's 1/2 on the query side),
A_ij = phi_q(q~_i) . phi_k(k_j). Both maps are symmetric in the pair (a, b) of a product x_a x_b, so a state keeps
one row per unordered pair: P = 1 + K + K (K + 1) / 2 rows, row 0 the constant, rows 1 .. K the linear block,
then the pairs a <= b row by row (`_pair_row`); 153 rows at K = 16 instead of 273. A (B H, N, P, V) buffer holds
chunk n's state at rows `_chunk_state(bh, n)`; an fp32 (B H, N, P) buffer its normaliser.

`_state_scan_kernel` forward stores S_n = sum over earlier chunks of phi_k(K)^T V and z_n = sum of phi_k(k) (the
forward's output and dq read them); reverse, dS_n = sum over later chunks of phi_q(Q~)^T G and dz_n = sum of
phi_q(q~) h (dk and dv read them). Each program owns a block of feature rows and of V columns, so the scan is
parallel over (features, V, b h); only the running sum is serial, and it is fp32 in registers.
"""

from typing import NamedTuple

import torch
import triton
import triton.language as tl

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
def _scan_loads(x, y, w_in, n, ia, ib, linear, quad, cols, T, H, V, K: tl.constexpr, C: tl.constexpr,
                WEIGHTED: tl.constexpr):
    """The loads of chunk n one scan step consumes: x_a and x_b [R, C], y [C, BV] and the position weights
    [C] (w_in's, or 1); zero past T."""
    t = n * C + tl.arange(0, C)
    inside = t < T
    xrow = x + t.to(tl.int64)[None, :] * (H * K)
    xa = tl.load(xrow + ia[:, None], mask=inside[None, :] & (linear | quad)[:, None], other=0.0)
    xb = tl.load(xrow + ib[:, None], mask=inside[None, :] & quad[:, None], other=0.0)
    yy = tl.load(y + t.to(tl.int64)[:, None] * (H * V) + cols[None, :], mask=inside[:, None] & (cols < V)[None, :],
                 other=0.0)
    if WEIGHTED:
        w = tl.load(w_in + t, mask=inside, other=0.0)
    else:
        w = inside.to(tl.float32)
    return xa, xb, yy, w


@triton.jit
def _scan_program(pid_bh, T, H, N, cu_seqlens, chunk_first, seq_order, C: tl.constexpr, P: tl.constexpr,
                  VARLEN: tl.constexpr):
    """A scan program's sequence: b H + h (packed: n H + h for the program's sequence n = seq_order[pid_bh // H],
    longest first), the row of its position 0 (`_sequence_row`), its length, the offset of its position 0 in a
    (B H, T) (or (H, T)) per-position tensor, the row of feature 0 of its first chunk's state, and its chunk
    count."""
    if VARLEN:
        seq = tl.load(seq_order + pid_bh // H)
        h = pid_bh % H
        bos = tl.load(cu_seqlens + seq).to(tl.int64)
        length = (tl.load(cu_seqlens + seq + 1) - bos).to(tl.int32)
        first = tl.load(chunk_first + seq)
        return (seq * H + h, bos * H + h, length, h.to(tl.int64) * T + bos, _chunk_state(h, first, N, P),
                tl.cdiv(length, C))
    else:
        return (pid_bh, _sequence_row(pid_bh, T, H), T, pid_bh.to(tl.int64) * T, _chunk_state(pid_bh, 0, N, P),
                N)


@triton.jit
def _state_scan_kernel(
    x, y, w_in, states, norms, init_states, init_norms, final_states, final_norms, cu_seqlens, chunk_first,
    seq_order, T, H, V, scale, N,
    K: tl.constexpr, P: tl.constexpr, R: tl.constexpr, BV: tl.constexpr, C: tl.constexpr, REVERSE: tl.constexpr,
    DOT: tl.constexpr, INITIAL: tl.constexpr, FINAL: tl.constexpr, VARLEN: tl.constexpr,
):
    """Forward (REVERSE false): x = k, y = v; stores S_n = sum_{m < n} phi_k(K_m)^T V_m and z_n (weights 1).
    Reverse: x = q, y = g; stores dS_n = sum_{m > n} phi_q(Q~_m)^T G_m and dz_n (weights w_in = h).

    INITIAL: the running sum starts from the sequence's fp32 init_states / init_norms row block.
    FINAL: the running sum after the last chunk goes to final_states / final_norms.
    VARLEN: program pid_bh runs head h = pid_bh % H of packed sequence n = seq_order[pid_bh // H] of a B = 1 batch
    (offsets cu_seqlens), whose chunks' states start at chunk chunk_first[n] of head h in the (H, N, P, V)
    buffers; its initial and final rows are n H + h's. seq_order puts the longest sequences first, so that the
    longest serial loops start in the first wave."""
    pid_f = tl.program_id(0)
    pid_v = tl.program_id(1)
    pid_bh = tl.program_id(2)
    seq_bh, row, T_seq, w_row, state_rows, n_chunks = _scan_program(pid_bh, T, H, N, cu_seqlens, chunk_first,
                                                                    seq_order, C, P, VARLEN)
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
    ia = tl.where(linear, f - 1, tl.where(quad, pa, 0))
    ib = tl.where(quad, p - (pa * K - pa * (pa - 1) // 2) + pa, 0)
    if REVERSE:  # phi_q of q~ = scale q
        c1 = scale
        c2 = 0.5 * scale * scale
    else:
        c1 = 1.0
        c2 = 1.0
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
    for m in range(0, n_chunks):
        if REVERSE:
            n = n_chunks - 1 - m
        else:
            n = m
        rows = state_rows + n * P
        tl.store(states + rows[:, None] * V + cols[None, :], acc.to(states.dtype.element_ty), mask=store_mask)
        if pid_v == 0:
            tl.store(norms + rows, z, mask=f < P)
        xa, xb, yy, w = _scan_loads(x, y, w_in, n, ia, ib, linear, quad, cols, T_seq, H, V, K, C, REVERSE)
        inside = n * C + tl.arange(0, C) < T_seq
        xa32, xb32 = xa.to(tl.float32), xb.to(tl.float32)
        phi_t = tl.where(linear[:, None], c1 * xa32, c2 * xa32 * xb32)
        phi_t = tl.where((f == 0)[:, None] & inside[None, :], 1.0, phi_t)
        acc += _dot(DOT, phi_t, yy)
        z += tl.sum(phi_t * w[None, :], 1)
    if FINAL:  # offsets of their own, so that none of the initial load's is held through the loop
        own = seq_bh.to(tl.int64) * P + f
        tl.store(final_states + own[:, None] * V + cols[None, :], acc, mask=store_mask)
        if pid_v == 0:
            tl.store(final_norms + own, z, mask=f < P)


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
    the chunk kernels' grids."""

    cu_seqlens: torch.Tensor
    chunk_first: torch.Tensor
    chunk_index: torch.Tensor
    seq_order: torch.Tensor
    chunks: int


def packing(cu_seqlens: torch.Tensor, T: int, chunk: int) -> Packing:
    """The `Packing` of the sequences cu_seqlens (N + 1 offsets from 0 to T) cut in chunks of `chunk`."""
    cu = cu_seqlens.to(torch.int32)
    N = cu.numel() - 1
    chunks = max(1, (T + N * (chunk - 1)) // chunk)
    per_seq = (cu[1:] - cu[:-1] + chunk - 1) // chunk
    first = torch.cat([per_seq.new_zeros(1), per_seq.cumsum(0).to(torch.int32)])
    g = torch.arange(chunks, device=cu.device, dtype=torch.int32)
    seq = torch.searchsorted(first[1:], g, right=True).to(torch.int32)
    real = seq < N
    seq = torch.where(real, seq, 0)
    place = torch.where(real, g - first[seq.long()], -1)
    order = torch.argsort(per_seq, descending=True, stable=True).to(torch.int32)
    return Packing(cu, first, torch.stack([seq, place], 1).contiguous(), order, chunks)


def launch(x, y, weights, states, norms, scale: float, *, chunk: int, reverse: bool, rows: int, bv: int,
           warps: int, initial=None, final=None, packing: Packing | None = None) -> None:
    """The scan over chunks of `chunk` positions of x (B, T, H, K) and y (B, T, H, V) into the `state_buffers`
    states and norms: forward (reverse False) x = k, y = v, weights not read; reverse x = q, y = g, weights the
    fp32 (B H, T) h. A program takes `rows` feature rows and up to `bv` V columns, on `warps` warps.

    initial: None or fp32 (S0 (B H, P, V), z0 (B H, P)) in the packed layout, where the running sum starts;
    final: None or fp32 buffers of those shapes that receive the running sum after the last chunk;
    packing: the `Packing` of packed sequences (B = 1; then B H reads N H, sequence-major)."""
    B, T, H, K = x.shape
    _, N, P, V = states.shape
    BH = B * H if packing is None else (packing.chunk_first.numel() - 1) * H
    BV = min(bv, max(16, triton.next_power_of_2(V)))
    init_states, init_norms = initial if initial is not None else (None, None)
    final_states, final_norms = final if final is not None else (None, None)
    cu, first, order = (None,) * 3 if packing is None else (packing.cu_seqlens, packing.chunk_first, packing.seq_order)
    _state_scan_kernel[(triton.cdiv(P, rows), triton.cdiv(V, BV), BH)](
        x, y, weights, states, norms, init_states, init_norms, final_states, final_norms, cu, first, order,
        T, H, V, scale, N,
        K=K, P=P, R=rows, BV=BV, C=chunk, REVERSE=reverse, DOT=operand_type(x.dtype), INITIAL=initial is not None,
        FINAL=final is not None, VARLEN=packing is not None, num_warps=warps, num_stages=1)
