"""The host path of `based_decode`: an eager call on plain CUDA tensors without autograd runs `dispatch.based_decode_cuda`
without the registered op (`common.direct_calls.calls_directly`), its argument checks skipped for a call signature
that passed them before (whether `out` shares memory with the state is checked every call), and a later call of the
signature runs the direct call kept for it (`dispatch.DIRECT_DECODES`); under torch.compile and FakeTensorMode the
registered `based_decode` op runs. On the CPU the direct route is taken by patching the decision, and runs the Triton
kernel under the interpreter; the kept direct calls' launches are seen under `tools.host_time`'s stubs
(`testkit.recorded_launches`), or run in the interpreter (`testkit.interpreted_kept_launches`)."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.flop_counter import FlopCounterMode

from test_based_decode import BF16_TOL, decode_inputs, float64_step
from testkit import (entry_calls, interpreted_kept_launches, needs_cuda, needs_triton, recorded_launches, rel_err,
                     submodule)


@pytest.fixture
def direct(based, monkeypatch):
    """The op module with every call routed directly to the entry point, the registered op refusing to run."""
    op = submodule(based, "op")
    monkeypatch.setattr(op, "calls_directly", lambda *tensors: True)

    def refuse(*args):
        raise AssertionError("the registered op ran")

    monkeypatch.setattr(op, "based_decode_op", refuse)
    return op


@pytest.fixture
def check_count(based, monkeypatch):
    """How many times check_decode_args ran, with the remembered signatures forgotten."""
    op = submodule(based, "op")
    count = []
    check = op.check_decode_args
    monkeypatch.setattr(op, "check_decode_args", lambda *args: count.append(1) or check(*args))
    monkeypatch.setattr(op, "_checked_decode", type(op._checked_decode)())
    return count


@needs_triton
def test_direct_route_runs_the_entry_point(based, direct):
    """The kernel (interpreted on the CPU) without the registered op, into new tensors and into `out`, twice (the
    second call through the remembered signature and the kept plan): the float64 recurrence."""
    q, k, v, state = decode_inputs(2, 2, 2, 8, 24, torch.bfloat16, seed=3)
    o64, S64, z64 = float64_step(q, k, v, state, 0.3)
    out = tuple(torch.full_like(x, float("nan")) for x in state)
    transposed = (state[0].transpose(1, 2).contiguous().transpose(1, 2), state[1])  # dense, not row-major
    for _ in range(2):
        for given in (state, transposed):
            o, (S, z) = based.based_decode(q, k, v, given, 0.3)
            assert rel_err(o, o64) < BF16_TOL and rel_err(S, S64) < 1e-5 and rel_err(z, z64) < 1e-6
        o, new = based.based_decode(q, k, v, state, 0.3, out=out)
        assert new[0] is out[0] and new[1] is out[1]
        assert rel_err(o, o64) < BF16_TOL and rel_err(out[0], S64) < 1e-5 and rel_err(out[1], z64) < 1e-6


def _state(q, v):
    B, _, H, K = q.shape
    P = 1 + K + K * K
    return torch.zeros(B, H, P, v.shape[-1]), torch.zeros(B, H, P)


BAD = [
    (lambda q, k, v, s, o: ((q, k.half(), v, s), {}), TypeError, "k must have the dtype of q"),
    (lambda q, k, v, s, o: ((q, k, v[..., :-1], s), {}), ValueError, "state\\[0\\] \\(S\\) must have the shape"),
    (lambda q, k, v, s, o: ((q, k, v, (s[0], s[1].double())), {}), TypeError, "state\\[1\\] \\(z\\) must be float32"),
    (lambda q, k, v, s, o: ((q, k, v, s), {"scale": True}), TypeError, "scale must be a float or None"),
    (lambda q, k, v, s, o: ((q, k, v, s), {"scale": float("nan")}), ValueError, "scale must be finite"),
    (lambda q, k, v, s, o: ((q, k, v, s[0]), {}), TypeError, "state must be the pair"),
    (lambda q, k, v, s, o: ((q, k, v, s), {"out": (s[0], o[1])}), ValueError,
     "out\\[0\\] \\(S\\) must not share memory with state\\[0\\] \\(S\\)"),
    (lambda q, k, v, s, o: ((q, k, v, s), {"out": (o[0], s[1])}), ValueError,
     "out\\[1\\] \\(z\\) must not share memory with state\\[1\\] \\(z\\)"),
    (lambda q, k, v, s, o: ((q, k, v, s), {"out": (o[0], o[0][:, :, :, 0])}), ValueError,
     "out\\[1\\] \\(z\\) must be contiguous"),
]


@pytest.mark.kernels_ci
@pytest.mark.parametrize("bad,exc,match", BAD)
def test_direct_route_raises_as_the_op_does(based, direct, monkeypatch, bad, exc, match):
    """After good calls of the same tensors (their signatures remembered, with and without out), a bad one still
    raises the checks' error before any launch."""
    monkeypatch.setattr(direct, "based_decode_cuda", lambda *args: pytest.fail("a bad call reached the launch"))
    q, k, v = (torch.zeros(1, 1, 2, 8) for _ in range(3))
    state = _state(q, v)
    fresh = tuple(torch.empty_like(x) for x in state)
    for good in ({}, {"out": fresh}):
        direct._checked_decode.add(direct._decode_signature(q, k, v, state, None, good.get("out")))
    args, kwargs = bad(q, k, v, state, fresh)
    with pytest.raises(exc, match=match):
        based.based_decode(*args, **kwargs)


