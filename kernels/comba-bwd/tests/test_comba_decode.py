"""`comba_decode` through `get_kernel` (CPU): a few new tokens after a carried state, against the float64
token-by-token recurrence and against the chunked `comba_attention`; token-by-token decoding equals one chunked call;
packed decode of many sequences; the state is returned, not modified; gradients; its limits."""

import pytest
import torch

from test_model_interface import ORDERS, model_inputs, pack, recurrence64
from testkit import load, rel_err


@pytest.fixture(scope="module")
def comba():
    return load("comba-bwd")


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
