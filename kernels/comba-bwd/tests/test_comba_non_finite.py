"""comba-bwd's rule for non-finite values (`reference.py` states it), on the eager reference (forward and analytic
backward), on `comba_attention`'s CPU calls differentiated by autograd, and on the fused kernels (`dispatch`'s
Triton path): the plain call, the model call (a carried state, grouped value heads, fla's read order) and packed
sequences (a carried state, the spec's read order). A NaN or inf at step t = 100 of a 110-step sequence (inside its
second chunk, so that chunk's products see it) in q, k, v, p, beta or g does, against the clean call:

- no output before t changes, and the step's output is non-finite;
- nothing changes in another batch row or packed sequence (outputs, final states, every gradient), nor the outputs
  and final state of a value head that does not read the bad value;
- the fused kernels' outputs and final states are non-finite wherever the reference's are (from t on, in the value
  head's whole row), but for a non-finite q: the fused kernels keep it to the one output that reads it, o_t, where
  the references make every output from t on NaN.

The gradients of the bad sequence are not held to steps: its outputs from t on and its final state are NaN, and every
earlier step reaches them, so a non-zero output gradient makes every gradient of that sequence non-finite.

The fused kernels run in the Triton interpreter on CPU tensors in fp32 and in bf16 on CUDA; K = V = 64, the smallest
size they take (V = 64 keeps the Gluon kernels out: they run at V = 128 only)."""

import functools

import pytest
import torch

from testkit import HAS_CUDA, needs_triton, sequences, submodule
from test_model_interface import model_inputs, pack

TRITON_DEVICE = "cuda" if HAS_CUDA else "cpu"
DTYPE = torch.bfloat16 if HAS_CUDA else torch.float32
T, K, V = 110, 64, 64  # two chunks, the bad step inside the second
STEP = 100  # the bad step of the bad sequence
LENGTHS = [40, T, 20]  # the packed call: the bad sequence between two others
SCALE = 0.3
IMPLS = [pytest.param("reference", marks=pytest.mark.kernels_ci), pytest.param("public", marks=pytest.mark.kernels_ci),
         pytest.param("fused", marks=needs_triton)]
# call -> (value heads over one key head, read order, carried state); "plain" is the spec's call
CALLS = {"plain": (1, "decay_first", False), "model": (2, "fla", True), "packed": (1, "decay_first", True)}
INPUTS = ("q", "k", "v", "p", "beta", "g")
BAD = {"q": float("nan"), "k": float("inf"), "v": float("nan"), "p": -float("inf"), "beta": float("inf"),
       "g": float("nan")}  # g = +inf is a g > 0, which the references refuse; -inf is a reset
POSITIONS = ("o", "dq", "dk", "dv", "dp", "dbeta", "dg")  # per position; the others per sequence
GRADS = ("dq", "dk", "dv", "dp", "dbeta", "dg", "dS0")
# the interpreter's numpy warns where the kernels compute the NaN they are meant to
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning",
                                        "ignore:overflow encountered:RuntimeWarning")


def inputs(call):
    """(x = [q, k, v, p, beta, g], do, state, d_final, cu) on the CPU in fp32: two batch rows (the plain call without
    a state), or LENGTHS packed in a batch of one."""
    HV, _, with_state = CALLS[call]
    x, state = model_inputs(3 if call == "packed" else 2, T, 1, HV, K, V, seed=5)
    cu = None
    if call == "packed":
        x, cu = pack(x, LENGTHS)
    gen = torch.Generator().manual_seed(6)
    do = torch.randn(x[2].shape, generator=gen)
    if not with_state:
        return x, do, None, None, cu
    state = 0.3 * state
    return x, do, state, torch.randn(state.shape, generator=gen), cu