@pytest.mark.kernels_ci
def test_a_signature_seen_before_skips_the_checks(based, check_count):
    """Every change the checks read (dtype, shape, device, scale, out's presence and strides) checks again; the same
    call does not."""
    q, k, v = (torch.zeros(1, 2, 2, 4) for _ in range(3))
    state = _state(q, v)
    out = tuple(torch.empty_like(x) for x in state)
    wide = torch.empty(*state[0].shape[:-1], 2 * v.shape[-1])[..., ::2]  # out[0] of the shape, not contiguous
    calls = [
        lambda: based.based_decode(q, k, v, state),
        lambda: based.based_decode(q, k, v, [state[0], state[1]]),  # a list: the same signature
        lambda: based.based_decode(q.double().float()[:, :1], k[:, :1], v[:, :1], state),
        lambda: based.based_decode(q, k, v, state, 0.5),
        lambda: based.based_decode(q, k, v, state, out=out),
        lambda: based.based_decode(q.to("meta"), k.to("meta"), v.to("meta"), tuple(x.to("meta") for x in state)),
    ]
    expected = [1, 1, 2, 3, 4, 5]
    for call, n in zip(calls, expected):
        call()
        call()
        assert len(check_count) == n
    with pytest.raises(ValueError, match="out\\[0\\] \\(S\\) must be contiguous"):
        based.based_decode(q, k, v, state, out=(wide, out[1]))
    assert len(check_count) == 6


@pytest.mark.kernels_ci
def test_fake_tensor_mode_runs_the_registered_op(based):
    """Fake tensors take the registered op's fake implementation: shapes and dtypes, no kernel, `out` returned."""
    with FakeTensorMode():
        q, k, v = torch.empty(3, 2, 4, 8, dtype=torch.bfloat16), torch.empty(3, 2, 4, 8), torch.empty(3, 2, 4, 40)
        state = (torch.empty(3, 4, 73, 40), torch.empty(3, 4, 73))
        out = tuple(torch.empty_like(x) for x in state)
        o, new = based.based_decode(q, k.bfloat16(), v.bfloat16(), state, out=out)
    assert o.shape == (3, 2, 4, 40) and o.dtype == torch.bfloat16 and new[0] is out[0] and new[1] is out[1]


