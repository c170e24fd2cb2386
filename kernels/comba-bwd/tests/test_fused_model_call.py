"""The fused path of a model's call: a carried state in and out, grouped value heads, V up to 512, packed sequences,
fla's read order and q/k/p L2 normalisation through the Triton kernels (`dispatch.comba_state_forward_cuda` /
`comba_state_backward_cuda`, on CPU tensors under the interpreter), and the registered model ops
(`comba_state_forward_op` / `comba_state_backward_op`): outputs, final states and the gradients of every input and of
the initial state against the independent float64 token recurrence (`recurrence64`); packed sequences equal to per-sequence calls bit for bit, garbage in one never reaching
another. On CUDA, `comba_attention` at fla's layer shapes and the issue's packed batch against the eager reference."""

import pytest
import torch

from testkit import HAS_CUDA, needs_cuda, needs_triton, rel_err, submodule
from test_model_interface import model_inputs, pack, recurrence64

NAMES = ("dq", "dk", "dv", "dp", "dbeta", "dg", "d_initial_state")
TRITON_DEVICE = "cuda" if HAS_CUDA else "cpu"


@pytest.fixture(scope="module")
def dispatch(comba):
    pytest.importorskip("triton")
    return submodule(comba, "dispatch")


def kernel_inputs(B, T, H, HV, K, V, seed, with_state=True, device=TRITON_DEVICE, unit_keys=True):
    """bf16 q, k, v, p, beta, fp32 g and state (`model_inputs`; k and p raw where not unit_keys), a gradient of o and
    of the final state, on `device`; the state scaled to the size a few hundred steps of unit keys leave."""
    x, state = model_inputs(B, T, H, HV, K, V, seed=seed, unit_keys=unit_keys)
    x = [t.to(device=device, dtype=torch.bfloat16) if i < 5 else t.to(device) for i, t in enumerate(x)]
    gen = torch.Generator().manual_seed(seed + 1)
    do = torch.randn(B, T, HV, V, generator=gen).to(device=device, dtype=torch.bfloat16)
    d_final = torch.randn(B, HV, K, V, generator=gen).to(device)
    return x, (0.3 * state).to(device) if with_state else None, do, d_final


def float64_model_grads(x, state, do, d_final, scale, read_order="decay_first", l2norm=False):
    """The gradients of <o, do> + <final state, d_final> with respect to q, k, v, p, beta, g and the initial state, by
    float64 autograd through `recurrence64` (the initial state's gradient None without a state)."""
    leaves = [t.detach().double().cpu().requires_grad_() for t in x]
    s64 = None if state is None else state.detach().double().cpu().requires_grad_()
    o, final = recurrence64(*leaves, scale, s64, read_order, l2norm)
    wrt = leaves if s64 is None else [*leaves, s64]
    grads = torch.autograd.grad((o * do.double().cpu()).sum() + (final * d_final.double().cpu()).sum(), wrt)
    return (*grads, None) if s64 is None else grads


SHAPES = [  # B, T, H, HV, K, V: T = 1, 63, 65, 130 with HV = 2H; B = 2 cut in two pieces; K = 128 cuts V in two;
    # V = 256 and 512: more V blocks in the scans (4 and 8 at K = 128) and in the output (2 and 4); K = 256: V = 64 in
    # four scan blocks and two blocks of the gradients' V loop
    (2, 1, 1, 2, 64, 64),
    (2, 63, 1, 2, 64, 64),
    (1, 65, 2, 4, 64, 128),
    (2, 130, 1, 2, 64, 64),
    (1, 64, 1, 2, 128, 128),
    (1, 70, 1, 2, 64, 256),
    (1, 66, 1, 1, 128, 512),
    (1, 70, 1, 2, 256, 64),
]


