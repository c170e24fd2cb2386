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
size they take (V = 64 keeps the Gluon kernels out: they run at V = 128 only). On Hopper the Gluon kernels take the
plain call in bf16 with V = 128, at K = 64 (the chunk transform, the forward scan, the gradients) and K = 128 (both
scans, the gradients): `test_gluon_kernels_keep_a_non_finite_step_in_place` holds them to the same rule, at 200
steps (four chunks: the bad step's is followed by two), and `test_gluon_transform_keeps_a_non_finite_step_in_place`
the Gluon chunk transform's A alone."""

import functools

import pytest
import torch

from testkit import HAS_CUDA, needs_cuda, needs_triton, sequences, submodule
from test_model_interface import model_inputs, pack

TRITON_DEVICE = "cuda" if HAS_CUDA else "cpu"
DTYPE = torch.bfloat16 if HAS_CUDA else torch.float32
T, K, V = 110, 64, 64  # two chunks, the bad step inside the second
GLUON_T, GLUON_V = 200, 128  # the Gluon kernels' plain call: four chunks
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


def inputs(call, shape=(T, K, V)):
    """(x = [q, k, v, p, beta, g], do, state, d_final, cu) on the CPU in fp32 of shape (T, K, V): two batch rows (the
    plain call without a state), or LENGTHS packed in a batch of one."""
    HV, _, with_state = CALLS[call]
    steps, *sizes = shape
    x, state = model_inputs(3 if call == "packed" else 2, steps, 1, HV, *sizes, seed=5)
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
    """The clean call's results per (impl, call, shape), computed once."""
    return functools.cache(lambda impl, call, shape=(T, K, V): run(impl, comba, dispatch, call, *inputs(call, shape)))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("call", CALLS)
@pytest.mark.parametrize("which", INPUTS)
def test_non_finite_step_stays_in_place(comba, dispatch, clean_runs, impl, call, which):
    check_step_stays_in_place(comba, dispatch, clean_runs, impl, call, which)


@needs_cuda
@pytest.mark.parametrize("which", INPUTS)
@pytest.mark.parametrize("K", [64, 128])
def test_gluon_kernels_keep_a_non_finite_step_in_place(comba, dispatch, clean_runs, K, which):
    """The plain call in bf16 with V = 128, which the Gluon kernels take on Hopper, under the rule above; four chunks,
    so that two follow the bad step's."""
    q = torch.empty(2, GLUON_T, 1, K, device="cuda", dtype=torch.bfloat16)
    if not dispatch.plan(q, GLUON_V).gluon:
        pytest.skip("the Gluon kernels do not run on this GPU and Triton (FAST_PATHS)")
    check_step_stays_in_place(comba, dispatch, clean_runs, "fused", "plain", which, (GLUON_T, K, GLUON_V))


def check_step_stays_in_place(comba, dispatch, clean_runs, impl, call, which, shape=(T, K, V)):
    """The module docstring's rule for a bad value of input `which` in one call of inputs of this shape."""
    x, do, state, d_final, cu = inputs(call, shape)
    i = INPUTS.index(which)
    head = CALLS[call][0] - 1  # the last value head; q, k and p have one head, which every value head reads
    t = LENGTHS[0] + STEP if call == "packed" else STEP
    where = (0 if call == "packed" else 1, t, 0 if which in ("q", "k", "p") else head)
    x[i] = x[i].clone()
    x[i][where + ((1,) if x[i].dim() == 4 else ())] = BAD[which]
    got = run(impl, comba, dispatch, call, x, do, state, d_final, cu)
    clean = clean_runs(impl, call, shape)
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


@needs_cuda
@pytest.mark.parametrize("which", ("k", "p", "beta", "g"))
def test_gluon_transform_keeps_a_non_finite_step_in_place(comba, dispatch, which):
    """The Gluon chunk transform (K = 64) alone, in fp32: a bad k, p, beta or g at step 100 leaves every row of A
    before it as the clean inputs' A, bit for bit, and makes every row of its chunk from it on NaN, as the Triton
    transform does; the other (b, h) and chunks are untouched."""
    if "transform" not in dispatch.gluon_stages(torch.device("cuda", 0), torch.bfloat16, 64, GLUON_V):
        pytest.skip("the Gluon transform runs on Hopper only")
    x, *_ = inputs("plain", (128, 64, GLUON_V))
    x = [t.to("cuda", torch.bfloat16 if i < 5 else torch.float32) for i, t in enumerate(x)]
    gluon, portable = submodule(comba, "hopper.transform"), submodule(comba, "portable.transform")

    def transform(module, k, p, beta, g):
        A = torch.empty(2, 2, 64, 64, device="cuda")  # (B * H, N, 64, 64), fp32
        module.launch(k, p, beta, g, A)
        return A.cpu()

    clean = transform(gluon, *x[1:2], *x[3:])
    i = INPUTS.index(which)
    x[i] = x[i].clone()
    x[i][(1, STEP, 0) + ((1,) if x[i].dim() == 4 else ())] = BAD[which]
    got = transform(gluon, *x[1:2], *x[3:])
    assert torch.equal(got[0], clean[0]) and torch.equal(got[1, 0], clean[1, 0]), "another (b, h) or chunk"
    row = STEP - 64
    assert torch.equal(got[1, 1, :row], clean[1, 1, :row]), "A before the bad step"
    assert got[1, 1, row:].isnan().all(), "A from the bad step on"
    assert torch.equal(transform(portable, *x[1:2], *x[3:]).isnan(), got.isnan()), "the Triton transform's NaN"
