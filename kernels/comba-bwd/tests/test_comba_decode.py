"""`comba_decode` through `get_kernel` (CPU): a few new tokens after a carried state, against the float64
token-by-token recurrence and against the chunked `comba_attention`; token-by-token decoding equals one chunked call;
packed decode of many sequences; the state is returned, not modified; gradients; its limits."""

import pytest
import torch

from test_model_interface import ORDERS, model_inputs, pack, recurrence64
from testkit import HAS_CUDA, needs_cuda, needs_triton, rel_err, submodule


@pytest.mark.kernels_ci
@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("step", [1, 7, 64])
def test_decoding_in_steps_equals_one_chunked_call(comba, order, step):
    """A prompt of 70 tokens by `comba_attention`, then 130 more `step` at a time by `comba_decode`, carrying the
    state: the same outputs and final state as one chunked call on all 200, and as float64."""
    x, state = model_inputs(2, 200, 2, 4, 16, 8, seed=30, unit_keys=False)
    kwargs = {"use_qk_l2norm": True, "read_order": order}
    whole, final = comba.comba_attention(*x, initial_state=state, output_final_state=True, **kwargs)
    outs, S = comba.comba_attention(*[t[:, :70] for t in x], initial_state=state, output_final_state=True, **kwargs)
    outs = [outs]
    for t in range(70, 200, step):
        o, S = comba.comba_decode(*[u[:, t:t + step] for u in x], S, **kwargs)
        outs.append(o)
    assert rel_err(torch.cat(outs, 1), whole) < 1e-5 and rel_err(S, final) < 1e-5
    o64, f64 = recurrence64(*x, None, state, order, True)
    assert rel_err(torch.cat(outs, 1), o64) < 1e-5 and rel_err(S, f64) < 1e-5


@pytest.mark.kernels_ci
def test_packed_decode_of_one_token_per_sequence(comba):
    """The layout of fla's generate() on a padded batch: N sequences of one new token each, packed by cu_seqlens."""
    x, state = model_inputs(5, 1, 1, 2, 16, 8, seed=31)
    packed, offsets = pack(x, [1] * 5)
    o, new = comba.comba_decode(*packed, state, cu_seqlens=offsets, read_order="fla")
    o64, f64 = recurrence64(*x, None, state, "fla")
    assert o.shape == (1, 5, 2, 8) and rel_err(o[0], o64[:, 0]) < 1e-6 and rel_err(new, f64) < 1e-6


@pytest.mark.kernels_ci
def test_the_state_is_returned_not_modified_and_none_is_zeros(comba):
    x, state = model_inputs(1, 3, 1, 1, 16, 8, seed=32)
    before = state.clone()
    o, new = comba.comba_decode(*x, state)
    assert torch.equal(state, before) and not torch.equal(new, state)
    o0, _ = comba.comba_decode(*x)
    assert rel_err(o0, recurrence64(*x)[0]) < 1e-6


@pytest.mark.kernels_ci
def test_decode_gradients_match_float64(comba):
    x, state = model_inputs(1, 9, 2, 4, 16, 8, seed=33)
    leaves = [t.clone().requires_grad_() for t in (*x, state)]
    o, new = comba.comba_decode(*leaves[:6], leaves[6], read_order="fla")
    got = torch.autograd.grad(o.square().sum() + new.sum(), leaves)
    ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
    o64, f64 = recurrence64(*ref_leaves[:6], None, ref_leaves[6], "fla")
    ref = torch.autograd.grad(o64.square().sum() + f64.sum(), ref_leaves)
    assert all(rel_err(a, b) < 1e-5 for a, b in zip(got, ref))


@pytest.mark.kernels_ci
def test_non_finite_token_is_isolated_in_decode(comba):
    x, state = model_inputs(2, 4, 1, 1, 16, 8, seed=34)
    bad = [t.clone() for t in x]
    bad[2][0, 2] = float("nan")
    (clean, cs), (got, gs) = comba.comba_decode(*x, state), comba.comba_decode(*bad, state)
    assert torch.equal(got[0, :2], clean[0, :2]) and torch.equal(got[1], clean[1]) and got[0, 2:].isnan().all()
    assert torch.equal(gs[1], cs[1]) and gs[0].isnan().all()


