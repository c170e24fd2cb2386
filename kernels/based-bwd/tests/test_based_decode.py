"""based-bwd's fused decode kernel (`dispatch.portable_decode`, `portable/decode.py`): on the GPU, or on CPU tensors
under Triton's interpreter, against the float64 step-by-step recurrence of test_based_state.py; the state it is
given is left as it is, the new one goes to new tensors or to `out`; a non-finite token stays in its place; on
CUDA `based_decode` takes it (the reference where autograd records the call), and two captured steps alternate
two state buffers."""

import pytest
import torch

from test_based_state import make, prefix_state, recurrence
from testkit import HAS_CUDA, needs_cuda, needs_triton, rel_err

DEVICE = "cuda" if HAS_CUDA else "cpu"
BF16_TOL = 1e-2


def decode_inputs(B, T, H, K, V, dtype, seed=0):
    q, k, v = make(B, T, H, K, V, dtype, DEVICE, seed=seed)
    return q, k, v, prefix_state(B, H, K, V, seed=seed + 1, device=DEVICE)


def float64_step(q, k, v, state, scale):
    o, (S, z) = recurrence(q.cpu(), k.cpu(), v.cpu(), scale, tuple(x.cpu() for x in state))
    return o, S, z


# (T, K, V, bv): one token, a few, the most a call takes; a ragged last V tile (V = 24 over 16-column tiles) and
# one tile wider than V
CASES = [(1, 16, 24, 16), (3, 8, 24, 16), (64, 8, 16, 32)]