@needs_triton
@pytest.mark.kernels_ci
@pytest.mark.parametrize("shape", SHAPES)
def test_fused_state_and_grouped_heads_match_float64(dispatch, shape):
    """The forward (o, final state) and the backward (all six gradients and the initial state's) of the Triton
    kernels from a carried state with value heads grouped two to a key head."""
    x, state, do, d_final = kernel_inputs(*shape, seed=shape[1])
    scale = 0.9 * shape[4] ** -0.5
    o, final = dispatch.comba_state_forward_cuda(*x, state, scale, True)
    o64, final64 = recurrence64(*(t.cpu() for t in x), scale, state.cpu())
    assert o.dtype == torch.bfloat16 and final.dtype == torch.float32 and final.shape == state.shape
    assert rel_err(o, o64) < 1e-2 and rel_err(final, final64) < 1e-2
    grads = dispatch.comba_state_backward_cuda(*x, state, do, d_final, scale)
    assert [gr.shape for gr in grads] == [t.shape for t in (*x, state)]
    assert [gr.dtype for gr in grads] == [torch.bfloat16] * 5 + [torch.float32] * 2
    errs = {n: rel_err(a, b) for n, a, b in zip(NAMES, grads, float64_model_grads(x, state, do, d_final, scale))}
    assert all(e < 1e-2 for e in errs.values()), errs


@needs_triton
@pytest.mark.kernels_ci
def test_fused_grouped_heads_without_state_match_float64(dispatch):
    """Grouped value heads from a zero state, no final state asked: an empty state out and in the gradients; the
    backward with no final state's gradient is the gradient of <o, do> alone."""
    x, _, do, d_final = kernel_inputs(1, 70, 1, 3, 64, 64, seed=5, with_state=False)
    o, final = dispatch.comba_state_forward_cuda(*x, None, 0.125, False)
    assert final.numel() == 0
    assert rel_err(o, recurrence64(*(t.cpu() for t in x), 0.125)[0]) < 1e-2
    grads = dispatch.comba_state_backward_cuda(*x, None, do, None, 0.125)
    assert grads[6].numel() == 0
    ref = float64_model_grads(x, None, do, torch.zeros_like(d_final), 0.125)
    errs = {n: rel_err(a, b) for n, a, b in zip(NAMES[:6], grads, ref)}
    assert all(e < 1e-2 for e in errs.values()), errs


@needs_triton
@pytest.mark.kernels_ci
@pytest.mark.parametrize("K", [64, 256])
def test_fused_state_call_without_state_equals_the_plain_call(dispatch, K, monkeypatch):
    """The model's plan with no state and equal heads runs the plain call's kernels: the same o and gradients (the
    plain call's taken with the scan_terms and adjoint stages, as a model's call takes them, where it would form the
    terms in the scans' loops: `dispatch.Plan.local_terms`)."""
    plan = dispatch.plan
    monkeypatch.setattr(dispatch, "plan", lambda q, V, model=False: plan(q, V, model)._replace(local_terms=False))
    x, _, do, _ = kernel_inputs(1, 65, 2, 2, K, 64, seed=6, with_state=False)
    o, _ = dispatch.comba_state_forward_cuda(*x, None, 0.125, False)
    assert torch.equal(o, dispatch.comba_forward_cuda(*x, 0.125))
    grads = dispatch.comba_state_backward_cuda(*x, None, do, None, 0.125)
    assert all(torch.equal(a, b) for a, b in zip(grads, dispatch.comba_backward_cuda(*x, do, 0.125)))


FLA_SHAPES = [  # B, T, H, HV, K, V: fla's read order, the chunk transform's and the scans' read decay, dg's d gr
    (2, 63, 1, 2, 64, 64),
    (1, 130, 1, 2, 64, 128),
    (1, 70, 1, 1, 128, 256),
    (1, 65, 1, 1, 256, 64),
]


