"""based-bwd's state and packed sequences through `get_kernel`: `based_attention` with initial_state,
output_final_state and cu_seqlens, and `based_decode`, against independent float64 computations (the quadratic
form over the full causal weight matrix with the initial state's read-out, and the step-by-step recurrence over
the feature map); gradients of q, k, v and the initial state; packed == per-sequence calls; prefill then
continue == one call; decode == forward; non-finite inputs stay in their place; bad arguments."""

import math

import pytest
import torch

from testkit import needs_cuda, rel_err


def phi64(x):
    """[1, x, x_a x_b / sqrt(2) for a, b] in float64, written out independently of the package."""
    x = x.double()
    ones = torch.ones(*x.shape[:-1], 1, dtype=torch.float64)
    pairs = torch.einsum("...a,...b->...ab", x, x).reshape(*x.shape[:-1], -1) / math.sqrt(2)
    return torch.cat([ones, x, pairs], -1)


def quadratic_form(q, k, v, scale=None, state=None):
    """o_i = (phi(q~_i) . S0 + sum_{j<=i} A_ij v_j) / (phi(q~_i) . z0 + sum_{j<=i} A_ij + 1e-6), float64, from the
    full T x T causal weight matrix A_ij = 1 + s + s^2 / 2 (no chunks, no feature map but the state's read-out)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    q, k, v = (x.double().transpose(1, 2) for x in (q, k, v))
    s = (scale * q) @ k.transpose(-1, -2)
    A = torch.tril(1 + s + 0.5 * s * s)
    num, den = A @ v, A.sum(-1)
    if state is not None:
        S0, z0 = (x.double() for x in state)
        pq = phi64(scale * q)
        num, den = num + pq @ S0, den + (pq * z0[:, :, None]).sum(-1)
    return (num / (den + 1e-6)[..., None]).transpose(1, 2)


def recurrence(q, k, v, scale=None, state=None):
    """The state machine one step at a time in float64: S += phi(k_t) v_t^T, z += phi(k_t), then
    o_t = phi(q~_t) . S / (phi(q~_t) . z + 1e-6). Returns o and the final (S, z)."""
    B, T, H, K = q.shape
    scale = K**-0.5 if scale is None else scale
    P = 1 + K + K * K
    if state is None:
        S, z = torch.zeros(B, H, P, v.shape[-1], dtype=torch.float64), torch.zeros(B, H, P, dtype=torch.float64)
    else:
        S, z = (x.double() for x in state)
    out = []
    for t in range(T):
        pk, pq = phi64(k[:, t]), phi64(scale * q[:, t].double())
        S = S + pk[..., None] * v[:, t, :, None, :].double()
        z = z + pk
        out.append(torch.einsum("bhp,bhpv->bhv", pq, S) / (torch.einsum("bhp,bhp->bh", pq, z) + 1e-6)[..., None])
    return torch.stack(out, 1), (S, z)


def make(B, T, H, K, V, dtype=torch.float32, device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(B, T, H, K, generator=gen).to(device, dtype) for _ in range(2))
    v = torch.randn(B, T, H, V, generator=gen).to(device, dtype)
    return q, k, v


def prefix_state(N, H, K, V, T=20, seed=1, device="cpu"):
    """A realistic initial state: the float64 recurrence's final state over T random steps, as float32."""
    q, k, v = make(N, T, H, K, V, seed=seed)
    _, (S, z) = recurrence(q, k, v)
    return S.float().to(device), z.float().to(device)


H, K, V = 2, 4, 8  # small: the CPU runs these at T up to 1000


@pytest.mark.kernels_ci
@pytest.mark.parametrize("T", [1, 127, 129, 1000])
def test_forward_with_state_matches_float64(based, T):
    q, k, v = make(2, T, H, K, V)
    state = prefix_state(2, H, K, V)
    o, (S, z) = based.based_attention(q, k, v, initial_state=state, output_final_state=True)
    assert o.dtype == torch.float32 and o.shape == v.shape
    assert S.dtype == z.dtype == torch.float32 and S.shape == state[0].shape and z.shape == state[1].shape
    assert rel_err(o, quadratic_form(q, k, v, state=state)) < 1e-5
    o_rec, (S_rec, z_rec) = recurrence(q, k, v, state=state)
    assert rel_err(o, o_rec) < 1e-5
    assert rel_err(S, S_rec) < 1e-5 and rel_err(z, z_rec) < 1e-6


