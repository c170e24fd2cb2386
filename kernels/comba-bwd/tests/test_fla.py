"""`comba_bwd.fla` through `get_kernel`: fla 0.6.0's `chunk_comba` and `fused_recurrent_comba` on this package, and
`use_in_fla()`, which swaps them into fla's Comba layers.

On the CPU (no fla needed): both functions against the float64 recurrence in fla's read order with fla's argument
conventions (p before v in `fused_recurrent_comba`, p = k and beta = 1 by default, o in q's dtype, the final state or
None, g in bf16 accepted), and the swap on a stand-in of `fla.layers.comba`. With fla installed: the signatures are
fla's. With fla and CUDA: outputs, final states and gradients against fla's own ops at fla's default layer shapes, and a
random-init `CombaForCausalLM` trained 50 steps and greedily generating with fla's ops and with ours."""

import copy
import inspect
import sys
import types

import pytest
import torch

from test_model_interface import model_inputs, pack, recurrence64
from testkit import needs_cuda, rel_err


@pytest.fixture(scope="module")
def fla_ops():
    return pytest.importorskip("fla.ops.comba")


# ---------------------------------------------------------------- CPU: fla's conventions against float64


@pytest.mark.kernels_ci
def test_chunk_comba_matches_float64_in_fla_order(comba):
    lengths = [70, 3, 130]
    x, state = model_inputs(3, 130, 2, 4, 16, 8, seed=40, unit_keys=False)
    packed, offsets = pack(x, lengths)
    q, k, v, p, beta, g = packed
    o, final = comba.fla.chunk_comba(q, k, v, p, g, beta, initial_state=state, output_final_state=True,
                                     use_qk_l2norm_in_kernel=True, cu_seqlens=offsets)
    for i, n in enumerate(lengths):
        a, b = offsets[i].item(), offsets[i + 1].item()
        o64, f64 = recurrence64(*[t[i:i + 1, :n] for t in x], None, state[i:i + 1], "fla", True)
        assert rel_err(o[:, a:b], o64) < 1e-5 and rel_err(final[i:i + 1], f64) < 1e-5
    o_only, none = comba.fla.chunk_comba(q, k, v, p, g, beta, use_qk_l2norm_in_kernel=True, cu_seqlens=offsets)
    assert none is None and o_only.shape == o.shape


@pytest.mark.kernels_ci
@pytest.mark.parametrize("T", [1, 64, 65])
def test_fused_recurrent_comba_takes_p_before_v(comba, T):
    """Positional (q, k, p, v, g, beta): decode up to 64 tokens, the chunked path above, the same function."""
    x, state = model_inputs(2, T, 2, 2, 16, 8, seed=41)
    q, k, v, p, beta, g = x
    o, final = comba.fla.fused_recurrent_comba(q, k, p, v, g, beta, 0.5, state, True)
    o64, f64 = recurrence64(*x, 0.5, state, "fla")
    assert rel_err(o, o64) < 1e-5 and rel_err(final, f64) < 1e-5


@pytest.mark.kernels_ci
def test_fla_defaults_and_dtypes(comba):
    """p = k and beta = 1 when None; g in bf16 is taken (fla's docstring example has one); o in q's dtype; the final
    state float32; a bf16 initial state is taken as float32."""
    x, state = model_inputs(1, 20, 2, 2, 16, 8, seed=42)
    q, k, v, p, beta, g = (t.bfloat16() for t in x)
    o, final = comba.fla.chunk_comba(q, k, v, None, g, initial_state=state.bfloat16(), output_final_state=True)
    assert o.dtype == torch.bfloat16 and final.dtype == torch.float32
    o64, f64 = recurrence64(q, k, v, k, torch.ones_like(beta), g.float(), None, state.bfloat16(), "fla")
    assert rel_err(o, o64) < 1e-2 and rel_err(final, f64) < 1e-5
    with pytest.raises(ValueError, match="a beta per value channel"):
        comba.fla.fused_recurrent_comba(q, k, p, v, g, beta[..., None].expand(*beta.shape, 8))


