"""The forward scan in Gluon on Hopper, V = 128 and K = 128 or 64: one CTA a (b, h) over all of V, of one warpgroup for
each 64 of K, where the Triton scan (`portable.forward_scan._forward_scan_kernel`) runs V blocks of 4 warps. Same
outputs as that scan with one V block: S_n (bf16, the state before chunk n) and Vn.

Per chunk n, S (fp32 [K, V]) in registers:
  U = (A diag(beta)) V,  -W = (A diag(-beta gam)) P           [64, V], [64, K]  (A scaled by column in registers)
  Vn = U + (-W) S_b                                           [64, V]   -> shared memory (bf16), TMA store
  S = Gam S + (K Gam/gam)^T Vn                                [K, V]
A's columns are scaled in fp32 before its rounding to bf16 (the Triton scan scales V's and P's rows), so that the
products' B operands come from shared memory as the TMA copies left them. S_n goes out in bf16 from shared memory
(the B operand of -W S_b) by a TMA store, and the next chunk's k, p, v and A tiles are copied by TMA while one is
computed (two stages, 172 KB of shared memory: one CTA an SM). U and -W are issued asynchronously before S_n's store,
which they do not wait on. The scan is faster than the Triton one at both K. At K = 128 a CTA takes a whole SM, so
the two scans of a batch piece, on two streams, cannot share an SM: the scan pays in the one-piece backward that runs
there (`dispatch.plan`), not in a backward of two pieces.

At K = 64 one warpgroup holds the state without spilling, and A has one buffer of its own, copied once the previous
chunk's A is in registers, so that the tiles take 112 KB and two CTAs share an SM (two A buffers would leave one).

The next chunk's gates are loaded a chunk ahead: loaded with the chunk, they are needed as soon as they are issued,
and their latency sits on the serial chunk path.

A TMA store is issued by one thread, so a wait on the stores holds that thread alone: a barrier after it keeps the
other warps from writing a buffer that a store issued in the previous chunk may not have read yet.

A non-finite input at step t reaches no row of Vn before t, as in `portable.forward_scan`. The chunk transform makes A
NaN from the chunk's first non-finite k, p, beta or g on; v and p reach A's products unguarded (as the TMA copies leave
them), so a non-finite one makes Vn non-finite in every row. The loop therefore reads Vn's checksum, its sum, while the
state's product runs, and stops at the first chunk whose Vn comes out non-finite, without storing that Vn: after the
loop that chunk's Vn is made again from the finite part of its v and p (zeroed in their stage) and of the column scales,
NaN from v's first row holding a non-finite entry on, and every later chunk's S_n and Vn is stored NaN, as the state
after the chunk is NaN. On a clean chunk the guard is that sum and a branch.

N is not specialized (one compile serves every T), and must not be: Triton specializes an integer argument equal to
1, and compiled with N = 1 (T one chunk) the scan at K = 64 gives a wrong Vn.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from ..common import gluon_compat as compat
from .chunk import BT, chunk_gates, finite_or_zero, gate_loads, gates, scal_base
from ..reference import CHUNK


@gluon.jit
def _issue(k_desc, p_desc, v_desc, a_desc, k_s, p_s, v_s, a_s, bar, row, hk, hv, a_row, pred, WITH_A: gl.constexpr):
    """Start the copies of one chunk's k, p, v and (WITH_A) A tiles into one stage (where pred)."""
    nbytes: gl.constexpr = (2 * k_desc.block_type.nbytes + v_desc.block_type.nbytes
                            + WITH_A * a_desc.block_type.nbytes)
    mbarrier.expect(bar, nbytes, pred=pred)
    compat.tma_load(k_desc, [row, hk], bar, k_s, pred)
    compat.tma_load(p_desc, [row, hk], bar, p_s, pred)
    compat.tma_load(v_desc, [row, hv], bar, v_s, pred)
    if WITH_A:
        compat.tma_load(a_desc, [a_row, 0], bar, a_s, pred)


@gluon.jit
def _issue_a(a_desc, a_s, bar, a_row, pred):
    """Start the copy of one chunk's A tile into its own buffer (where pred)."""
    mbarrier.expect(bar, a_desc.block_type.nbytes, pred=pred)
    compat.tma_load(a_desc, [a_row, 0], bar, a_s, pred)