@pytest.mark.kernels_ci
def test_final_state_without_initial_state(based):
    q, k, v = make(1, 70, H, K, V)
    o, (S, z) = based.based_attention(q, k, v, scale=0.7, output_final_state=True)
    o_rec, (S_rec, z_rec) = recurrence(q, k, v, scale=0.7)
    assert rel_err(o, o_rec) < 1e-5 and rel_err(S, S_rec) < 1e-5 and rel_err(z, z_rec) < 1e-6
    assert torch.equal(o, based.based_attention(q, k, v, scale=0.7))  # the stateless call: the same steps


def lengths_to_cu(lengths):
    return torch.tensor([0] + lengths).cumsum(0).to(torch.int32)


LENGTHS = [5, 64, 1, 0, 130, 70]  # a chunk exactly, a single step, an empty sequence, ragged lengths


@pytest.mark.kernels_ci
def test_packed_equals_per_sequence_calls_and_float64(based):
    cu = lengths_to_cu(LENGTHS)
    q, k, v = make(1, sum(LENGTHS), H, K, V)
    state = prefix_state(len(LENGTHS), H, K, V)
    o, (S, z) = based.based_attention(q, k, v, initial_state=state, output_final_state=True, cu_seqlens=cu)
    assert o.shape == v.shape and S.shape[0] == z.shape[0] == len(LENGTHS)
    for n, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        mine = (S[n : n + 1], z[n : n + 1])
        init = (state[0][n : n + 1], state[1][n : n + 1])
        if a == b:  # an empty sequence passes its state through
            assert torch.equal(mine[0], init[0]) and torch.equal(mine[1], init[1])
            continue
        o_n, (S_n, z_n) = based.based_attention(q[:, a:b], k[:, a:b], v[:, a:b], initial_state=init,
                                                output_final_state=True)
        assert rel_err(o[:, a:b], o_n) < 1e-6 and rel_err(mine[0], S_n) < 1e-6 and rel_err(mine[1], z_n) < 1e-6
        assert rel_err(o[:, a:b], quadratic_form(q[:, a:b], k[:, a:b], v[:, a:b], state=init)) < 1e-5


@pytest.mark.kernels_ci
def test_packed_int64_offsets_without_state(based):
    cu = lengths_to_cu([40, 90]).long()
    q, k, v = make(1, 130, H, K, V)
    o = based.based_attention(q, k, v, cu_seqlens=cu)
    want = torch.cat([quadratic_form(q[:, a:b], k[:, a:b], v[:, a:b]) for a, b in [(0, 40), (40, 130)]], 1)
    assert rel_err(o, want) < 1e-5


@pytest.mark.kernels_ci
@pytest.mark.parametrize("T1,T2", [(100, 77), (64, 64), (1, 129)])
def test_prefill_then_continue_equals_one_call(based, T1, T2):
    q, k, v = make(2, T1 + T2, H, K, V)
    state = prefix_state(2, H, K, V)
    o, (S, z) = based.based_attention(q, k, v, initial_state=state, output_final_state=True)
    o1, mid = based.based_attention(q[:, :T1], k[:, :T1], v[:, :T1], initial_state=state, output_final_state=True)
    o2, (S2, z2) = based.based_attention(q[:, T1:], k[:, T1:], v[:, T1:], initial_state=mid, output_final_state=True)
    assert rel_err(torch.cat([o1, o2], 1), o) < 1e-6
    assert rel_err(S2, S) < 1e-6 and rel_err(z2, z) < 1e-6


@pytest.mark.kernels_ci
def test_decode_token_by_token_equals_the_forward(based):
    """A prompt through the forward with output_final_state, then the rest one token at a time and in blocks
    (1, 5, 64 tokens): every output and the last state equal one forward call over the whole sequence."""
    T0, blocks = 30, [1, 1, 5, 64, 1]
    T = T0 + sum(blocks)
    q, k, v = make(3, T, H, K, V)
    o_all, (S_all, z_all) = based.based_attention(q, k, v, scale=0.6, output_final_state=True)
    o0, state = based.based_attention(q[:, :T0], k[:, :T0], v[:, :T0], scale=0.6, output_final_state=True)
    outs, t = [o0], T0
    for n in blocks:
        given = tuple(x.clone() for x in state)
        o_n, state_next = based.based_decode(q[:, t : t + n], k[:, t : t + n], v[:, t : t + n], state, scale=0.6)
        assert torch.equal(given[0], state[0]) and torch.equal(given[1], state[1])  # not modified in place
        outs.append(o_n)
        state, t = state_next, t + n
    assert rel_err(torch.cat(outs, 1), o_all) < 1e-6
    assert rel_err(state[0], S_all) < 1e-6 and rel_err(state[1], z_all) < 1e-6
    o_rec, (S_rec, _) = recurrence(q, k, v, scale=0.6)
    assert rel_err(torch.cat(outs, 1), o_rec) < 1e-5 and rel_err(state[0], S_rec) < 1e-5