@pytest.mark.kernels_ci
def test_torch_compile_runs_the_registered_op(based):
    """Under torch.compile(fullgraph=True) the graph holds the registered op (not a direct launch), and the compiled
    step equals the eager one, into new tensors and into `out`."""
    q, k, v, state = decode_inputs(2, 3, 2, 8, 16, torch.float32, seed=5)
    q, k, v, state = q.cpu(), k.cpu(), v.cpu(), tuple(x.cpu() for x in state)
    out = tuple(torch.empty_like(x) for x in state)
    targets = []

    def recording(gm, inputs):
        targets.extend(str(node.target) for node in gm.graph.nodes)
        return gm.forward

    def step(q, k, v, S, z, S_out, z_out):
        o, (S1, z1) = based.based_decode(q, k, v, (S, z), 0.3)
        o2, _ = based.based_decode(q, k, v, (S1, z1), 0.3, out=(S_out, z_out))
        return o * 2, o2, S1, z1

    torch._dynamo.reset()
    got = torch.compile(step, fullgraph=True, backend=recording)(q, k, v, *state, *out)
    assert sum("based_decode" in t for t in targets) == 2
    eager_out = tuple(torch.empty_like(x) for x in state)
    want = step(q, k, v, *state, *eager_out)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert torch.equal(out[0], eager_out[0]) and torch.equal(out[1], eager_out[1])


@pytest.mark.kernels_ci
def test_opcheck(based):
    q, k, v = (torch.randn(2, 2, 2, 4) for _ in range(3))
    state = _state(q, v)
    out = tuple(torch.empty_like(x) for x in state)
    torch.library.opcheck(based.op.based_decode_op, (q, k, v, *state, 0.5, *out))


@needs_cuda
def test_cuda_calls_directly_and_repeat_the_first(based, monkeypatch):
    """On CUDA the eager call takes the direct route (the registered op refuses) and its kept launcher: the second
    call of a shape gives the bits of the first; under grad with an input that requires grad the reference runs."""
    op = submodule(based, "op")
    q, k, v, state = decode_inputs(2, 1, 4, 16, 64, torch.bfloat16, seed=7)
    with torch.no_grad():
        first = based.based_decode(q, k, v, state)
    monkeypatch.setattr(op, "based_decode_op", lambda *args: pytest.fail("the registered op ran"))
    again = based.based_decode(q, k, v, state)
    assert all(torch.equal(a, b) for a, b in zip((first[0], *first[1]), (again[0], *again[1])))
    o, _ = based.based_decode(q, k, v.clone().requires_grad_(), state)
    assert o.grad_fn is not None and rel_err(o.detach(), first[0]) < BF16_TOL


@pytest.mark.kernels_ci
def test_vmap_runs_the_reference(based):
    """Under torch.func.vmap the call runs the reference's torch ops (the registered op, which writes `out`, has no
    batching rule): the batch of calls equals the calls one by one."""
    q, k, v, state = decode_inputs(3, 2, 2, 4, 8, torch.float32, seed=9)
    q, k, v, (S, z) = q.cpu(), k.cpu(), v.cpu(), (x.cpu() for x in state)

    def one(q, k, v, S, z):
        o, (S1, z1) = based.based_decode(q[None], k[None], v[None], (S[None], z[None]), 0.4)
        return o[0], S1[0], z1[0]

    got = torch.func.vmap(one)(q, k, v, S, z)
    for i in range(3):
        assert all(torch.allclose(a[i], b) for a, b in zip(got, one(q[i], k[i], v[i], S[i], z[i])))


@pytest.fixture
def entered(based, monkeypatch):
    """The calls of the entry point `based_decode_cuda` from the public function, no direct call kept before or
    after."""
    yield entry_calls(based, "based_decode_cuda", monkeypatch)
    submodule(based, "op").DIRECT_DECODES.clear()