@pytest.mark.kernels_ci
def test_chunk_comba_trains_in_every_input(comba):
    x, state = model_inputs(1, 70, 2, 4, 16, 8, seed=43, unit_keys=False)
    leaves = [t.clone().requires_grad_() for t in (*x, state)]
    q, k, v, p, beta, g, h0 = leaves
    o, final = comba.fla.chunk_comba(q, k, v, p, g, beta, initial_state=h0, output_final_state=True,
                                     use_qk_l2norm_in_kernel=True)
    got = torch.autograd.grad(o.square().sum() + final.sum(), leaves)
    ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
    o64, f64 = recurrence64(*ref_leaves[:6], None, ref_leaves[6], "fla", True)
    ref = torch.autograd.grad(o64.square().sum() + f64.sum(), ref_leaves)
    assert all(rel_err(a, b) < 1e-4 for a, b in zip(got, ref))


@pytest.mark.kernels_ci
def test_use_in_fla_swaps_the_layer_ops_and_restores_them(comba, monkeypatch):
    """On a stand-in of `fla.layers.comba` (the real one where fla is installed): inside `with` the layer module's
    names are ours, after it fla's again; called alone the swap stays until `restore()`."""
    if "fla.layers.comba" not in sys.modules:
        try:
            import fla.layers.comba  # noqa: F401
        except ImportError:
            layer = types.ModuleType("fla.layers.comba")
            layer.chunk_comba, layer.fused_recurrent_comba = object(), object()
            for name in ("fla", "fla.layers"):
                monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
            monkeypatch.setitem(sys.modules, "fla.layers.comba", layer)
    layer = sys.modules["fla.layers.comba"]
    theirs = (layer.chunk_comba, layer.fused_recurrent_comba)
    with comba.fla.use_in_fla():
        assert (layer.chunk_comba, layer.fused_recurrent_comba) == (comba.fla.chunk_comba,
                                                                     comba.fla.fused_recurrent_comba)
    assert (layer.chunk_comba, layer.fused_recurrent_comba) == theirs
    swap = comba.fla.use_in_fla()
    assert layer.chunk_comba is comba.fla.chunk_comba
    swap.restore()
    assert (layer.chunk_comba, layer.fused_recurrent_comba) == theirs


def test_signatures_are_flas(comba, fla_ops):
    for name in ("chunk_comba", "fused_recurrent_comba"):
        ours, theirs = inspect.signature(getattr(comba.fla, name)), inspect.signature(getattr(fla_ops, name))
        assert [(p.name, p.default, p.kind) for p in ours.parameters.values()] == \
            [(p.name, p.default, p.kind) for p in theirs.parameters.values()], name


# ---------------------------------------------------------------- CUDA: against fla 0.6.0


def fla_layer_inputs(B, T, H, HV, K, V, seed, device="cuda"):
    """fla's layer inputs: bf16 q, k, v, p (raw: the ops normalise them), bf16 beta = sigmoid, fp32
    g = -exp(A_log) softplus(a + dt_bias), and a float32 state."""
    x, state = model_inputs(B, T, H, HV, K, V, seed=seed, unit_keys=False)
    q, k, v, p, beta, g = x
    q, k, v, p = (t.to(device, torch.bfloat16) for t in (q, k, v, p))
    return [q, k, v, p, beta.to(device, torch.bfloat16), g.to(device)], state.to(device)


# fla 0.6.0 refuses its own chunk backward under Triton < 3.7.1 on Hopper, where it miscompiles (fla #640).
FLA_BACKWARD_GUARD = "produces incorrect results for gated chunk_bwd_dqkwg"


def fla_backward_or_skip(fn):
    """fn(), or a skip where fla refuses its backward (FLA_BACKWARD_GUARD): there is nothing of fla's to compare."""
    try:
        return fn()
    except RuntimeError as error:
        if FLA_BACKWARD_GUARD in str(error):
            pytest.skip("fla 0.6.0 refuses its chunk_comba backward under Triton < 3.7.1 on Hopper (fla #640)")
        raise


FLA_SHAPES = [(2, 1024, 6, 6, 256, 512), (1, 700, 2, 4, 128, 256)]


def chunk_comba_call(fn, x, state):
    """fn (a chunk_comba) on leaves cloned from x and state: (leaves, o, final state)."""
    leaves = [t.clone().requires_grad_() for t in (*x, state)]
    q, k, v, p, beta, g, h0 = leaves
    o, final = fn(q=q, k=k, v=v, p=p, g=g, beta=beta, initial_state=h0, output_final_state=True,
                  use_qk_l2norm_in_kernel=True)
    return leaves, o, final