@pytest.mark.kernels_ci
def test_decode_bf16_keeps_a_float32_state(based):
    q, k, v = make(2, 3, H, K, V, torch.bfloat16)
    state = prefix_state(2, H, K, V)
    o, (S, z) = based.based_decode(q, k, v, state)
    assert o.dtype == torch.bfloat16 and S.dtype == z.dtype == torch.float32
    o_rec, (S_rec, _) = recurrence(q, k, v, state=state)
    assert rel_err(o, o_rec) < 1e-2 and rel_err(S, S_rec) < 1e-5


# ---- gradients

def grads64(fn, inputs, weights):
    ins = [x.detach().double().requires_grad_(True) for x in inputs]
    out = fn(*ins)
    loss = sum((o * w.double()).sum() for o, w in zip(out, weights))
    return torch.autograd.grad(loss, ins)


def state_float64(q, k, v, state, cu=None, scale=None):
    """(o, S, z) in float64 from the initial state (S0, z0): o from the quadratic form per sequence (each packed
    sequence of cu, or the batch), the final state as the initial one plus sum_j phi(k_j) v_j^T and phi(k_j)."""
    T = q.shape[1]
    bounds = list(zip(cu[:-1].tolist(), cu[1:].tolist())) if cu is not None else [(0, T)]
    os_, Ss, zs = [], [], []
    for n, (a, b) in enumerate(bounds):
        rows = slice(n, n + 1) if cu is not None else slice(None)
        init = (state[0][rows].double(), state[1][rows].double())
        if a == b:  # an empty sequence passes its state through
            Ss.append(init[0])
            zs.append(init[1])
            continue
        os_.append(quadratic_form(q[:, a:b], k[:, a:b], v[:, a:b], scale, state=init))
        pk = phi64(k[:, a:b])
        Ss.append(init[0] + torch.einsum("bthp,bthv->bhpv", pk, v[:, a:b].double()))
        zs.append(init[1] + pk.sum(1))
    return torch.cat(os_, 1), torch.cat(Ss, 0), torch.cat(zs, 0)


@pytest.mark.kernels_ci
@pytest.mark.parametrize("packed", [False, True])
def test_gradients_match_float64_autograd(based, packed):
    """dq, dk, dv, dS0, dz0 of a loss on o and the final state, through `based_attention` (fp32 on the CPU: the
    reference's analytic backward) against float64 autograd of the quadratic form and of the recurrence's final
    state."""
    lengths = [70, 1, 59] if packed else [130]
    N, T = (len(lengths), sum(lengths)) if packed else (2, 130)
    B = 1 if packed else N
    cu = lengths_to_cu(lengths) if packed else None
    q, k, v = make(B, T, H, K, V)
    S0, z0 = prefix_state(N, H, K, V)
    gen = torch.Generator().manual_seed(5)
    w_o, w_S, w_z = (torch.randn(x.shape, generator=gen) for x in (v, S0, z0))

    def ours(q, k, v, S0, z0):
        o, (S, z) = based.based_attention(q, k, v, initial_state=(S0, z0), output_final_state=True, cu_seqlens=cu)
        return o, S, z

    def float64(q, k, v, S0, z0):
        return state_float64(q, k, v, (S0, z0), cu)

    ins = [x.clone().requires_grad_(True) for x in (q, k, v, S0, z0)]
    out = ours(*ins)
    loss = sum((o * w).sum() for o, w in zip(out, (w_o, w_S, w_z)))
    got = torch.autograd.grad(loss, ins)
    want = grads64(float64, (q, k, v, S0, z0), (w_o, w_S, w_z))
    for name, g, ref in zip(["dq", "dk", "dv", "dS0", "dz0"], got, want):
        assert g.dtype == torch.float32
        assert rel_err(g, ref) < 1e-5, name


@pytest.mark.kernels_ci
def test_gradcheck_float64_reference(based):
    """torch.autograd.gradcheck of the reference in float64 (its exact-arithmetic mode) across chunk boundaries
    (chunk = 3), with two packed sequences and an initial state."""
    q, k, v = (x.double() for x in make(1, 8, 1, 2, 3))
    S0, z0 = (x.double() for x in prefix_state(2, 1, 2, 3, T=3))
    cu = torch.tensor([0, 3, 8])

    def fn(q, k, v, S0, z0):
        o, (S, z) = based.based_forward_reference(q, k, v, 0.8, initial_state=(S0, z0), output_final_state=True,
                                                  cu_seqlens=cu, chunk=3)
        return o, S, z

    ins = [x.clone().requires_grad_(True) for x in (q, k, v, S0, z0)]
    assert torch.autograd.gradcheck(fn, ins)


