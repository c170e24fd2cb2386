"""based-bwd's packed state scans in segments (the launch plans' scan_segment_chunks, `portable.states`): the
segment table `packing` builds on the device, and the fused path with the scans cut in segments of G chunks
against the same path scanning each sequence whole and against the independent float64 computations of
test_fused_state.py (the quadratic form, float64 autograd), from an initial state or none, with a final state or
none, over ragged packs (an empty sequence, one shorter than a segment, one of several segments).

Under TRITON_INTERPRET=1 the kernels run on tiny CPU tensors with fp32 inputs (IEEE fp32 matmuls). A segment's
start is the sum of the segments' totals before it, each summed from zero, where the whole scan adds the chunks
one by one: the same terms regrouped, so the two paths agree to fp32 rounding, not bit for bit."""

import pytest
import torch

from testkit import INTERPRETED, needs_cuda, needs_triton, rel_err, submodule
from test_based_state import lengths_to_cu, make, prefix_state
from test_fused_state import BF16_TOL, EXACT_TOL, TRITON_DEVICE, check_against_float64, issue_lengths

H, K, V = 1, 8, 8
CHUNK = 64  # the default plans' chunk
RAGGED = [65, 0, 1, 130, 260]  # 2, 0, 1, 3 and 5 chunks of 64
# Regrouped fp32 sums over a few hundred steps: a few ulps of the largest partial sums, relative Frobenius
REGROUPED_TOL = 1e-6


@pytest.fixture(scope="module")
def states(based):
    return submodule(based, "portable.states")


def segmented(dispatch, K, segment_chunks):
    """The default forward and backward plans at K with the packed scans in segments of segment_chunks chunks."""
    return tuple(plan[K]._replace(scan_segment_chunks=segment_chunks)
                 for plan in (dispatch.DEFAULT_FORWARD_CONFIG, dispatch.DEFAULT_BACKWARD_CONFIG))


def fused_outputs(dispatch, q, k, v, state, cu, scale, final, configs):
    """[o, S, z, dq, dk, dv, dS0, dz0] of the fused path under the plans `configs` for a loss weighing o and
    (with `final`) the final state: S, z only with `final`, dS0, dz0 only from a given state."""
    N, H, K = cu.numel() - 1, q.shape[2], q.shape[3]
    gen = torch.Generator().manual_seed(5)
    shapes = (v.shape, (N, H, 1 + K + K * K, v.shape[-1]), (N, H, 1 + K + K * K))
    w_o, w_S, w_z = (torch.randn(shape, generator=gen).to(q.device) for shape in shapes)
    o, end = dispatch.portable_state_forward(q, k, v, scale, state, cu, final, configs[0])
    *grads, d_initial = dispatch.portable_state_backward(q, k, v, w_o.to(q.dtype), (w_S, w_z) if final else None,
                                                         scale, state, cu, configs[1])
    return [o, *(end or ()), *grads, *(d_initial or ())]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_cuda)])