@needs_cuda
@pytest.mark.parametrize("B,T,H,HV,K,V", FLA_SHAPES)
def test_chunk_comba_forward_matches_flas(comba, fla_ops, B, T, H, HV, K, V):
    x, state = fla_layer_inputs(B, T, H, HV, K, V, seed=44)
    with torch.no_grad():
        _, o, final = chunk_comba_call(comba.fla.chunk_comba, x, state)
        _, o_fla, final_fla = chunk_comba_call(fla_ops.chunk_comba, x, state)
    assert rel_err(o, o_fla) < 2e-2 and rel_err(final, final_fla) < 2e-2, (rel_err(o, o_fla), rel_err(final, final_fla))


@needs_cuda
@pytest.mark.parametrize("B,T,H,HV,K,V", FLA_SHAPES)
def test_chunk_comba_gradients_match_flas(comba, fla_ops, B, T, H, HV, K, V):
    x, state = fla_layer_inputs(B, T, H, HV, K, V, seed=44)
    do = torch.randn(B, T, HV, V, device="cuda", dtype=torch.bfloat16)
    dS = torch.randn(B, HV, K, V, device="cuda")

    def gradients(fn):
        leaves, o, final = chunk_comba_call(fn, x, state)
        return torch.autograd.grad((o.float() * do.float()).sum() + (final * dS).sum(), leaves)

    ours = gradients(comba.fla.chunk_comba)
    theirs = fla_backward_or_skip(lambda: gradients(fla_ops.chunk_comba))
    errs = [rel_err(a, b) for a, b in zip(ours, theirs)]
    assert all(e < 2e-2 for e in errs), errs


@needs_cuda
def test_fused_recurrent_comba_matches_flas(comba, fla_ops):
    x, state = fla_layer_inputs(64, 1, 6, 6, 256, 512, seed=45)
    q, k, v, p, beta, g = x
    ours = comba.fla.fused_recurrent_comba(q=q, k=k, v=v, p=p, g=g, beta=beta, initial_state=state,
                                           output_final_state=True, use_qk_l2norm_in_kernel=True)
    theirs = fla_ops.fused_recurrent_comba(q=q, k=k, v=v, p=p, g=g, beta=beta, initial_state=state,
                                           output_final_state=True, use_qk_l2norm_in_kernel=True)
    assert all(rel_err(a, b) < 2e-2 for a, b in zip(ours, theirs))


@needs_cuda
def test_comba_causal_lm_trains_and_generates_alike(comba):
    """fla's CombaForCausalLM (2 layers, hidden 512, fla's head defaults), random init, 50 AdamW steps on a repeating
    token pattern in bf16: the loss curves with fla's ops and with ours agree within bf16 noise, and so do the greedy
    generate() tokens after training (prefill through chunk_comba, decode through fused_recurrent_comba)."""
    models = pytest.importorskip("fla.models")
    torch.manual_seed(46)
    config = models.CombaConfig(hidden_size=512, num_hidden_layers=2, vocab_size=256, fuse_cross_entropy=False)
    base = models.CombaForCausalLM(config).to("cuda", torch.bfloat16)
    data = torch.randint(0, 256, (4, 32), device="cuda").repeat(1, 8)   # (4, 256): a pattern to learn
    prompt = data[:2, :40]

    def run(model):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        losses = []
        for _ in range(50):
            loss = model(input_ids=data, labels=data).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        model.eval()
        with torch.no_grad():
            tokens = model.generate(prompt, max_new_tokens=16, do_sample=False, use_cache=True)
        return torch.tensor(losses), tokens

    with comba.fla.use_in_fla():
        ours = run(copy.deepcopy(base))
    assert ours[0][-1] < 0.5 * ours[0][0], ours[0]  # it learns the pattern on our ops alone
    theirs = fla_backward_or_skip(lambda: run(copy.deepcopy(base)))
    assert (ours[0] - theirs[0]).abs().max() < 0.05 * theirs[0][0], (ours[0], theirs[0])
    assert torch.equal(ours[1], theirs[1])