@pytest.mark.kernels_ci
def test_decode_gradients_match_float64(based):
    q, k, v = make(2, 4, H, K, V)
    S0, z0 = prefix_state(2, H, K, V)
    gen = torch.Generator().manual_seed(3)
    w_o, w_S = torch.randn(v.shape, generator=gen), torch.randn(S0.shape, generator=gen)
    ins = [x.clone().requires_grad_(True) for x in (q, k, v, S0, z0)]
    o, (S, _) = based.based_decode(*ins[:3], tuple(ins[3:]))
    got = torch.autograd.grad((o * w_o).sum() + (S * w_S).sum(), ins)

    def float64(q, k, v, S0, z0):
        o, (S, z) = recurrence(q, k, v, state=(S0, z0))
        return o, S

    want = grads64(float64, (q, k, v, S0, z0), (w_o, w_S))
    for name, g, ref in zip(["dq", "dk", "dv", "dS0", "dz0"], got, want):
        assert rel_err(g, ref) < 1e-5, name


# ---- non-finite inputs stay in their place


@pytest.mark.kernels_ci
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("which", ["q", "k", "v"])
@pytest.mark.parametrize("t", [100, 200, 64])
def test_non_finite_step_changes_nothing_before_it(based, bad, which, t):
    q, k, v = make(2, 260, H, K, V)
    clean = based.based_attention(q, k, v)
    x = {"q": q, "k": k, "v": v}[which].clone()
    x[1, t, 0, 1] = bad
    args = {"q": q, "k": k, "v": v, which: x}
    o = based.based_attention(args["q"], args["k"], args["v"])
    assert torch.equal(o[:, :t], clean[:, :t]) and torch.equal(o[0], clean[0])
    assert not torch.isfinite(o[1, t, 0]).all()  # the step itself sees the bad value


@pytest.mark.kernels_ci
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("which", ["q", "k", "v", "state"])
def test_non_finite_stays_in_its_packed_sequence(based, bad, which):
    """A bad value in the third of four packed sequences (at its step 10, or in its initial state): the other
    sequences' outputs and final states, and the third's steps before 10, are bit for bit those of the clean
    call."""
    lengths = [50, 100, 90, 30]
    cu = lengths_to_cu(lengths)
    q, k, v = make(1, sum(lengths), H, K, V)
    state = prefix_state(4, H, K, V)
    clean, (S_c, z_c) = based.based_attention(q, k, v, initial_state=state, output_final_state=True, cu_seqlens=cu)
    args = {"q": q.clone(), "k": k.clone(), "v": v.clone(), "state": tuple(x.clone() for x in state)}
    t = 150 + 10
    if which == "state":
        args["state"][0][2, 0, 3, 2] = bad
        t = 150
    else:
        args[which][0, t, 1, 2] = bad
    o, (S, z) = based.based_attention(args["q"], args["k"], args["v"], initial_state=args["state"],
                                      output_final_state=True, cu_seqlens=cu)
    others = torch.ones(sum(lengths), dtype=torch.bool)
    others[150:240] = False
    assert torch.equal(o[0, others], clean[0, others]) and torch.equal(o[0, 150:t], clean[0, 150:t])
    for n in (0, 1, 3):
        assert torch.equal(S[n], S_c[n]) and torch.equal(z[n], z_c[n])
    assert not torch.isfinite(o[0, t]).all()


# ---- bad arguments

def _state(N=1, H=2, K=8, V=8):
    P = 1 + K + K * K
    return torch.zeros(N, H, P, V), torch.ones(N, H, P)