@needs_triton
@pytest.mark.kernels_ci
@pytest.mark.parametrize("shape", FLA_SHAPES)
def test_fused_fla_order_matches_float64(dispatch, shape):
    """fla's read order (the state read before the step's decay) through the Triton kernels from a carried state: o,
    the final state and all seven gradients against the float64 recurrence in that order."""
    x, state, do, d_final = kernel_inputs(*shape, seed=shape[1] + 1)
    scale = 0.9 * shape[4] ** -0.5
    o, final = dispatch.comba_state_forward_cuda(*x, state, scale, True, None, "fla")
    o64, final64 = recurrence64(*(t.cpu() for t in x), scale, state.cpu(), "fla")
    assert rel_err(o, o64) < 1e-2 and rel_err(final, final64) < 1e-2
    grads = dispatch.comba_state_backward_cuda(*x, state, do, d_final, scale, None, "fla")
    ref = float64_model_grads(x, state, do, d_final, scale, "fla")
    errs = {n: rel_err(a, b) for n, a, b in zip(NAMES, grads, ref)}
    assert all(e < 1e-2 for e in errs.values()), errs


@needs_triton
@pytest.mark.kernels_ci
def test_fused_fla_order_at_strong_decay(dispatch):
    """fla's order with steps of log-decay -30, -90 and -inf (a reset) beside mild ones: exp(-g) would overflow
    fp32 where the read's decay exp(gr_i - gc_j) stays <= 1. o, the final state and the gradients are finite and
    match the float64 recurrence (dg where g is finite), from which the spec's order is far."""
    x, state, do, d_final = kernel_inputs(1, 100, 1, 2, 64, 64, seed=17)
    g = x[5].clone()
    g[0, 10] = -30.0
    g[0, 40] = -90.0
    g[0, 75, 1] = -float("inf")
    x[5] = g
    o, final = dispatch.comba_state_forward_cuda(*x, state, 0.125, True, None, "fla")
    grads = dispatch.comba_state_backward_cuda(*x, state, do, d_final, 0.125, None, "fla")
    assert all(t.isfinite().all() for t in (o, final, *grads))
    x64 = [*x[:5], g.clamp_min(-104.0)]
    o64, final64 = recurrence64(*(t.cpu() for t in x64), 0.125, state.cpu(), "fla")
    assert rel_err(o, o64) < 1e-2 and rel_err(final, final64) < 1e-2
    assert rel_err(dispatch.comba_state_forward_cuda(*x, state, 0.125, True)[0], o64) > 3e-2
    ref = float64_model_grads(x64, state, do, d_final, 0.125, "fla")
    finite = g.isfinite().cpu()
    ref = [*ref[:5], torch.where(finite, ref[5], 0.0), ref[6]]
    got = [*grads[:5], torch.where(finite.to(grads[5].device), grads[5], 0.0), grads[6]]
    errs = {n: rel_err(a, b) for n, a, b in zip(NAMES, got, ref)}
    assert all(e < 1e-2 for e in errs.values()), errs


@needs_triton
@pytest.mark.kernels_ci
@pytest.mark.parametrize("shape,order", [((1, 70, 1, 2, 64, 64), "fla"), ((2, 65, 2, 2, 64, 64), "decay_first")])
def test_fused_l2norm_matches_float64(dispatch, shape, order):
    """q, k and p L2-normalised inside (raw keys of any norm, a zero row of k among them) through the Triton kernels,
    with grouped value heads (the group sum and the normalisation's backward in one launch) and with equal heads: o,
    the final state and all seven gradients against the float64 recurrence of the normalised keys, differentiated
    through the normalisation."""
    x, state, do, d_final = kernel_inputs(*shape, seed=21, unit_keys=False)
    x[1][0, 3] = 0.0
    scale = shape[4] ** -0.5
    o, final = dispatch.comba_state_forward_cuda(*x, state, scale, True, None, order, True)
    o64, final64 = recurrence64(*(t.cpu() for t in x), scale, state.cpu(), order, True)
    assert rel_err(o, o64) < 1e-2 and rel_err(final, final64) < 1e-2
    grads = dispatch.comba_state_backward_cuda(*x, state, do, d_final, scale, None, order, True)
    assert [gr.dtype for gr in grads] == [torch.bfloat16] * 5 + [torch.float32] * 2
    assert all(gr.isfinite().all() for gr in grads)
    ref = float64_model_grads(x, state, do, d_final, scale, order, l2norm=True)
    errs = {n: rel_err(a, b) for n, a, b in zip(NAMES, grads, ref)}
    assert all(e < 1e-2 for e in errs.values()), errs


