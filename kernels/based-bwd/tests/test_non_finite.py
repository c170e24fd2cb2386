"""based-bwd's rule for non-finite values (`reference.py` states it), on the eager reference (forward and analytic
backward), on `based_attention`'s CPU calls differentiated by autograd, and on the fused kernels (`dispatch`'s
portable paths): the plain call, the state call and packed sequences. A NaN or inf at step t = 100 of a 130-step
sequence (inside its second chunk, so that chunk's products see it) in q, k, v or the incoming gradient do,
against the clean call:

- a non-finite q, k or v at step t changes no output before t and no dq before t; the step's output is non-finite;
- a non-finite q or do at step t changes no dq but dq_t and no dk or dv after t; a non-finite q no final state;
- nothing changes in another batch row or packed sequence (outputs, final states, every gradient);
- the fused kernels' outputs and gradients are non-finite wherever the reference's are (in the bad step's chunk
  they make a whole row that reads the bad value NaN, where the reference's product keeps the columns that do not
  hold it finite).

The fused kernels run in the Triton interpreter on CPU tensors in fp32 (IEEE fp32 matmuls) and in bf16 on CUDA."""

import functools

import pytest
import torch

from testkit import HAS_CUDA, needs_triton, sequences, submodule
from test_based_state import lengths_to_cu, make, prefix_state

TRITON_DEVICE = "cuda" if HAS_CUDA else "cpu"
DTYPE = torch.bfloat16 if HAS_CUDA else torch.float32
T, H, K, V = 130, 1, 8, 8
STEP = 100  # the bad step of the bad sequence
LENGTHS = [40, T, 20]  # the packed call: the bad sequence between two others
SCALE = 0.3
IMPLS = [pytest.param("reference", marks=pytest.mark.kernels_ci), pytest.param("public", marks=pytest.mark.kernels_ci),
         pytest.param("fused", marks=needs_triton)]
CALLS = ["plain", "state", "packed"]
POSITIONS = ("o", "dq", "dk", "dv")  # per position; the others per sequence
# the interpreter's numpy warns where the kernels compute the NaN they are meant to
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")


def inputs(call):
    """(q, k, v, do, state, d_final, cu) on the CPU in fp32; the plain call has no state and no cu, the state
    call two batch rows from an initial state, the packed call LENGTHS packed from one."""
    N = len(LENGTHS) if call == "packed" else 2
    q, k, v = make(1, sum(LENGTHS), H, K, V) if call == "packed" else make(N, T, H, K, V)
    gen = torch.Generator().manual_seed(7)
    do = torch.randn(v.shape, generator=gen)
    if call == "plain":
        return q, k, v, do, None, None, None
    state = prefix_state(N, H, K, V)
    d_final = tuple(torch.randn(x.shape, generator=gen) for x in state)
    return q, k, v, do, state, d_final, lengths_to_cu(LENGTHS) if call == "packed" else None


def run(impl, based, dispatch, call, q, k, v, do, state, d_final, cu):
    """The outputs and gradients of one call by name (o, dq, dk, dv; with a state also S, z, dS0, dz0), on the
    CPU: the reference in fp32, the public function in fp32 through autograd, the fused kernels on TRITON_DEVICE
    in DTYPE."""
    if impl == "public":
        ins = [x.clone().requires_grad_() for x in (q, k, v, *(state or ()))]
        if call == "plain":
            outs, d_outs, names = (based.based_attention(*ins, SCALE),), (do,), ("o",)
        else:
            o, (S, z) = based.based_attention(*ins[:3], SCALE, initial_state=tuple(ins[3:]), output_final_state=True,
                                              cu_seqlens=cu)
            outs, d_outs, names = (o, S, z), (do, *d_final), ("o", "S", "z")
        grads = torch.autograd.grad(outs, ins, d_outs)
        return dict(zip((*names, "dq", "dk", "dv", "dS0", "dz0"), (x.detach() for x in (*outs, *grads))))
    if impl == "fused":
        q, k, v, do = (x.to(TRITON_DEVICE, DTYPE) for x in (q, k, v, do))
        state, d_final = ([x.to(TRITON_DEVICE) for x in pair] if pair else None for pair in (state, d_final))
        cu = None if cu is None else cu.to(TRITON_DEVICE)
    if call == "plain":
        if impl == "fused":
            o, grads = dispatch.portable_forward(q, k, v, SCALE), dispatch.portable_backward(q, k, v, do, SCALE)
        else:
            o, grads = (based.based_forward_reference(q, k, v, SCALE),
                        based.based_backward_reference(q, k, v, do, SCALE))
        got = dict(zip(("o", "dq", "dk", "dv"), (o, *grads)))
    elif impl == "fused":
        o, (S, z) = dispatch.portable_state_forward(q, k, v, SCALE, state, cu)
        *grads, (dS0, dz0) = dispatch.portable_state_backward(q, k, v, do, d_final, SCALE, state, cu)
        got = dict(zip(("o", "S", "z", "dq", "dk", "dv", "dS0", "dz0"), (o, S, z, *grads, dS0, dz0)))
    else:
        o, (S, z) = based.based_forward_reference(q, k, v, SCALE, initial_state=state, output_final_state=True,
                                                  cu_seqlens=cu)
        grads = based.based_state_backward_reference(q, k, v, do, *d_final, *state, cu, SCALE)
        got = dict(zip(("o", "S", "z", "dq", "dk", "dv", "dS0", "dz0"), (o, S, z, *grads)))
    return {name: x.cpu().float() for name, x in got.items()}


@pytest.fixture(scope="module")
def clean_runs(based, dispatch):
    """The clean call's results per (impl, call), computed once."""
    return functools.cache(lambda impl, call: run(impl, based, dispatch, call, *inputs(call)))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("call", CALLS)
@pytest.mark.parametrize("which", ["q", "k", "v", "do"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_step_stays_in_place(based, dispatch, clean_runs, impl, call, which, bad):
    q, k, v, do, state, d_final, cu = inputs(call)
    args = {"q": q, "k": k, "v": v, "do": do}
    if call == "packed":
        args[which][0, LENGTHS[0] + STEP, 0, 1] = bad
    else:
        args[which][1, STEP, 0, 1] = bad
    got = run(impl, based, dispatch, call, args["q"], args["k"], args["v"], args["do"], state, d_final, cu)
    clean = clean_runs(impl, call)
    seq = 1  # the bad sequence
    for name in got:
        per_position = name in POSITIONS
        parts, clean_parts = sequences(got[name], cu, per_position), sequences(clean[name], cu, per_position)
        for n in range(len(parts)):
            if n != seq:
                assert torch.equal(parts[n], clean_parts[n]), f"{name} of sequence {n}"
        x, x_clean = parts[seq], clean_parts[seq]
        if name in ("o", "dq"):
            assert torch.equal(x[:STEP], x_clean[:STEP]), f"{name} before the bad step"
        if which in ("q", "do") and name in ("dq", "dk", "dv"):
            assert torch.equal(x[STEP + 1 :], x_clean[STEP + 1 :]), f"{name} after the bad step"
        if which == "q" and name in ("S", "z"):
            assert torch.equal(x, x_clean), f"{name}: q reaches no state"
    if which != "do":
        assert not torch.isfinite(sequences(got["o"], cu, True)[seq][STEP]).all()
    if impl == "fused":
        reference = run("reference", based, dispatch, call, *(x.to(DTYPE).float() for x in args.values()), state,
                        d_final, cu)
        for name in got:
            assert not (torch.isfinite(got[name]) & ~torch.isfinite(reference[name])).any(), name