BAD_STATE = [
    (dict(cu_seqlens=torch.tensor([0, 5, 3, 16])), ValueError, "cu_seqlens must be non-decreasing"),
    (dict(cu_seqlens=torch.tensor([1, 16])), ValueError, "cu_seqlens must start at 0 and end at T=16"),
    (dict(cu_seqlens=torch.tensor([0, 15])), ValueError, "cu_seqlens must start at 0 and end at T=16"),
    (dict(cu_seqlens=torch.tensor([0.0, 16.0])), TypeError, "cu_seqlens must be int32 or int64"),
    (dict(cu_seqlens=torch.tensor([[0, 16]])), ValueError, "cu_seqlens must have rank 1"),
    (dict(cu_seqlens=torch.tensor([0])), ValueError, "cu_seqlens must hold N \\+ 1 >= 2 offsets"),
    (dict(initial_state=_state()[0]), TypeError, "initial_state must be the pair \\(S, z\\)"),
    (dict(initial_state=(_state()[0].double(), _state()[1])), TypeError,
     "initial_state\\[0\\] \\(S\\) must be float32"),
    (dict(initial_state=(_state()[0], _state(H=3)[1])), ValueError, "initial_state\\[1\\] \\(z\\) must have the shape"),
    (dict(initial_state=_state(N=2)), ValueError, "initial_state\\[0\\] \\(S\\) must have the shape \\(1, 2, 73, 8\\)"),
    (dict(initial_state=_state(), cu_seqlens=torch.tensor([0, 4, 16])), ValueError,
     "initial_state\\[0\\] \\(S\\) must have the shape \\(2,"),
    (dict(output_final_state=1), TypeError, "output_final_state must be a bool"),
    (dict(output_final_state=0), TypeError, "output_final_state must be a bool"),
]


@pytest.mark.kernels_ci
@pytest.mark.parametrize("kwargs,exc,match", BAD_STATE)
def test_bad_state_arguments_raise(based, kwargs, exc, match):
    q, k, v = make(1, 16, 2, 8, 8)
    with pytest.raises(exc, match=match):
        based.based_attention(q, k, v, **kwargs)


def test_packed_needs_a_batch_of_one(based):
    q, k, v = make(2, 16, 2, 8, 8)
    with pytest.raises(ValueError, match="q must have B = 1, got B=2"):
        based.based_attention(q, k, v, cu_seqlens=torch.tensor([0, 16]))


@pytest.mark.kernels_ci
def test_bad_decode_arguments_raise(based):
    q, k, v = make(1, 65, 2, 8, 8)
    with pytest.raises(ValueError, match="1 to 64 new tokens"):
        based.based_decode(q, k, v, _state())
    with pytest.raises(ValueError, match="state\\[0\\] \\(S\\) must have the shape \\(1, 2, 73, 8\\)"):
        based.based_decode(q[:, :1], k[:, :1], v[:, :1], _state(V=4))
    with pytest.raises(TypeError, match="state must be the pair"):
        based.based_decode(q[:, :1], k[:, :1], v[:, :1], None)
    with pytest.raises(TypeError, match="k must have the dtype of q"):
        based.based_decode(q[:, :1], k[:, :1].half(), v[:, :1], _state())


# ---- on CUDA: the reference path on the GPU, and a captured decode step


@needs_cuda
def test_state_and_packing_on_cuda(based):
    lengths = [300, 1, 211]
    cu = lengths_to_cu(lengths).cuda()
    q, k, v = make(1, sum(lengths), 2, 16, 64, torch.bfloat16, "cuda")
    state = prefix_state(3, 2, 16, 64, device="cuda")
    o, (S, z) = based.based_attention(q, k, v, initial_state=state, output_final_state=True, cu_seqlens=cu)
    assert o.dtype == torch.bfloat16 and S.device == q.device
    for n, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        init = tuple(x[n : n + 1].cpu() for x in state)
        assert rel_err(o[:, a:b], quadratic_form(q[:, a:b].cpu(), k[:, a:b].cpu(), v[:, a:b].cpu(), state=init)) < 1e-2


@needs_cuda
def test_decode_step_replays_in_a_cuda_graph(based):
    """One decode step of B = 8 sequences captured in a CUDA graph: a replay on a new token and state equals the
    eager step on them."""
    B, Hc, Kc, Vc = 8, 4, 16, 64
    q, k, v = make(B, 1, Hc, Kc, Vc, torch.bfloat16, "cuda")
    S, z = prefix_state(B, Hc, Kc, Vc, device="cuda")
    static = [x.clone() for x in (q, k, v, S, z)]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            based.based_decode(*static[:3], (static[3], static[4]))
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o_static, (S_static, _) = based.based_decode(*static[:3], (static[3], static[4]))
    fresh = make(B, 1, Hc, Kc, Vc, torch.bfloat16, "cuda", seed=7) + prefix_state(B, Hc, Kc, Vc, seed=8, device="cuda")
    for x, y in zip(static, fresh):
        x.copy_(y)
    graph.replay()
    torch.cuda.synchronize()
    o, (S_new, _) = based.based_decode(*fresh[:3], tuple(fresh[3:]))
    assert rel_err(o_static, o) < 1e-6 and rel_err(S_static, S_new) < 1e-6