def packed_kernel_inputs(lengths, H, HV, K, V, seed, device=TRITON_DEVICE, unit_keys=True):
    """`kernel_inputs` of len(lengths) sequences cut to `lengths` and packed along T of a batch of one (`pack`):
    (x, state, do, d_final, offsets), a state and a final state's gradient per sequence."""
    x, state, do, d_final = kernel_inputs(len(lengths), max(lengths), H, HV, K, V, seed, device=device,
                                          unit_keys=unit_keys)
    (*x, do), offsets = pack([*x, do], lengths)
    return x, state, do, d_final, offsets.to(device)


def sequence_rows(x, offsets, i):
    """Sequence i's rows (1, n, ...) of a packed (1, T, ...) tensor."""
    return x[:, offsets[i]:offsets[i + 1]]


@needs_triton
@pytest.mark.kernels_ci
@pytest.mark.parametrize("lengths,shape,order,l2norm", [((70, 1, 0, 64, 33), (1, 2, 64, 64), "decay_first", False),
                                                        ((70, 40), (1, 1, 128, 256), "decay_first", False),
                                                        ((65, 0, 9), (1, 2, 64, 128), "fla", False),
                                                        ((66, 9), (1, 1, 256, 64), "fla", False),
                                                        ((40, 0, 30), (1, 2, 64, 64), "fla", True)])
def test_fused_packed_sequences_equal_per_sequence_calls(dispatch, lengths, shape, order, l2norm):
    """Packed sequences (one empty, one of a single step, one of exactly a chunk) through the Triton kernels, q, k and
    p L2-normalised inside in one case: o, the final states and every gradient, the initial states' included, equal to
    each sequence's own call bit for bit (the same chunk layout, each sequence padded at its end), and within 1e-2 (dg
    2e-2) of the float64 recurrence; an empty sequence's final state is its initial state, its initial state's
    gradient the final state's."""
    x, state, do, d_final, offsets = packed_kernel_inputs(lengths, *shape, seed=12, unit_keys=not l2norm)
    scale = shape[2] ** -0.5
    o, final = dispatch.comba_state_forward_cuda(*x, state, scale, True, offsets, order, l2norm)
    grads = dispatch.comba_state_backward_cuda(*x, state, do, d_final, scale, offsets, order, l2norm)
    assert o.shape == x[2].shape and final.shape == state.shape
    assert [gr.shape for gr in grads] == [t.shape for t in (*x, state)]
    for i, n in enumerate(lengths):
        if n == 0:
            assert torch.equal(final[i], state[i]) and torch.equal(grads[6][i], d_final[i])
            continue
        one = [sequence_rows(t, offsets, i) for t in x]
        do_i, s_i, d_i = sequence_rows(do, offsets, i), state[i:i + 1], d_final[i:i + 1]
        o1, f1 = dispatch.comba_state_forward_cuda(*one, s_i, scale, True, None, order, l2norm)
        g1 = dispatch.comba_state_backward_cuda(*one, s_i, do_i, d_i, scale, None, order, l2norm)
        assert torch.equal(sequence_rows(o, offsets, i), o1) and torch.equal(final[i:i + 1], f1)
        got = [sequence_rows(gr, offsets, i) for gr in grads[:6]] + [grads[6][i:i + 1]]
        assert all(torch.equal(a, b) for a, b in zip(got, g1)), i
        o64, f64 = recurrence64(*(t.cpu() for t in one), scale, s_i.cpu(), order, l2norm)
        assert rel_err(o1, o64) < 1e-2 and rel_err(f1, f64) < 1e-2
        ref = float64_model_grads(one, s_i, do_i, d_i, scale, order, l2norm)
        errs = {n: rel_err(a, b) for n, a, b in zip(NAMES, g1, ref)}
        # dg sums terms that nearly cancel: 1e-2 for the other gradients, 2e-2 for dg, at bf16
        assert all(e < (2e-2 if n == "dg" else 1e-2) for n, e in errs.items()), (i, errs)