@needs_triton
@pytest.mark.parametrize("into_out", [False, True])
def test_a_kept_direct_call_gives_the_entry_points_results(based, dispatch, direct, entered, monkeypatch, into_out):
    """The kernel interpreted on the CPU: a signature's first call runs the entry point, its later calls on new
    values the kept direct call, which gives the entry point's bits and the float64 recurrence, the new state in new
    tensors or in `out` (returned), the given state left as it is. An `out` sharing memory with the state raises
    before any launch; a call of another scale runs the entry point."""
    interpreted_kept_launches(based, "portable.decode", monkeypatch)
    buffers = [tuple(torch.empty_like(x) for x in decode_inputs(2, 2, 2, 8, 24, torch.bfloat16)[3]) for _ in "ab"]

    def check(seed, scale=0.3):
        q, k, v, state = decode_inputs(2, 2, 2, 8, 24, torch.bfloat16, seed=seed)
        given = tuple(x.clone() for x in state)
        out = buffers[seed % 2] if into_out else None
        o, (S, z) = based.based_decode(q, k, v, state, scale, out=out)
        want = dispatch.portable_decode(q, k, v, state, scale)
        assert torch.equal(o, want[0]) and torch.equal(S, want[1][0]) and torch.equal(z, want[1][1])
        assert torch.equal(state[0], given[0]) and torch.equal(state[1], given[1])
        assert (S is out[0] and z is out[1]) if into_out else (S is not state[0] and z is not state[1])
        o64, S64, z64 = float64_step(q, k, v, state, scale)
        assert rel_err(o, o64) < BF16_TOL and rel_err(S, S64) < 1e-5 and rel_err(z, z64) < 1e-6
        return q, k, v, state

    for seed in (40, 41, 42):
        q, k, v, state = check(seed)
    assert len(entered) == 1 and len(submodule(based, "op").DIRECT_DECODES) == 1
    if into_out:
        fresh = buffers[0][1]
        with pytest.raises(ValueError, match="out\\[0\\] \\(S\\) must not share memory with state\\[0\\]"):
            based.based_decode(q, k, v, state, 0.3, out=(state[0], fresh))
    check(43, scale=0.5)
    assert len(entered) == 2


@pytest.mark.kernels_ci
@pytest.mark.parametrize("into_out", [False, True])
def test_a_kept_direct_call_launches_what_the_first_call_did(based, entered, into_out):
    """From a signature's second call on, the kept direct call launches the kernel the entry point launched, with the
    same arguments, without the entry point (CUDA's path, taken on CPU tensors under `tools.host_time`'s stubs)."""
    q, k, v, state = (x.cpu() if isinstance(x, torch.Tensor) else tuple(s.cpu() for s in x)
                      for x in decode_inputs(1, 1, 16, 16, 64, torch.bfloat16, seed=44))
    out = tuple(torch.empty_like(x) for x in state) if into_out else None
    with torch.no_grad():
        first, kept, again = recorded_launches(based, lambda: based.based_decode(q, k, v, state, out=out), calls=3)
    assert len(first) == 1 and kept == first and again == first and entered == [1]
    bf16, fp32, x, S, z = torch.bfloat16, torch.float32, (1, 1, 16, 16), (1, 16, 273, 64), (1, 16, 273)
    assert first[0][9:17] == ((bf16, x), (bf16, x), (bf16, (1, 1, 16, 64)), (fp32, S), (fp32, z),
                              (bf16, (1, 1, 16, 64)), (fp32, S), (fp32, z))
    assert not submodule(based, "op").DIRECT_DECODES  # forgotten with the stubs