def test_packing_segment_table(states, device):
    """The segment table against its definition: sequence n's max(1, ceil(chunks_n / G)) segments numbered
    sequence by sequence, each row (sequence, place), (0, -1) past the last, within the host bound chunks // G + N;
    the chunk table as without segments."""
    cu = lengths_to_cu(RAGGED).to(device)
    whole = states.packing(cu, sum(RAGGED), CHUNK)
    assert whole.segment_index is None and whole.segment_chunks is None
    for G in (1, 2, 3, 64):
        pack = states.packing(cu, sum(RAGGED), CHUNK, G)
        for name in ("cu_seqlens", "chunk_first", "chunk_index", "seq_order"):
            assert torch.equal(getattr(pack, name), getattr(whole, name)), name
        assert pack.chunks == whole.chunks and pack.segment_chunks == G
        want = []
        for n, length in enumerate(RAGGED):
            chunks = -(-length // CHUNK)
            want += [(n, j) for j in range(max(1, -(-chunks // G)))]
        assert pack.segments == whole.chunks // G + len(RAGGED) >= len(want)
        want += [(0, -1)] * (pack.segments - len(want))
        assert pack.segment_index.dtype == torch.int32 and pack.segment_index.device == cu.device
        assert pack.segment_index.tolist() == [list(w) for w in want]
    with pytest.raises(ValueError, match="segment_chunks"):
        states.packing(cu, sum(RAGGED), CHUNK, 0)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_cuda)])
def test_packing_clamps_offsets_into_the_packed_rows(states, device):
    """Offsets outside [0, T] or decreasing (which a GPU call does not check on the host) make the packing of the
    offsets clamped into [0, T] and raised to their running maximum: chunk tables within the host bound, every chunk
    inside the packed rows."""
    T = sum(RAGGED)
    bad = torch.tensor([-5, 65, 40, 200, T + 9, 300], device=device)
    fixed = torch.tensor([0, 65, 65, 200, T, T], device=device)
    got, want = states.packing(bad, T, CHUNK), states.packing(fixed, T, CHUNK)
    for name in ("cu_seqlens", "chunk_first", "chunk_index", "seq_order"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    assert got.chunks == want.chunks >= int(got.chunk_first[-1])


def test_gpu_offsets_are_not_read_on_the_host(based):
    """On a device other than the CPU, cu_seqlens' values are not read (no device sync): tensors on the meta device,
    which hold no values, pass the check with their shape's N; on the CPU the values are checked."""
    validation = submodule(based, "validation")
    q = torch.empty(1, 16, 2, 8, device="meta")
    assert validation.check_cu_seqlens(q, torch.empty(4, dtype=torch.int32, device="meta")) == 3
    with pytest.raises(ValueError, match="non-decreasing"):
        validation.check_cu_seqlens(torch.empty(q.shape), torch.tensor([0, 9, 4, 16]))


@pytest.mark.skipif(not INTERPRETED, reason="IEEE fp32 matmuls check the kernels' algebra in the interpreter")
@pytest.mark.parametrize("G,initial,final", [(1, True, True), (2, True, False), (2, False, True), (1, False, False)])
def test_segmented_scan_matches_whole_scan(dispatch, G, initial, final):
    """Segments of G chunks (every sequence of more than G chunks cut; the one of 5 chunks in 3 segments at G = 2,
    the last one short) give the whole scan's o, final state and every gradient, the initial state's included, to
    fp32 rounding; each of G = 1 and 2 from an initial state and from none, with a final state and without."""
    cu = lengths_to_cu(RAGGED)
    q, k, v = make(1, sum(RAGGED), H, K, V)
    state = prefix_state(len(RAGGED), H, K, V) if initial else None
    whole = fused_outputs(dispatch, q, k, v, state, cu, 0.3, final, (None, None))
    got = fused_outputs(dispatch, q, k, v, state, cu, 0.3, final, segmented(dispatch, K, G))
    assert len(got) == len(whole) == 4 + 2 * final + 2 * initial
    for a, b in zip(got, whole):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert rel_err(a, b) < REGROUPED_TOL


@pytest.mark.skipif(not INTERPRETED, reason="IEEE fp32 matmuls check the kernels' algebra in the interpreter")
@pytest.mark.parametrize("K,G", [(8, 1), (8, 2), (16, 2)])
def test_segmented_scan_matches_float64(dispatch, K, G):
    """In segments, from each sequence's own initial state: o, the final state and every gradient against the
    float64 quadratic form and its autograd."""
    cu = lengths_to_cu(RAGGED)
    q, k, v = make(1, sum(RAGGED), H, K, V)
    check_against_float64(dispatch, q, k, v, prefix_state(len(RAGGED), H, K, V), cu, K**-0.5, EXACT_TOL,
                          segmented(dispatch, K, G))


@pytest.mark.skipif(not INTERPRETED, reason="IEEE fp32 matmuls check the kernels' algebra in the interpreter")
@pytest.mark.parametrize("G", [None, 2])
def test_scan_of_16_feature_rows_matches_float64(dispatch, G):
    """The scans with 16 feature rows a program (ten programs a sequence and head at K = 16; a plan the benchmark
    times on the packed batch), whole and in segments of 2 chunks: against float64."""
    cu = lengths_to_cu(RAGGED)
    q, k, v = make(1, sum(RAGGED), H, 16, V)
    configs = tuple(plan._replace(scan_rows=16) for plan in segmented(dispatch, 16, G))
    check_against_float64(dispatch, q, k, v, prefix_state(len(RAGGED), H, 16, V), cu, 0.25, EXACT_TOL, configs)


@needs_triton
def test_segmented_scan_16bit(dispatch):
    """bf16 inputs in segments of one chunk (bf16 states and operands): against float64."""
    lengths = [100, 0, 29, 200]
    cu = lengths_to_cu(lengths).to(TRITON_DEVICE)
    q, k, v = make(1, sum(lengths), 2, 16, 16, torch.bfloat16, TRITON_DEVICE)
    state = prefix_state(len(lengths), 2, 16, 16, device=TRITON_DEVICE)
    check_against_float64(dispatch, q, k, v, state, cu, 0.25, BF16_TOL, segmented(dispatch, 16, 1))


@needs_cuda
@pytest.mark.parametrize("Vc", [64, 128])
def test_segmented_scan_at_issue_sizes_on_cuda(dispatch, Vc):
    """16 random lengths summing to 65536, (H, K, V) = (16, 16, V), bf16, from an initial state, in segments of
    16 chunks: o, the final state and every gradient as the whole scan's, to the rounding of bf16 chunk states
    (the regrouped fp32 sums round to bf16 one ulp apart here and there)."""
    lengths = issue_lengths(Vc)
    cu = lengths_to_cu(lengths).cuda()
    q, k, v = make(1, sum(lengths), 16, 16, Vc, torch.bfloat16, "cuda")
    state = prefix_state(len(lengths), 16, 16, Vc, T=4, device="cuda")
    got = fused_outputs(dispatch, q, k, v, state, cu, 0.25, True, segmented(dispatch, 16, 16))
    whole = fused_outputs(dispatch, q, k, v, state, cu, 0.25, True, (None, None))
    for name, a, b in zip(["o", "S", "z", "dq", "dk", "dv", "dS0", "dz0"], got, whole):
        assert rel_err(a.float(), b.float()) < 5e-3, name