@needs_triton
@pytest.mark.kernels_ci
def test_packing_lays_out_each_sequence_on_chunks_of_its_own(comba):
    """`pipeline.Packing.of`: each sequence on whole chunks of 64 from its first row (an empty one on none), its last
    chunk ending with it, the chunks past the last sequence's holding no rows (T, T), up to the host-side bound
    (T + N 63) // 64 on the count; made on the offsets' device from shapes alone, so offsets on the meta device, which
    hold no values, give tables of the same shapes."""
    pipeline = submodule(comba, "pipeline")
    lengths = (70, 0, 1, 64, 130)
    T = sum(lengths)
    offsets = torch.tensor([0, *lengths]).cumsum(0)
    packing = pipeline.Packing.of(offsets.to(torch.int32), T)
    want, first_chunk = [], [0]
    for start, n in zip(offsets.tolist(), lengths):
        want += [[t, min(t + 64, start + n)] for t in range(start, start + n, 64)]
        first_chunk.append(len(want))
    assert packing.chunks == (T + len(lengths) * 63) // 64 >= len(want)
    assert packing.cu_chunks.tolist() == first_chunk and packing.sequences == len(lengths)
    assert packing.layout.tolist() == want + [[T, T]] * (packing.chunks - len(want))
    assert packing.layout.dtype == packing.cu_chunks.dtype == torch.int32
    meta = pipeline.Packing.of(torch.empty(len(lengths) + 1, dtype=torch.int64, device="meta"), T)
    assert meta.chunks == packing.chunks and meta.layout.shape == packing.layout.shape
    assert meta.cu_chunks.shape == packing.cu_chunks.shape


@needs_triton
@pytest.mark.kernels_ci
def test_fused_packed_call_takes_offsets_bounded(dispatch):
    """Offsets outside [0, T] or decreasing, which a GPU call does not read on the host, run as those offsets clamped
    into [0, T] and raised to their running maximum (`common.checks.bounded_offsets`): o and the final states bit for
    bit those of the bounded offsets' call, every read and write inside the packed rows."""
    x, state, _, _, offsets = packed_kernel_inputs((70, 40, 30), 1, 2, 64, 64, seed=14)
    T = x[0].shape[1]
    bad = torch.tensor([-5, 90, 60, T + 9], device=offsets.device)
    fixed = torch.tensor([0, 90, 90, T], device=offsets.device)
    got = dispatch.comba_state_forward_cuda(*x, state, 0.125, True, bad)
    want = dispatch.comba_state_forward_cuda(*x, state, 0.125, True, fixed)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert torch.equal(got[1][1], state[1])  # the empty sequence passes its state through


@needs_triton
@pytest.mark.kernels_ci
@pytest.mark.parametrize("i,value", [(2, float("nan")), (1, 1e30)])
def test_fused_garbage_in_one_packed_sequence_stays_there(dispatch, i, value):
    """A NaN in v, or a huge k, at one step of the middle sequence: o, the final states and every gradient of the
    other sequences are bit for bit those of the clean call."""
    x, state, do, d_final, offsets = packed_kernel_inputs((70, 40, 30), 1, 2, 64, 64, seed=13)
    bad = [t.clone() for t in x]
    bad[i][0, offsets[1] + 20] = value
    runs = []
    for inputs in (x, bad):
        o, final = dispatch.comba_state_forward_cuda(*inputs, state, 0.125, True, offsets)
        grads = dispatch.comba_state_backward_cuda(*inputs, state, do, d_final, 0.125, offsets)
        runs.append((o, *grads[:6], final, grads[6]))
    for s in (0, 2):
        for clean, got in zip(*runs):
            if clean.shape[0] == 1:   # per step: the sequence's rows
                clean, got = sequence_rows(clean, offsets, s), sequence_rows(got, offsets, s)
            else:                     # per sequence: its state
                clean, got = clean[s], got[s]
            assert torch.equal(clean, got), s
    assert not torch.equal(sequence_rows(runs[0][0], offsets, 1), sequence_rows(runs[1][0], offsets, 1))


@pytest.mark.kernels_ci
@pytest.mark.parametrize("with_state,final,l2norm", [(True, True, False), (False, True, False), (True, False, False),
                                                     (True, True, True)])