@gluon.jit
def _finite_tile(x_s, layout: gl.constexpr):
    """The first row of the [BT, D] tile in shared memory x_s holding a non-finite entry (BT if none), after zeroing
    those entries there; by blocks of 16 rows, so that few registers hold it."""
    edge = gl.to_tensor(BT)
    for i in gl.static_range(BT // 16):
        x_b = x_s.slice(16 * i, 16, 0)
        x = x_b.load(layout)
        finite = gl.abs(x) < float("inf")
        x_b.store(gl.where(finite, x, 0.0).to(x.dtype))
        rows = 16 * i + gl.arange(0, 16, layout=gl.SliceLayout(1, layout))
        edge = gl.minimum(edge, gl.min(gl.min(gl.where(finite, BT, rows[:, None]), 1), 0))
    return edge


@gluon.jit
def _guarded_vn(A, v_s, p_s, sb_s, a_row, bk, gam, a_tv: gl.constexpr, a_tk: gl.constexpr, acc_tv: gl.constexpr,
                acc_tk: gl.constexpr, blk: gl.constexpr, K: gl.constexpr, V: gl.constexpr):
    """Vn of a chunk holding a non-finite input, as `portable.forward_scan` makes it: A's products take the finite part
    of v and p (zeroed in the stage's tiles) and of A's column scales beta and -beta gam, and Vn is NaN from v's first
    row holding a non-finite entry on (A is NaN from the chunk's first non-finite k, p, beta or g on). A is read again
    from HBM: at K = 64 its buffer holds the next chunk's."""
    compat.barrier()  # no warp reads the stage's v and p tiles any more
    v_edge = _finite_tile(v_s, blk)
    _finite_tile(p_s, blk)
    r = gl.arange(0, BT, layout=gl.SliceLayout(1, blk))
    c = gl.arange(0, BT, layout=gl.SliceLayout(0, blk))
    a_f = gl.load(A + (a_row.to(gl.int64) + r)[:, None] * BT + c[None, :]).to(gl.float32)
    fence_async_shared()
    compat.barrier()
    a_u = gl.convert_layout((a_f * finite_or_zero(bk)[None, :]).to(v_s.dtype), a_tv)
    a_w = gl.convert_layout((a_f * finite_or_zero(-(bk * gam))[None, :]).to(v_s.dtype), a_tk)
    w = warpgroup_mma(a_w, p_s, gl.zeros([BT, K], gl.float32, acc_tk))
    w = gl.convert_layout(w.to(v_s.dtype), a_tv)
    vn = warpgroup_mma(a_u, v_s, gl.zeros([BT, V], gl.float32, acc_tv))
    vn = warpgroup_mma(w, sb_s, vn)
    rows = gl.arange(0, BT, layout=gl.SliceLayout(1, acc_tv))
    return gl.where(rows[:, None] >= v_edge, float("nan"), vn)


@gluon.jit
def _guarded_tail(A, beta, g, bad, N, H, bh, base, v_s, p_s, sb_s, vn_s, bars, a_bar, s_desc, vn_desc,
                  a_tv: gl.constexpr, a_tk: gl.constexpr, acc_tv: gl.constexpr, acc_tk: gl.constexpr,
                  blk: gl.constexpr, K: gl.constexpr, V: gl.constexpr, A_STAGES: gl.constexpr):
    """After the loop stopped at chunk `bad`, whose Vn came out non-finite (its tiles still in their stage, S_n in
    sb_s): its Vn guarded (`_guarded_vn`), and NaN for every later chunk's S_n and Vn, as the Triton scan makes them
    (its state after the chunk is NaN)."""
    if bad + 1 < N:  # the next chunk's copies, in flight
        mbarrier.wait(bars.index(1 - bad % 2), ((bad + 1) // 2) & 1)
        if A_STAGES == 1:
            mbarrier.wait(a_bar, (bad + 1) & 1)
    gc, _, bk = gates(g, beta, base, bad * BT, H)
    vn = _guarded_vn(A, v_s, p_s, sb_s, (bh * N + bad) * BT, gl.convert_layout(bk, gl.SliceLayout(0, blk)),
                     gl.exp(gl.convert_layout(gc, gl.SliceLayout(0, blk))), a_tv, a_tk, acc_tv, acc_tk, blk, K, V)
    vn_s.store(vn.to(vn_s.dtype))
    fence_async_shared()
    compat.barrier()
    compat.tma_store(vn_desc, [bh * N * BT + bad * BT, 0], vn_s)
    tma.store_wait(0)
    compat.barrier()
    vn_s.store(gl.full([BT, V], float("nan"), vn_s.dtype, blk))
    sb_s.store(gl.full([K, V], float("nan"), sb_s.dtype, blk))
    fence_async_shared()
    compat.barrier()
    for m in range(bad + 1, N):
        compat.tma_store(s_desc, [(bh * N + m) * K, 0], sb_s)
        compat.tma_store(vn_desc, [bh * N * BT + m * BT, 0], vn_s)
    tma.store_wait(0)


@gluon.jit(do_not_specialize=["N"])
def _forward_scan_gluon_kernel(k_desc, p_desc, v_desc, a_desc, s_desc, vn_desc, A, beta, g, N, H, K: gl.constexpr,
                               V: gl.constexpr, WG: gl.constexpr, A_STAGES: gl.constexpr):
    bh = gl.program_id(0)
    b = bh // H
    h = bh % H
    T = N * BT
    base = scal_base(b, h, N, H)
    dtype: gl.constexpr = k_desc.dtype

    # Accumulator layouts: [K, V] (the state) with the WG warpgroups along M, [64, V] and [64, K] along N.
    acc_kv: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4 * WG, 1], instr_shape=[16, V, 16])
    acc_tv: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, WG],
                                                     instr_shape=[16, V // WG, 16])
    acc_tk: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, WG],
                                                     instr_shape=[16, K // WG, 16])
    a_tv: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_tv, k_width=2)
    a_tk: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_tk, k_width=2)
    a_kv: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_kv, k_width=2)
    blk: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4 * WG, 1], [1, 0])
    blk_t: gl.constexpr = gl.BlockedLayout([8, 1], [8, 4], [1, 4 * WG], [0, 1])

    k_s = gl.allocate_shared_memory(dtype, [2, BT, K], k_desc.layout)
    p_s = gl.allocate_shared_memory(dtype, [2, BT, K], p_desc.layout)
    v_s = gl.allocate_shared_memory(dtype, [2, BT, V], v_desc.layout)
    a_s = gl.allocate_shared_memory(dtype, [A_STAGES, BT, BT], a_desc.layout)  # in the stages, or alone
    sb_s = gl.allocate_shared_memory(dtype, [K, V], s_desc.layout)
    vn_s = gl.allocate_shared_memory(dtype, [BT, V], vn_desc.layout)
    N_BARS: gl.constexpr = 4 - A_STAGES  # the two stages', and A's where it has a buffer of its own
    bars = gl.allocate_shared_memory(gl.int64, [N_BARS, 1], mbarrier.MBarrierLayout())
    for st in gl.static_range(N_BARS):
        mbarrier.init(bars.index(st), count=1)
    a_bar = bars.index(N_BARS - 1)  # used where A_STAGES == 1 only

    row0 = b * T
    hk = h * K
    hv = h * V
    _issue(k_desc, p_desc, v_desc, a_desc, k_s.index(0), p_s.index(0), v_s.index(0), a_s.index(0), bars.index(0),
           row0, hk, hv, bh * N * BT, True, A_STAGES == 2)
    if A_STAGES == 1:
        _issue_a(a_desc, a_s.index(0), a_bar, bh * N * BT, True)

    S = gl.zeros([K, V], gl.float32, acc_kv)
    gj, beta_rows = gate_loads(g, beta, base, 0, H)
    n = gl.to_tensor(0)
    bad = N  # the first chunk whose Vn comes out non-finite (N: none), the last the loop runs
    while n < bad:
        s = n % 2
        t0 = n * BT
        # The next chunk's tiles into the other stage, whose reads all ended with the previous iteration.
        nxt = gl.minimum(n + 1, N - 1)
        _issue(k_desc, p_desc, v_desc, a_desc, k_s.index(1 - s), p_s.index(1 - s), v_s.index(1 - s),
               a_s.index((1 - s) % A_STAGES), bars.index(1 - s), row0 + nxt * BT, hk, hv, (bh * N + nxt) * BT,
               n + 1 < N, A_STAGES == 2)
        gc, glast, bk = chunk_gates(gj, beta_rows)
        gj, beta_rows = gate_loads(g, beta, base, nxt * BT, H)  # the next chunk's, a chunk ahead
        mbarrier.wait(bars.index(s), (n // 2) & 1)

        # U and -W do not wait on S: they run while S_n goes to shared memory.
        bk_c = gl.convert_layout(bk, gl.SliceLayout(0, blk))
        gam_c = gl.exp(gl.convert_layout(gc, gl.SliceLayout(0, blk)))
        if A_STAGES == 1:
            mbarrier.wait(a_bar, n & 1)
        a_f = a_s.index(s % A_STAGES).load(blk).to(gl.float32)
        if A_STAGES == 1:
            compat.barrier()  # every warp has this chunk's A in registers: the next one may come
            _issue_a(a_desc, a_s.index(0), a_bar, (bh * N + nxt) * BT, n + 1 < N)
        u = warpgroup_mma(gl.convert_layout((a_f * bk_c[None, :]).to(dtype), a_tv), v_s.index(s),
                          gl.zeros([BT, V], gl.float32, acc_tv), is_async=True)
        w = warpgroup_mma(gl.convert_layout((a_f * -(bk_c * gam_c)[None, :]).to(dtype), a_tk), p_s.index(s),
                          gl.zeros([BT, K], gl.float32, acc_tk), is_async=True)
        # S_n in bf16 to shared memory once the previous chunk's stores have read it (and vn_s).
        tma.store_wait(0)
        compat.barrier()  # one thread issued the stores: its wait holds the other warps
        sb_s.store(S.to(dtype))
        fence_async_shared()
        compat.barrier()
        compat.tma_store(s_desc, [(bh * N + n) * K, 0], sb_s)
        w, u = warpgroup_mma_wait(0, deps=[w, u])
        vn = warpgroup_mma(gl.convert_layout(w.to(dtype), a_tv), sb_s, u)
        vn_s.store(vn.to(dtype))
        fence_async_shared()
        compat.barrier()

        gc_t = gl.convert_layout(gc, gl.SliceLayout(0, blk_t))
        k_t = k_s.index(s).permute((1, 0)).load(blk_t).to(gl.float32) * gl.exp(glast - gc_t)[None, :]
        S = warpgroup_mma(gl.convert_layout(k_t.to(dtype), a_kv), vn_s, S * gl.exp(glast), is_async=True)
        clean = gl.abs(gl.sum(gl.sum(vn, 1), 0)) < float("inf")  # Vn's checksum, while the state's product runs
        S = warpgroup_mma_wait(0, deps=[S])
        if clean:
            compat.tma_store(vn_desc, [bh * T + t0, 0], vn_s)
        compat.barrier()  # every warp is done with this stage's tiles before the next copy into it
        bad = gl.where(clean, bad, n)
        n += 1
    tma.store_wait(0)
    if bad < N:
        _guarded_tail(A, beta, g, bad, N, H, bh, base, v_s.index(bad % 2), p_s.index(bad % 2), sb_s, vn_s, bars, a_bar,
                      s_desc, vn_desc, a_tv, a_tk, acc_tv, acc_tk, blk, K, V, A_STAGES)
    for st in gl.static_range(N_BARS):
        mbarrier.invalidate(bars.index(st))


def launch(t, k, v, beta, g):
    """The scan over inputs (B, T, H, K) with T a multiple of the chunk, their Tiles `t`: writes S (BH, N, K, V) and
    Vn (BH, T, V), as `_forward_scan_kernel` with one V block."""
    B, T, H, K = k.shape
    V = v.shape[-1]
    wg = K // 64
    a_stages = 2 if wg == 2 else 1  # A in a buffer of its own at K = 64, so that two CTAs share an SM
    _forward_scan_gluon_kernel[(B * H,)](t.k, t.p, t.v, t.A, t.S, t.Vn, t.A.base, beta, g, T // CHUNK, H, K, V, wg,
                                         a_stages, num_warps=4 * wg)