def run(impl, comba, dispatch, call, x, do, state, d_final, cu):
    """The outputs and gradients of one call by name (o, dq, dk, dv, dp, dbeta, dg; with a state also S, dS0), on
    the CPU: the reference in fp32, the public function in fp32 through autograd, the fused kernels on TRITON_DEVICE
    in DTYPE (g in fp32)."""
    _, order, _ = CALLS[call]
    names = ("o", "S", *GRADS) if state is not None else ("o", *GRADS[:-1])
    if impl == "public":
        ins = [t.clone().requires_grad_() for t in (*x, *([state] if state is not None else []))]
        if state is None:
            outs, d_outs = (comba.comba_attention(*ins, SCALE),), (do,)
        else:
            outs = comba.comba_attention(*ins[:6], SCALE, initial_state=ins[6], output_final_state=True,
                                         cu_seqlens=cu, read_order=order)
            d_outs = (do, d_final)
        got = (*outs, *torch.autograd.grad(outs, ins, d_outs))
    elif impl == "reference":
        if state is None:
            got = (comba.comba_forward_reference(*x, SCALE), *comba.comba_backward_reference(*x, do, SCALE))
        else:
            reference = submodule(comba, "reference")
            got = (*reference.comba_state_forward_reference(*x, state, SCALE, True, cu, order),
                   *reference.comba_state_backward_reference(*x, state, do, d_final, SCALE, cu, order))
    else:
        x = [t.to(TRITON_DEVICE, DTYPE if i < 5 else torch.float32) for i, t in enumerate(x)]
        do = do.to(TRITON_DEVICE, DTYPE)
        state, d_final, cu = (None if t is None else t.to(TRITON_DEVICE) for t in (state, d_final, cu))
        if state is None:
            got = (dispatch.comba_forward_cuda(*x, SCALE), *dispatch.comba_backward_cuda(*x, do, SCALE))
        else:
            got = (*dispatch.comba_state_forward_cuda(*x, state, SCALE, True, cu, order),
                   *dispatch.comba_state_backward_cuda(*x, state, do, d_final, SCALE, cu, order))
    return {name: t.detach().cpu().float() for name, t in zip(names, got)}


@pytest.fixture(scope="module")
def clean_runs(comba, dispatch):
    """The clean call's results per (impl, call), computed once."""
    return functools.cache(lambda impl, call: run(impl, comba, dispatch, call, *inputs(call)))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("call", CALLS)
@pytest.mark.parametrize("which", INPUTS)
def test_non_finite_step_stays_in_place(comba, dispatch, clean_runs, impl, call, which):
    x, do, state, d_final, cu = inputs(call)
    i = INPUTS.index(which)
    head = CALLS[call][0] - 1  # the last value head; q, k and p have one head, which every value head reads
    t = LENGTHS[0] + STEP if call == "packed" else STEP
    where = (0 if call == "packed" else 1, t, 0 if which in ("q", "k", "p") else head)
    x[i] = x[i].clone()
    x[i][where + ((1,) if x[i].dim() == 4 else ())] = BAD[which]
    got = run(impl, comba, dispatch, call, x, do, state, d_final, cu)
    clean = clean_runs(impl, call)
    seq = 1  # the bad sequence
    for name in got:
        per_position = name in POSITIONS
        parts, clean_parts = sequences(got[name], cu, per_position), sequences(clean[name], cu, per_position)
        for n in range(len(parts)):
            if n != seq:
                assert torch.equal(parts[n], clean_parts[n]), f"{name} of sequence {n}"
    o, o_clean = sequences(got["o"], cu, True)[seq], sequences(clean["o"], cu, True)[seq]
    assert torch.equal(o[:STEP], o_clean[:STEP]), "o before the bad step"
    assert not torch.isfinite(o[STEP, head]).all(), "o at the bad step"
    if head > 0 and which not in ("q", "k", "p"):  # the value heads that do not read the bad value
        assert torch.equal(o[:, :head], o_clean[:, :head]), "o of another value head"
        assert torch.equal(got["S"][seq, :head], clean["S"][seq, :head]), "final state of another value head"
    if impl == "fused" and which == "q":  # q_t is read by o_t alone, where the references mark every later step
        assert torch.equal(o[STEP + 1:], o_clean[STEP + 1:]), "o after a non-finite q"
    elif impl == "fused":
        reference = run("reference", comba, dispatch, call,
                        [t.to(DTYPE).float() if j < 5 else t for j, t in enumerate(x)], do, state, d_final, cu)
        for name in ("o", "S")[:1 + (state is not None)]:
            assert not (torch.isfinite(got[name]) & ~torch.isfinite(reference[name])).any(), name