@pytest.mark.kernels_ci
def test_decode_limits(comba):
    x, state = model_inputs(1, 65, 1, 1, 16, 8, seed=35)
    with pytest.raises(ValueError, match="1 to 64 new tokens per sequence, got a sequence of 65"):
        comba.comba_decode(*x, state)
    packed, offsets = pack([t.expand(2, *t.shape[1:]) for t in x], [1, 65])
    with pytest.raises(ValueError, match="got a sequence of 65"):
        comba.comba_decode(*packed, state.expand(2, -1, -1, -1).contiguous(), cu_seqlens=offsets)
    with pytest.raises(ValueError, match="state must be \\(N, HV, K, V\\)"):
        comba.comba_decode(*[t[:, :1] for t in x], state[:, :, :4])


# ---------------------------------------------------------------- the fused decode kernel (portable/decode.py)

# The kernel runs on the GPU, or on CPU tensors under Triton's interpreter; its fp32 errors against float64: the
# interpreter's exact exp and rsqrt, or the GPU's approximate ones.
DEVICE = "cuda" if HAS_CUDA else "cpu"
TOL = 1e-4 if HAS_CUDA else 1e-5


@pytest.fixture(scope="module")
def decode(comba):
    pytest.importorskip("triton")
    return submodule(comba, "portable.decode")


def on(device, x, state=None):
    return [t.to(device) for t in x], (None if state is None else state.to(device))


def launch(decode, x, state, scale=None, cu_seqlens=None, l2norm=False, order="decay_first", block=8, N=None):
    """The kernel's outputs, o and the new state, into NaN-filled tensors (so that a slice it leaves unwritten
    shows)."""
    q, k, v, p, beta, g = x
    N = N or (q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1)
    o = torch.full_like(v, float("nan"))
    new = torch.full((N, v.shape[2], q.shape[-1], v.shape[-1]), float("nan"), device=q.device)
    decode.launch(q, k, v, p, beta, g, state, o, new, q.shape[-1] ** -0.5 if scale is None else scale, cu_seqlens,
                  l2norm, order == "fla", block)
    return o, new


@needs_triton
@pytest.mark.kernels_ci
@pytest.mark.parametrize("l2norm", [False, True])
@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("T", [1, 5, 64])
def test_decode_kernel_matches_float64(decode, T, order, l2norm):
    """K = 64 and V = 16 in two blocks of 8, two value heads on one query head, a carried state: o and the final state
    against the float64 recurrence; the carried state is only read."""
    x, state = on(DEVICE, *model_inputs(2 if T < 64 else 1, T, 1, 2, 64, 16, seed=50 + T, unit_keys=not l2norm))
    before = state.clone()
    o, new = launch(decode, x, state, 0.7, l2norm=l2norm, order=order)
    o64, f64 = recurrence64(*x, 0.7, state, order, l2norm)
    assert rel_err(o, o64) < TOL and rel_err(new, f64) < TOL
    assert torch.equal(state, before)


@needs_triton
@pytest.mark.kernels_ci
def test_decode_kernel_packed_sequences_and_zero_state(decode):
    """Packed sequences of 3, 0, 5 and 1 tokens (cu_seqlens, B = 1), from a state and from zeros (state None): each
    sequence as its own float64 recurrence; an empty sequence keeps its state."""
    lengths = [3, 0, 5, 1]
    x, state = model_inputs(4, 5, 1, 2, 64, 16, seed=60)
    (packed, offsets), state = pack(x, lengths), state.to(DEVICE)
    packed, offsets = [t.to(DEVICE) for t in packed], offsets.to(DEVICE)
    for start in (state, None):
        o, new = launch(decode, packed, start, cu_seqlens=offsets, order="fla")
        s0 = torch.zeros_like(state) if start is None else start
        assert torch.equal(new[1], s0[1])
        for i, n in enumerate(lengths):
            if n:
                a = offsets[i].item()
                o64, f64 = recurrence64(*[t[i:i + 1, :n] for t in x], None, s0[i:i + 1].cpu(), "fla")
                assert rel_err(o[:, a:a + n], o64) < TOL and rel_err(new[i:i + 1], f64) < TOL