@pytest.mark.kernels_ci
def test_calls_the_kept_direct_call_cannot_prove_take_the_other_routes(based, entered):
    """A signature's later call with a state off 16 bytes or not contiguous takes the entry point; one with a value
    that requires grad the differentiable reference, one under a dispatch mode the registered op (here the CPU
    reference): none of them launches a kept direct call, and a call of another scale is not served by the kept
    one."""
    q, k, v = (torch.randn(1, 1, 2, 8) for _ in range(3))
    S, z = torch.randn(1, 2, 73, 8), torch.rand(1, 2, 73) + 1
    off = torch.empty(S.numel() + 1)[1:].view(S.shape).copy_(S)
    strided = S.transpose(1, 2).contiguous().transpose(1, 2)  # dense, not row-major
    grad = v.clone().requires_grad_()

    def calls():
        based.based_decode(q, k, v, (S, z))
        based.based_decode(q, k, v, (off, z))
        based.based_decode(q, k, v, (strided, z))
        o, _ = based.based_decode(q, k, grad, (S, z))
        assert o.grad_fn is not None
        with FlopCounterMode(display=False):
            based.based_decode(q, k, v, (S, z))

    first, second = recorded_launches(based, calls)
    assert len(first) == len(second) == 3 and entered == [1] * 5  # the second round's first call is kept
    scales = (None, 0.5, 0.5, None)
    (other,) = recorded_launches(based, lambda: [based.based_decode(q, k, v, (S, z), s) for s in scales], calls=1)
    assert len(other) == 4 and entered == [1] * 7 and other[0] == other[3] != other[1] == other[2]


@needs_cuda
@pytest.mark.parametrize("into_out", [False, True])
def test_cuda_kept_direct_calls_give_the_entry_points_results(based, dispatch, entered, into_out):
    """Back-to-back kept direct calls of one signature (the latency row's: B = 1, (H, K, V) = (16, 16, 64), bf16) on
    changing inputs, into new tensors or alternating two `out` buffers, give what the entry point gives on each; an
    input off 16 bytes takes the entry point (another specialization of the kernel) and gives its result."""
    args = [decode_inputs(1, 1, 16, 16, 64, torch.bfloat16, seed=seed) for seed in (45, 46)]
    outs = [tuple(torch.empty_like(x) for x in args[0][3]) for _ in range(2)] if into_out else [None, None]
    expected = [dispatch.portable_decode(*a[:3], a[3], 16**-0.5) for a in args]
    with torch.no_grad():
        based.based_decode(*args[0], out=outs[0])
        assert len(dispatch.DIRECT_DECODES) == 1
        got = []
        for i in range(6):
            o, (S, z) = based.based_decode(*args[i % 2], out=outs[i % 2])
            got.append((o.clone(), S.clone(), z.clone()))
        q, k, v, state = args[1]
        shifted = torch.empty(v.numel() + 8, dtype=v.dtype, device="cuda")[1:1 + v.numel()].view(v.shape).copy_(v)
        off = based.based_decode(q, k, shifted, state, out=outs[1])
    torch.cuda.synchronize()
    for i, (o, S, z) in enumerate(got):
        want = expected[i % 2]
        assert torch.equal(o, want[0]) and torch.equal(S, want[1][0]) and torch.equal(z, want[1][1])
    want = expected[1]
    assert rel_err(off[0], want[0]) < BF16_TOL and rel_err(off[1][0], want[1][0]) < 1e-5
    assert rel_err(off[1][1], want[1][1]) < 1e-6
    assert entered == [1, 1]  # the first call and the one off 16 bytes


@needs_cuda
def test_cuda_graph_capture_replays_the_kept_direct_call(based, entered):
    """A kept direct call into `out` captured in a CUDA graph reads the inputs' buffers at replay: new values give the
    eager call's results."""
    q, k, v, state = decode_inputs(1, 1, 16, 16, 64, torch.bfloat16, seed=47)
    out = tuple(torch.empty_like(x) for x in state)
    with torch.no_grad():
        for _ in range(2):  # the entry point, then the kept direct call
            based.based_decode(q, k, v, state, out=out)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured, _ = based.based_decode(q, k, v, state, out=out)
        state[0].copy_(state[0].flip(-1))
        v.copy_(v.flip(-1))
        graph.replay()
        torch.cuda.synchronize()
        replayed = (captured.clone(), out[0].clone(), out[1].clone())
        eager, (S, z) = based.based_decode(q, k, v, state, out=tuple(torch.empty_like(x) for x in state))
    assert torch.equal(replayed[0], eager) and torch.equal(replayed[1], S) and torch.equal(replayed[2], z)
    assert entered == [1]  # the captured call and the eager one after it are kept direct calls