def test_model_op_opcheck(comba, with_state, final, l2norm):
    x, state, do, d_final = kernel_inputs(1, 70, 1, 2, 16, 8, seed=7, with_state=with_state, device="cpu")
    flags = (None, "decay_first", True) if l2norm else ()
    torch.library.opcheck(comba.op.comba_state_forward_op, (*x, state, 0.25, final, *flags))
    torch.library.opcheck(comba.op.comba_state_backward_op, (*x, state, do, d_final if final else None, 0.25, *flags))


@pytest.mark.kernels_ci
@pytest.mark.parametrize("order", ["decay_first", "fla"])
def test_packed_model_op_opcheck(comba, order):
    x, state, do, d_final, offsets = packed_kernel_inputs((70, 0, 9), 1, 2, 16, 8, seed=14, device="cpu")
    torch.library.opcheck(comba.op.comba_state_forward_op, (*x, state, 0.25, True, offsets, order))
    torch.library.opcheck(comba.op.comba_state_backward_op, (*x, state, do, d_final, 0.25, offsets, order))


@pytest.mark.kernels_ci
@pytest.mark.parametrize("order", ["decay_first", "fla"])
def test_packed_model_op_trains_every_sequence(comba, order):
    """Autograd through the registered model op (its CPU kernels: the analytic chunked backward) on packed sequences
    in either read order: every input's gradient and the initial states', through o and the final states, against
    float64 sequence by sequence."""
    x, state, do, d_final, offsets = packed_kernel_inputs((70, 9, 64), 1, 2, 16, 8, seed=15, device="cpu")
    x = [t.float() for t in x]
    leaves = [t.clone().requires_grad_() for t in (*x, state)]
    o, final = comba.op.comba_state_forward_op(*leaves[:6], leaves[6], 0.25, True, offsets, order)
    got = torch.autograd.grad((o * do.float()).sum() + (final * d_final).sum(), leaves)
    for i in range(3):
        one = [sequence_rows(t, offsets, i) for t in x]
        ref = float64_model_grads(one, state[i:i + 1], sequence_rows(do, offsets, i), d_final[i:i + 1], 0.25, order)
        mine = [sequence_rows(gr, offsets, i) for gr in got[:6]] + [got[6][i:i + 1]]
        errs = {n: rel_err(a, b) for n, a, b in zip(NAMES, mine, ref)}
        assert all(e < 1e-4 for e in errs.values()), (i, errs)


@pytest.mark.kernels_ci
@pytest.mark.parametrize("l2norm", [False, True])
def test_model_op_trains_the_state_and_grouped_heads(comba, l2norm):
    """Autograd through the registered model op (its CPU kernels): every input's gradient and the initial state's,
    through o and the final state, against float64, with q, k and p L2-normalised inside or not."""
    x, state, do, d_final = kernel_inputs(2, 70, 1, 2, 16, 8, seed=8, device="cpu", unit_keys=not l2norm)
    x = [t.float() for t in x]
    leaves = [t.clone().requires_grad_() for t in (*x, state)]
    o, final = comba.op.comba_state_forward_op(*leaves[:6], leaves[6], 0.25, True, None, "decay_first", l2norm)
    got = torch.autograd.grad((o * do.float()).sum() + (final * d_final).sum(), leaves)
    ref = float64_model_grads(x, state, do, d_final, 0.25, l2norm=l2norm)
    errs = {n: rel_err(a, b) for n, a, b in zip(NAMES, got, ref)}
    assert all(e < 1e-4 for e in errs.values()), errs


# ---------------------------------------------------------------- comba_attention on CUDA


def reference_step(comba, x, state, do, d_final, **kwargs):
    """o, final state and the gradients of the eager reference (fp32, autograd) of the same call."""
    leaves = [t.detach().clone().requires_grad_() for t in (*x, state)]
    o, final = comba.reference.comba_forward_reference(*leaves[:6], initial_state=leaves[6], output_final_state=True,
                                                       **kwargs)
    grads = torch.autograd.grad((o.float() * do.float()).sum() + (final * d_final).sum(), leaves)
    return o, final, grads