@needs_triton
@pytest.mark.kernels_ci
def test_decode_kernel_follows_the_non_finite_rule(comba, decode):
    """A NaN in one v channel of value head 0 (in the V block other than channel 0's), an inf in q of query head 1
    (value heads 2 and 3), and g = -inf (a reset, not an error) in value head 1: the kernel gives the recurrent
    reference's outputs and states, NaN where it has them."""
    x, state = model_inputs(1, 4, 2, 4, 64, 16, seed=61)
    x[2][0, 1, 0, 12] = float("nan")
    x[0][0, 2, 1, 3] = float("inf")
    x[5][0, 1, 1] = float("-inf")
    ref_o, ref_s = comba.comba_decode_reference(*x, state)
    o, new = launch(decode, *on(DEVICE, x, state))
    for got, ref in ((o, ref_o), (new, ref_s)):
        assert torch.equal(got.isnan().cpu(), ref.isnan())
        assert rel_err(got.nan_to_num().cpu(), ref.nan_to_num()) < TOL
    assert o[0, :1, 0].isfinite().all() and o[0, 1:, 0].isnan().all() and o[0, :, 1].isfinite().all()
    assert o[0, :2, 2:].isfinite().all() and o[0, 2:, 2:].isnan().all() and new[0, 1].isfinite().all()


@needs_triton
@pytest.mark.kernels_ci
def test_decode_cuda_entry_takes_the_kernel_or_the_reference(comba, dispatch, monkeypatch):
    """`comba_decode_cuda`: bf16 inputs at K = V = 64 run the kernel (o bf16, the state float32), against float64 of the
    same bf16 inputs; a size the kernel does not take (V = 16) runs the reference."""
    x, state = model_inputs(2, 3, 1, 2, 64, 64, seed=62, unit_keys=False)
    x, state = [t.to(DEVICE, torch.bfloat16) for t in x[:5]] + [x[5].to(DEVICE)], state.to(DEVICE)
    o, new = dispatch.comba_decode_cuda(*x, state, None, None, True, "decay_first")
    assert o.dtype == torch.bfloat16 and new.dtype == torch.float32
    o64, f64 = recurrence64(*x, None, state, "decay_first", True)
    assert rel_err(o, o64) < 1e-2 and rel_err(new, f64) < TOL
    small, small_state = on(DEVICE, *model_inputs(1, 2, 1, 1, 64, 16, seed=63))
    monkeypatch.setattr(dispatch, "comba_decode_reference", lambda *a, **kw: "reference")
    assert dispatch.comba_decode_cuda(*small, small_state, None, None, False, "fla") == "reference"


def cuda_inputs(B, T, H, HV, K, V, dtype, seed):
    """model_inputs on the GPU, q, k, v, p, beta in `dtype` (g and the state float32)."""
    x, state = model_inputs(B, T, H, HV, K, V, seed=seed, unit_keys=False)
    return [t.to("cuda", dtype) for t in x[:5]] + [x[5].cuda()], state.cuda()


def only_the_kernel(dispatch, monkeypatch):
    """Make a call that would fall back to the recurrent reference fail, so that a passing call ran the kernel."""
    def refuse(*args, **kwargs):
        raise AssertionError("the recurrent reference ran")

    monkeypatch.setattr(dispatch, "comba_decode_reference", refuse)


