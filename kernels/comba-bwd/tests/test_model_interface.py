"""`comba_attention`'s model interface through `get_kernel` (CPU, the eager reference): a carried state in and out,
packed sequences (`cu_seqlens`), grouped value heads, q/k/p L2 normalisation and fla's read order, each against an
independent float64 token-by-token recurrence (`recurrence64`, written in both read orders), gradients of the initial
state included; packed == per-sequence calls; a prefill in two calls == one call; any T; non-finite inputs isolated;
g > 0 refused; bad arguments named."""

import math

import pytest
import torch
import torch.nn.functional as F

from testkit import rel_err

ORDERS = ("decay_first", "fla")


def recurrence64(q, k, v, p, beta, g, scale=None, initial_state=None, read_order="decay_first", l2norm=False):
    """o (B, T, HV, V) and the final state (B, HV, K, V) in float64, one token at a time. Value head hv reads q, k, p
    of head hv * H // HV. decay_first: S = e^g S; u = beta (v - S^T p); S += k u^T. fla: u = beta (v - S^T p);
    S = e^g S + k u^T. Both read o = S^T (scale q)."""
    q, k, v, p, beta, g = (t.detach().double() if not t.requires_grad else t.double() for t in (q, k, v, p, beta, g))
    if l2norm:
        q, k, p = (x / (x * x).sum(-1, keepdim=True).add(1e-6).sqrt() for x in (q, k, p))
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    head = [hv * H // HV for hv in range(HV)]
    q, k, p = q[:, :, head], k[:, :, head], p[:, :, head]
    scale = K**-0.5 if scale is None else scale
    S = q.new_zeros(B, HV, K, V) if initial_state is None else initial_state.double()
    out = []
    for t in range(T):
        decay = g[:, t, :, None, None].exp()
        if read_order == "decay_first":
            S = decay * S
        u = beta[:, t, :, None] * (v[:, t] - torch.einsum("bhkv,bhk->bhv", S, p[:, t]))
        if read_order == "fla":
            S = decay * S
        S = S + k[:, t, :, :, None] * u[:, :, None, :]
        out.append(torch.einsum("bhkv,bhk->bhv", S, scale * q[:, t]))
    return torch.stack(out, 1), S


def model_inputs(B, T, H, HV, K, V, seed=0, unit_keys=True):
    """q, k, v, p, beta, g and a state: k and p unit-norm (or raw, for the L2 normalisation), beta in (0, 1), g fla's
    gate -exp(A) softplus(x) with A in (-3, 0), the state of the size a few hundred steps leave."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=gen)
    k = torch.randn(B, T, H, K, generator=gen)
    p = torch.randn(B, T, H, K, generator=gen)
    if unit_keys:
        k, p = F.normalize(k, dim=-1), F.normalize(p, dim=-1)
    v = torch.randn(B, T, HV, V, generator=gen)
    beta = torch.rand(B, T, HV, generator=gen)
    A = -3 * torch.rand(HV, generator=gen)
    g = -A.exp() * F.softplus(torch.randn(B, T, HV, generator=gen) - 2)
    state = torch.randn(B, HV, K, V, generator=gen)
    return [q, k, v, p, beta, g], state


# ---------------------------------------------------------------- every argument against float64

CASES = [  # T, H, HV, read_order, l2norm, with a state
    (1, 2, 2, "fla", True, True),
    (63, 1, 2, "decay_first", False, True),
    (65, 2, 4, "fla", False, False),
    (130, 2, 2, "decay_first", True, True),
    (1000, 1, 2, "fla", True, True),
]


@pytest.mark.kernels_ci
@pytest.mark.parametrize("T,H,HV,order,l2norm,with_state", CASES)
def test_every_argument_matches_float64(comba, T, H, HV, order, l2norm, with_state):
    x, state = model_inputs(2, T, H, HV, 16, 8, seed=T, unit_keys=not l2norm)
    state = state if with_state else None
    o, final = comba.comba_attention(*x, 0.8, initial_state=state, output_final_state=True, use_qk_l2norm=l2norm,
                                     read_order=order)
    assert o.shape == (2, T, HV, 8) and o.dtype == torch.float32
    assert final.shape == (2, HV, 16, 8) and final.dtype == torch.float32
    o64, final64 = recurrence64(*x, 0.8, state, order, l2norm)
    assert rel_err(o, o64) < 1e-5
    assert rel_err(final, final64) < 1e-5
    alone = comba.comba_attention(*x, 0.8, initial_state=state, use_qk_l2norm=l2norm, read_order=order)
    assert torch.equal(alone, o)


@pytest.mark.kernels_ci
def test_flas_layer_sizes_on_the_cpu(comba):
    """K = 256, V = 512 (fla's head_dim 256, expand_v 2), value heads grouped 3 to 1."""
    x, state = model_inputs(1, 70, 1, 3, 256, 512, seed=16, unit_keys=False)
    o, final = comba.comba_attention(*x, initial_state=state, output_final_state=True, use_qk_l2norm=True,
                                     read_order="fla")
    o64, final64 = recurrence64(*x, None, state, "fla", True)
    assert rel_err(o, o64) < 1e-5 and rel_err(final, final64) < 1e-5


@pytest.mark.kernels_ci
@pytest.mark.parametrize("model_call", [False, True])
def test_float32_under_cpu_autocast(comba, model_call):
    """Under bf16 autocast, float32 inputs are computed in float32 (the spec's call through the registered op, and
    the model interface) and o stays float32."""
    x, state = model_inputs(1, 70, 2, 2, 16, 8, seed=17)
    kwargs = {"initial_state": state, "read_order": "fla"} if model_call else {}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        o = comba.comba_attention(*x, **kwargs)
    assert o.dtype == torch.float32
    ref = recurrence64(*x, None, state, "fla")[0] if model_call else recurrence64(*x)[0]
    assert rel_err(o, ref) < 1e-5


@pytest.mark.kernels_ci
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_inputs_return_v_dtype_and_a_float32_state(comba, dtype):
    x, state = model_inputs(1, 70, 2, 4, 16, 8, seed=1)
    x = [t.to(dtype) if i < 5 else t for i, t in enumerate(x)]
    o, final = comba.comba_attention(*x, initial_state=state, output_final_state=True, read_order="fla")
    assert o.dtype == dtype and final.dtype == torch.float32
    o64, final64 = recurrence64(*x, None, state, "fla")
    assert rel_err(o, o64) < 1e-2 and rel_err(final, final64) < 1e-5


@pytest.mark.kernels_ci
def test_fla_order_at_strong_decay_is_exact(comba):
    """fla's gate at large A (log-decays down to about -200 a step, resets in effect): the read before the decay is
    formed as exp(gc_{i-1} - gc_j), so nothing overflows, where p / exp(g) through the spec's order would."""
    x, state = model_inputs(1, 130, 2, 2, 16, 8, seed=2)
    x[5] = -40 * F.softplus(torch.randn(x[5].shape, generator=torch.Generator().manual_seed(3)) + 1) - 1
    assert (x[5].min() < -100) and math.isinf((1 / x[5].exp()).max().item())
    o, final = comba.comba_attention(*x, initial_state=state, output_final_state=True, read_order="fla")
    o64, final64 = recurrence64(*x, None, state, "fla")
    assert o.isfinite().all() and rel_err(o, o64) < 1e-4 and rel_err(final, final64) < 1e-4


@pytest.mark.kernels_ci
def test_the_read_orders_differ_by_the_step_decay_on_p(comba):
    """Reading after the decay with p is reading before it with p exp(g) (the two orders are not the same call)."""
    x, state = model_inputs(2, 100, 2, 2, 16, 8, seed=4)
    spec = comba.comba_attention(*x, initial_state=state)
    q, k, v, p, beta, g = x
    fla = comba.comba_attention(q, k, v, p * g.exp()[..., None], beta, g, initial_state=state, read_order="fla")
    assert rel_err(fla, spec) < 1e-5
    assert rel_err(comba.comba_attention(*x, initial_state=state, read_order="fla"), spec) > 1e-2


@pytest.mark.kernels_ci
def test_a_zero_state_is_no_state_and_the_spec_call_is_the_registered_op(comba):
    x, _ = model_inputs(2, 100, 2, 2, 16, 8, seed=5)
    spec = comba.comba_attention(*x)
    o, final = comba.comba_attention(*x, initial_state=torch.zeros(2, 2, 16, 8), output_final_state=True)
    assert rel_err(o, spec) < 1e-6
    assert torch.equal(spec, comba.op.comba_forward_op(*x, 16**-0.5))
    assert rel_err(final, recurrence64(*x)[1]) < 1e-5


# ---------------------------------------------------------------- gradients


@pytest.mark.kernels_ci
@pytest.mark.parametrize("order,l2norm,HV", [("fla", True, 4), ("decay_first", False, 2), ("fla", False, 2)])
def test_gradients_match_float64_autograd(comba, order, l2norm, HV):
    """All seven inputs, the initial state included, through o and the final state."""
    x, state = model_inputs(1, 70, 2, HV, 16, 8, seed=6, unit_keys=not l2norm)
    gen = torch.Generator().manual_seed(7)
    do, dS = torch.randn(1, 70, HV, 8, generator=gen), torch.randn(1, HV, 16, 8, generator=gen)
    leaves = [t.clone().requires_grad_() for t in (*x, state)]
    o, final = comba.comba_attention(*leaves[:6], initial_state=leaves[6], output_final_state=True,
                                     use_qk_l2norm=l2norm, read_order=order)
    got = torch.autograd.grad((o * do).sum() + (final * dS).sum(), leaves)
    ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
    o64, final64 = recurrence64(*ref_leaves[:6], None, ref_leaves[6], order, l2norm)
    ref = torch.autograd.grad((o64 * do.double()).sum() + (final64 * dS.double()).sum(), ref_leaves)
    errs = {name: rel_err(a, b) for name, a, b in zip(("q", "k", "v", "p", "beta", "g", "state"), got, ref)}
    assert all(e < 1e-4 for e in errs.values()), errs


# ---------------------------------------------------------------- packed sequences and carried states


def pack(x, lengths):
    """Sequences of one batch row each, cut to `lengths`, packed along T of a batch of one, and their offsets."""
    parts = [[t[i:i + 1, :n] for i, n in enumerate(lengths)] for t in x]
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    return [torch.cat(p, 1) for p in parts], offsets


@pytest.mark.kernels_ci
@pytest.mark.parametrize("order", ORDERS)
def test_packed_sequences_equal_per_sequence_calls(comba, order):
    lengths = [5, 64, 0, 71, 1, 130]
    x, state = model_inputs(len(lengths), 130, 2, 4, 16, 8, seed=8)
    packed, offsets = pack(x, lengths)
    o, final = comba.comba_attention(*packed, initial_state=state, output_final_state=True, cu_seqlens=offsets,
                                     use_qk_l2norm=True, read_order=order)
    assert o.shape == (1, sum(lengths), 4, 8) and final.shape == (len(lengths), 4, 16, 8)
    for i, n in enumerate(lengths):
        a, b = offsets[i].item(), offsets[i + 1].item()
        if n == 0:
            assert torch.equal(final[i], state[i])
            continue
        one = [t[i:i + 1, :n] for t in x]
        o1, f1 = comba.comba_attention(*one, initial_state=state[i:i + 1], output_final_state=True,
                                       use_qk_l2norm=True, read_order=order)
        assert rel_err(o[:, a:b], o1) < 1e-6 and rel_err(final[i:i + 1], f1) < 1e-6
        o64, f64 = recurrence64(*one, None, state[i:i + 1], order, True)
        assert rel_err(o[:, a:b], o64) < 1e-5 and rel_err(final[i:i + 1], f64) < 1e-5


@pytest.mark.kernels_ci
@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("T1", [50, 64, 1])
def test_a_prefill_in_two_calls_equals_one_call(comba, order, T1):
    x, state = model_inputs(2, 150, 1, 2, 16, 8, seed=9)
    whole, final = comba.comba_attention(*x, initial_state=state, output_final_state=True, read_order=order)
    first, mid = comba.comba_attention(*[t[:, :T1] for t in x], initial_state=state, output_final_state=True,
                                       read_order=order)
    second, end = comba.comba_attention(*[t[:, T1:] for t in x], initial_state=mid, output_final_state=True,
                                        read_order=order)
    assert rel_err(torch.cat([first, second], 1), whole) < 1e-5 and rel_err(end, final) < 1e-5


# ---------------------------------------------------------------- non-finite inputs and g > 0

BAD_VALUES = [  # input index, value
    (0, float("nan")), (1, float("inf")), (2, float("nan")), (3, -float("inf")), (4, float("nan")),
    (5, float("nan")), (2, 1e38),
]


def poison(x, i, value, where):
    x = [t.clone() for t in x]
    x[i][where] = value
    return x


@pytest.mark.kernels_ci
@pytest.mark.parametrize("i,value", BAD_VALUES)
def test_a_non_finite_input_changes_nothing_before_it_nor_other_rows(comba, i, value):
    """The spec's call (the registered op on the CPU) and the model interface: a bad value at step 100 of batch row 0
    (head 0) leaves steps 0-99 (64-99 share its chunk) and row 1 bit for bit as they were; from step 100 on the row
    and head's outputs are NaN (1e38 in v overflows the state: the rule is on the inputs it can see, and inf - inf
    reaches NaN by itself)."""
    x, state = model_inputs(2, 192, 1, 1, 16, 8, seed=10)
    bad = poison(x, i, value, (0, 100))
    for kwargs in ({}, {"initial_state": state, "read_order": "fla"}):
        clean, got = comba.comba_attention(*x, **kwargs), comba.comba_attention(*bad, **kwargs)
        assert torch.equal(got[0, :100], clean[0, :100]) and torch.equal(got[1], clean[1])
        if value != 1e38:
            assert got[0, 100:].isnan().all()


@pytest.mark.kernels_ci
@pytest.mark.parametrize("i,value", BAD_VALUES[:6])
def test_a_non_finite_input_stays_in_its_packed_sequence_and_head(comba, i, value):
    lengths = [70, 90, 40]
    x, state = model_inputs(3, 90, 2, 4, 16, 8, seed=11)
    packed, offsets = pack(x, lengths)
    start = offsets[1].item()
    head = 1 if i in (0, 1, 3) else 3   # q, k, p head 1 feeds value heads 2 and 3
    bad = poison(packed, i, value, (0, start + 30, head))
    kwargs = {"initial_state": state, "output_final_state": True, "cu_seqlens": offsets, "read_order": "fla"}
    (clean, cf), (got, gf) = comba.comba_attention(*packed, **kwargs), comba.comba_attention(*bad, **kwargs)
    hit = [2, 3] if i in (0, 1, 3) else [3]
    kept = [h for h in range(4) if h not in hit]
    assert torch.equal(got[:, :start + 30], clean[:, :start + 30])
    assert torch.equal(got[:, start + 30:, kept], clean[:, start + 30:, kept])
    assert got[:, start + 30:offsets[2], hit].isnan().all()
    assert torch.equal(got[:, offsets[2]:], clean[:, offsets[2]:])
    assert torch.equal(gf[[0, 2]], cf[[0, 2]]) and torch.equal(gf[1, kept], cf[1, kept]) and gf[1, hit].isnan().all()


@pytest.mark.kernels_ci
def test_minus_inf_gate_is_a_reset_not_a_non_finite_input(comba):
    x, state = model_inputs(1, 100, 1, 1, 16, 8, seed=12)
    x[5][0, 40] = -float("inf")
    o, final = comba.comba_attention(*x, initial_state=state, output_final_state=True, read_order="fla")
    o64, f64 = recurrence64(*x, None, state, "fla")
    assert o.isfinite().all() and rel_err(o, o64) < 1e-5 and rel_err(final, f64) < 1e-5


@pytest.mark.kernels_ci
@pytest.mark.parametrize("value", [1e-3, 0.5, float("inf")])
def test_positive_g_is_refused(comba, value):
    """g > 0 raises on every reference path: the spec's call (forward and backward), the model interface, decode."""
    x, state = model_inputs(1, 70, 1, 1, 16, 8, seed=13)
    x[5][0, 65] = value
    do = torch.randn(1, 70, 1, 8)
    calls = [lambda: comba.comba_attention(*x), lambda: comba.comba_backward(*x, do),
             lambda: comba.comba_attention(*x, initial_state=state, read_order="fla"),
             lambda: comba.comba_decode(*[t[:, 60:] for t in x], state)]
    for call in calls:
        with pytest.raises(ValueError, match="g must be a log-decay <= 0"):
            call()


# ---------------------------------------------------------------- bad arguments


def _args(**change):
    x, state = model_inputs(1, 10, 2, 4, 16, 8, seed=14)
    kwargs = {"initial_state": state, "output_final_state": True, "read_order": "fla"}
    names = ("q", "k", "v", "p", "beta", "g")
    args = dict(zip(names, x))
    for name, fn in change.items():
        if name in names:
            args[name] = fn(args[name])
        else:
            kwargs[name] = fn(kwargs.get(name))
    return [args[n] for n in names], kwargs


BAD_ARGS = [
    ({"v": lambda v: v[:, :, :3]}, ValueError, "v must be \\(B, T, HV, V\\).*HV a multiple of q's H = 2"),
    ({"beta": lambda b: b[:, :, :2]}, ValueError, "beta must be \\(B, T, HV\\) = \\(1, 10, 4\\)"),
    ({"g": lambda g: g.bfloat16()}, TypeError, "g must be float32"),
    ({"initial_state": lambda s: s[:, :2]}, ValueError, "initial_state must be \\(N, HV, K, V\\) = \\(1, 4, 16, 8\\)"),
    ({"initial_state": lambda s: s.bfloat16()}, TypeError, "initial_state must be float32"),
    ({"initial_state": lambda s: s.numpy()}, TypeError, "initial_state must be a torch.Tensor"),
    ({"output_final_state": lambda _: 1}, TypeError, "output_final_state must be a bool"),
    ({"use_qk_l2norm": lambda _: "yes"}, TypeError, "use_qk_l2norm must be a bool"),
    ({"read_order": lambda _: "read_first"}, ValueError, "read_order must be one of"),
    ({"cu_seqlens": lambda _: torch.tensor([0.0, 10.0])}, TypeError, "cu_seqlens must be int32 or int64"),
    ({"cu_seqlens": lambda _: torch.tensor([0, 4, 9])}, ValueError, "initial_state must be \\(N, HV, K, V\\) = \\(2"),
    ({"cu_seqlens": lambda _: torch.tensor([0, 9])}, ValueError, "cu_seqlens must start at 0 and end at T = 10"),
    ({"cu_seqlens": lambda _: torch.tensor([[0, 10]])}, ValueError, "cu_seqlens must have rank 1"),
]


@pytest.mark.kernels_ci
@pytest.mark.parametrize("change,exc,match", BAD_ARGS)
def test_bad_model_arguments_raise(comba, change, exc, match):
    x, kwargs = _args(**change)
    with pytest.raises(exc, match=match):
        comba.comba_attention(*x, **kwargs)


@pytest.mark.kernels_ci
def test_bad_packing_raises(comba):
    x, state = model_inputs(2, 10, 1, 1, 16, 8, seed=15)
    with pytest.raises(ValueError, match="q must have B = 1"):
        comba.comba_attention(*x, cu_seqlens=torch.tensor([0, 10]))
    one = [t[:1] for t in x]
    with pytest.raises(ValueError, match="cu_seqlens must be non-decreasing"):
        comba.comba_attention(*one, cu_seqlens=torch.tensor([0, 6, 4, 10]))