@needs_cuda
@pytest.mark.parametrize("shape,l2norm,order", [
    ((4, 4096, 6, 6, 128, 128), False, "decay_first"), ((2, 1000, 4, 8, 128, 64), True, "decay_first"),
    ((2, 577, 2, 4, 64, 128), False, "decay_first"), ((2, 1000, 4, 8, 128, 256), True, "decay_first"),
    ((1, 777, 2, 2, 64, 512), False, "decay_first"), ((1, 600, 2, 4, 128, 512), False, "decay_first"),
    ((4, 4096, 6, 6, 128, 128), True, "fla"), ((2, 1000, 4, 8, 128, 256), True, "fla"),
    ((1, 777, 2, 4, 64, 512), False, "fla"), ((2, 1000, 6, 6, 256, 512), True, "fla"),
    ((2, 577, 2, 4, 256, 128), False, "decay_first"), ((1, 300, 2, 2, 256, 64), True, "decay_first"),
])
def test_cuda_model_call_with_state_matches_the_reference(comba, shape, l2norm, order):
    """comba_attention on CUDA (the fused kernels) at fla's layer shapes with a state (K = 256, V = 512 its default),
    and grouped heads with the q/k/p normalisation, in either read order, against the eager reference: o, the final
    state and all seven gradients within 2e-2."""
    x, state, do, d_final = kernel_inputs(*shape, seed=9, device="cuda")
    leaves = [t.detach().clone().requires_grad_() for t in (*x, state)]
    o, final = comba.comba_attention(*leaves[:6], initial_state=leaves[6], output_final_state=True,
                                     use_qk_l2norm=l2norm, read_order=order)
    got = torch.autograd.grad((o.float() * do.float()).sum() + (final * d_final).sum(), leaves)
    o_ref, final_ref, ref = reference_step(comba, x, state, do, d_final, use_qk_l2norm=l2norm, read_order=order)
    assert rel_err(o, o_ref) < 2e-2 and rel_err(final, final_ref) < 2e-2
    errs = {n: rel_err(a, b) for n, a, b in zip(NAMES, got, ref)}
    assert all(e < 2e-2 for e in errs.values()), errs


@needs_cuda
@pytest.mark.parametrize("shape,l2norm,order", [((8, 16, 128, 256), True, "fla"),
                                                ((8, 16, 128, 256), False, "decay_first"),
                                                ((2, 4, 64, 512), False, "fla"),
                                                ((2, 2, 256, 512), True, "fla")])
def test_cuda_packed_call_matches_the_reference(comba, shape, l2norm, order):
    """comba_attention on CUDA with packed sequences (the fused kernels) at the issue's packed shape (H, HV, K, V) =
    (8, 16, 128, 256), 8 sequences of random lengths, and at V = 512 (K = 64 and 256), in either read order, against
    the eager reference: o, the final states and all seven gradients within 2e-2."""
    gen = torch.Generator().manual_seed(16)
    lengths = (torch.rand(8, generator=gen) * 1500).long().add(1).tolist()
    x, state, do, d_final, offsets = packed_kernel_inputs(lengths, *shape, seed=16, device="cuda")
    leaves = [t.detach().clone().requires_grad_() for t in (*x, state)]
    o, final = comba.comba_attention(*leaves[:6], initial_state=leaves[6], output_final_state=True,
                                     cu_seqlens=offsets, use_qk_l2norm=l2norm, read_order=order)
    got = torch.autograd.grad((o.float() * do.float()).sum() + (final * d_final).sum(), leaves)
    o_ref, final_ref, ref = reference_step(comba, x, state, do, d_final, cu_seqlens=offsets, use_qk_l2norm=l2norm,
                                           read_order=order)
    assert rel_err(o, o_ref) < 2e-2 and rel_err(final, final_ref) < 2e-2
    errs = {n: rel_err(a, b) for n, a, b in zip(NAMES, got, ref)}
    assert all(e < 2e-2 for e in errs.values()), errs