@needs_triton
@pytest.mark.parametrize("T,K,V,bv", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_decode_matches_float64(dispatch, T, K, V, bv, dtype):
    q, k, v, state = decode_inputs(2, T, 2, K, V, dtype)
    given = tuple(x.clone() for x in state)
    o, (S, z) = dispatch.portable_decode(q, k, v, state, 0.3, dispatch.DecodeConfig(bv=bv, warps=2))
    assert o.dtype == dtype and o.shape == v.shape and S.dtype == z.dtype == torch.float32
    assert torch.equal(state[0], given[0]) and torch.equal(state[1], given[1])  # not modified
    o64, S64, z64 = float64_step(q, k, v, state, 0.3)
    assert rel_err(o, o64) < (1e-5 if dtype == torch.float32 else BF16_TOL)
    assert rel_err(S, S64) < 1e-5 and rel_err(z, z64) < 1e-6  # the state adds the rounded inputs exactly


@needs_triton
def test_fused_decode_fp16(dispatch):
    q, k, v, state = decode_inputs(1, 2, 3, 16, 40, torch.float16, seed=4)
    o, (S, _) = dispatch.portable_decode(q, k, v, state, 16**-0.5)
    o64, S64, _ = float64_step(q, k, v, state, 16**-0.5)
    assert o.dtype == torch.float16 and rel_err(o, o64) < BF16_TOL and rel_err(S, S64) < 1e-5


@needs_triton
@pytest.mark.parametrize("which", ["q", "k", "v"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_fused_decode_non_finite_token_stays_in_place(dispatch, which, bad):
    """A NaN or inf in token 1 of sequence 0: sequence 1 (output and state) and sequence 0's token 0 are bit for
    bit those of the clean call, token 1's output is non-finite, and so is the new state of a non-finite k or v
    (a q enters no state: it stays the clean one)."""
    q, k, v, state = decode_inputs(2, 3, 1, 8, 16, torch.float32, seed=6)
    args = {"q": q, "k": k, "v": v}
    clean, (S_c, z_c) = dispatch.portable_decode(q, k, v, state, 0.3)
    args[which] = args[which].clone()
    args[which][0, 1, 0, 2] = bad
    o, (S, z) = dispatch.portable_decode(args["q"], args["k"], args["v"], state, 0.3)
    assert torch.equal(o[1], clean[1]) and torch.equal(S[1], S_c[1]) and torch.equal(z[1], z_c[1])
    assert torch.equal(o[0, 0], clean[0, 0]) and not torch.isfinite(o[0, 1]).all()
    if which == "q":
        assert torch.equal(S[0], S_c[0]) and torch.equal(z[0], z_c[0])
    else:
        assert not torch.isfinite(S[0]).all()


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_based_decode_takes_the_kernel_on_cuda(based, dispatch, dtype):
    """`based_decode` on CUDA is the fused kernel (bit for bit), on every dtype; with a tensor that requires grad
    it is the reference, differentiable."""
    q, k, v, state = decode_inputs(4, 5, 4, 16, 128, dtype, seed=9)
    o, (S, z) = based.based_decode(q, k, v, state)
    o_k, (S_k, z_k) = dispatch.portable_decode(q, k, v, state, 16**-0.5)
    assert torch.equal(o, o_k) and torch.equal(S, S_k) and torch.equal(z, z_k)
    o64, S64, _ = float64_step(q, k, v, state, 16**-0.5)
    assert rel_err(o, o64) < (1e-5 if dtype == torch.float32 else BF16_TOL) and rel_err(S, S64) < 1e-5
    leaf = v.clone().requires_grad_(True)
    o_ref, _ = based.based_decode(q, k, leaf, state)
    assert o_ref.grad_fn is not None and rel_err(o_ref.detach(), o64) < (1e-5 if dtype == torch.float32 else BF16_TOL)


@needs_triton
def test_fused_decode_writes_into_out(dispatch):
    q, k, v, state = decode_inputs(2, 2, 2, 8, 24, torch.bfloat16, seed=11)
    out = tuple(torch.full_like(x, float("nan")) for x in state)
    o, new = dispatch.portable_decode(q, k, v, state, 0.3, dispatch.DecodeConfig(bv=16, warps=2), out=out)
    assert new[0] is out[0] and new[1] is out[1]
    o64, S64, z64 = float64_step(q, k, v, state, 0.3)
    assert rel_err(o, o64) < BF16_TOL and rel_err(out[0], S64) < 1e-5 and rel_err(out[1], z64) < 1e-6


@pytest.mark.kernels_ci
def test_based_decode_out_on_the_reference_path(based):
    q, k, v = make(2, 3, 2, 4, 8, seed=12)
    state = prefix_state(2, 2, 4, 8, seed=13)
    out = tuple(torch.empty_like(x) for x in state)
    o, new = based.based_decode(q, k, v, state, 0.5, out=out)
    assert new[0] is out[0] and new[1] is out[1]
    o_new, (S, z) = based.based_decode(q, k, v, state, 0.5)
    assert torch.equal(o, o_new) and torch.equal(out[0], S) and torch.equal(out[1], z)


@pytest.mark.kernels_ci
def test_bad_decode_out_raises(based):
    q, k, v = make(1, 1, 2, 8, 8)
    state = prefix_state(1, 2, 8, 8)
    fresh = tuple(torch.empty_like(x) for x in state)
    cases = [
        ((state[0], fresh[1]), "out\\[0\\] \\(S\\) must not share memory with state\\[0\\] \\(S\\)"),
        ((fresh[0], state[1]), "out\\[1\\] \\(z\\) must not share memory with state\\[1\\] \\(z\\)"),
        ((fresh[0], fresh[0][:, :, :, 0]), "out\\[1\\] \\(z\\) must be contiguous"),
        ((fresh[0], fresh[0].view(-1)[: fresh[1].numel()].view(fresh[1].shape)),
         "out\\[1\\] \\(z\\) must not share memory with out\\[0\\] \\(S\\)"),
        ((fresh[0][:, :, :-1], fresh[1]), "out\\[0\\] \\(S\\) must have the shape"),
    ]
    for out, match in cases:
        with pytest.raises(ValueError, match=match):
            based.based_decode(q, k, v, state, out=out)
    with pytest.raises(TypeError, match="out must be the pair"):
        based.based_decode(q, k, v, state, out=fresh[0])


@needs_cuda
def test_two_captured_steps_alternate_two_state_buffers(based):
    """A serving loop without copies: graph A->B (state in A, out B) and graph B->A, replayed in turn on new
    tokens, equal the eager steps chained."""
    B, Hc, Kc, Vc = 8, 4, 16, 64
    q, k, v, state = decode_inputs(B, 1, Hc, Kc, Vc, torch.bfloat16, seed=13)
    A = tuple(x.clone() for x in state)
    Bf = tuple(torch.empty_like(x) for x in state)
    tokens = [x.clone() for x in (q, k, v)]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            based.based_decode(*tokens, A, out=Bf)
    torch.cuda.current_stream().wait_stream(stream)
    graphs, outs = [], []
    for src, dst in ((A, Bf), (Bf, A)):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs.append(based.based_decode(*tokens, src, out=dst)[0])
        graphs.append(graph)
    for x, y in zip(A, state):
        x.copy_(y)
    eager_state, steps = state, []
    for step in range(4):
        new = decode_inputs(B, 1, Hc, Kc, Vc, torch.bfloat16, seed=20 + step)[:3]
        for x, y in zip(tokens, new):
            x.copy_(y)
        graphs[step % 2].replay()
        o, eager_state = based.based_decode(*new, eager_state)
        torch.cuda.synchronize()
        steps.append(rel_err(outs[step % 2], o))
    held = Bf if len(steps) % 2 else A
    assert max(steps) < 1e-6 and rel_err(held[0], eager_state[0]) < 1e-6 and rel_err(held[1], eager_state[1]) < 1e-6