@needs_cuda
@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("T", [1, 64])
def test_cuda_decode_at_flas_layer_sizes(comba, dispatch, monkeypatch, T, order):
    """fla's layer sizes, K = 256 and V = 512, bf16, value heads grouped 2 to 1, q/k/p L2 norm: `comba_decode` runs the
    kernel; o (bf16) and the new state against float64 of the same inputs; the carried state is only read."""
    only_the_kernel(dispatch, monkeypatch)
    x, state = cuda_inputs(2, T, 2, 4, 256, 512, torch.bfloat16, seed=70 + T)
    before = state.clone()
    o, new = comba.comba_decode(*x, state, use_qk_l2norm=True, read_order=order)
    assert o.dtype == torch.bfloat16 and new.dtype == torch.float32 and torch.equal(state, before)
    o64, f64 = recurrence64(*x, None, state, order, True)
    assert rel_err(o, o64) < 1e-2 and rel_err(new, f64) < TOL


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_cuda_packed_decode_of_one_token_per_sequence(comba, dispatch, monkeypatch, dtype):
    """The layout of fla's generate(): N sequences of one new token each packed by cu_seqlens, through fla's
    `fused_recurrent_comba` (K = 128, V = 256, fla's order), and from zeros (no initial state)."""
    only_the_kernel(dispatch, monkeypatch)
    x, state = model_inputs(5, 1, 2, 4, 128, 256, seed=72)
    (packed, offsets) = pack(x, [1] * 5)
    q, k, v, p, beta, g = [t.to("cuda", dtype) for t in packed[:5]] + [packed[5].cuda()]
    tol = TOL if dtype == torch.float32 else 2e-3
    for start in (state.cuda(), None):
        o, new = comba.fla.fused_recurrent_comba(q, k, p, v, g, beta, None, start, True, True, offsets.cuda())
        o64, f64 = recurrence64(*[t.squeeze(0)[:, None] for t in (q, k, v, p, beta, g)], None, start, "fla", True)
        assert rel_err(o[0], o64[:, 0]) < tol and rel_err(new, f64) < TOL


@needs_cuda
def test_cuda_decode_under_autograd_runs_the_reference(comba):
    """An input that requires grad takes the recurrent reference, so that gradients flow (decode is inference)."""
    x, state = cuda_inputs(1, 3, 1, 2, 64, 64, torch.float32, seed=73)
    leaf = state.clone().requires_grad_()
    o, new = comba.comba_decode(*x, leaf, read_order="fla")
    (grad,) = torch.autograd.grad(o.square().sum() + new.sum(), leaf)
    ref_leaf = state.double().requires_grad_()
    o64, f64 = recurrence64(*x, None, ref_leaf, "fla")
    (ref,) = torch.autograd.grad(o64.square().sum() + f64.sum(), ref_leaf)
    assert rel_err(grad, ref) < TOL


@needs_cuda
def test_cuda_decode_is_captured_in_a_cuda_graph(comba, dispatch, monkeypatch):
    """A packed decode step (cu_seqlens, a carried state, fla's order, L2 norm) captured in a CUDA graph and replayed on
    new inputs copied into the captured tensors: the same outputs as an eager call on them, and as float64."""
    only_the_kernel(dispatch, monkeypatch)
    lengths = [1, 3, 1, 2]
    x, state = model_inputs(4, 3, 2, 4, 256, 512, seed=74)
    packed, offsets = pack(x, lengths)
    static = [t.to("cuda", torch.bfloat16) for t in packed[:5]] + [packed[5].cuda()]
    static_state, offsets = state.cuda(), offsets.cuda()
    kwargs = {"cu_seqlens": offsets, "use_qk_l2norm": True, "read_order": "fla"}
    with torch.no_grad():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):      # compile outside the capture
            comba.comba_decode(*static, static_state, **kwargs)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            o, new = comba.comba_decode(*static, static_state, **kwargs)
        x2, state2 = model_inputs(4, 3, 2, 4, 256, 512, seed=75)
        fresh, _ = pack(x2, lengths)
        for dst, src in zip([*static, static_state], [*fresh, state2]):
            dst.copy_(src)
        graph.replay()
        eager_o, eager_new = comba.comba_decode(*static, static_state, **kwargs)
    assert torch.equal(o, eager_o) and torch.equal(new, eager_new)
    bounds = offsets.tolist()
    for i, n in enumerate(lengths):
        seq = [t[:, bounds[i]:bounds[i + 1]] for t in static]
        o64, f64 = recurrence64(*seq, None, static_state[i:i + 1], "fla", True)
        assert rel_err(o[:, bounds[i]:bounds[i + 1]], o64) < 1e-2 and rel_err(new[i:i + 1], f64) < TOL
