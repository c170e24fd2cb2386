"""The host path of `comba_decode`: an eager call on plain CUDA tensors without autograd runs `dispatch.comba_decode_cuda`
without the registered op (`common.direct_calls.calls_directly`), its argument checks skipped for a call signature
that passed them before, and a later call of the signature runs the direct call kept for it (`dispatch.DIRECT_DECODES`);
under torch.compile and FakeTensorMode the registered `comba_decode` op runs. On the CPU the direct route is taken by
patching the decision, and runs the Triton kernel under the interpreter; the kept direct calls' launches are seen
under `tools.host_time`'s stubs (`testkit.recorded_launches`), or run in the interpreter
(`testkit.interpreted_kept_launches`)."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.flop_counter import FlopCounterMode

from test_comba_decode import DEVICE, TOL
from test_model_interface import model_inputs, pack, recurrence64
from testkit import (entry_calls, interpreted_kept_launches, needs_cuda, needs_triton, recorded_launches, rel_err,
                     submodule)


@pytest.fixture
def direct(comba, monkeypatch):
    """The op module with every call routed directly to the entry point, the registered op refusing to run."""
    op = submodule(comba, "op")
    monkeypatch.setattr(op, "calls_directly", lambda *tensors: True)

    def refuse(*args):
        raise AssertionError("the registered op ran")

    monkeypatch.setattr(op, "comba_decode_op", refuse)
    return op


@needs_triton
def test_direct_route_runs_the_entry_point(comba, direct):
    """The kernel (K = 64, V = 64, interpreted on the CPU) without the registered op, twice (the second call through the
    remembered signature and the kept plan), and packed sequences from zeros: the float64 recurrence."""
    x, state = model_inputs(2, 2, 1, 2, 64, 64, seed=80, unit_keys=False)
    x, state = [t.to(DEVICE) for t in x], state.to(DEVICE)
    o64, f64 = recurrence64(*x, None, state, "fla", True)
    for _ in range(2):
        o, new = comba.comba_decode(*x, state, use_qk_l2norm=True, read_order="fla")
        assert rel_err(o, o64) < TOL and rel_err(new, f64) < TOL
    packed, offsets = pack(x, [1, 2])
    o, new = comba.comba_decode(*packed, cu_seqlens=offsets.to(DEVICE))
    for i, n in enumerate((1, 2)):
        o64, f64 = recurrence64(*[t[i:i + 1, :n] for t in x])
        assert rel_err(o[:, i:i + n], o64) < TOL and rel_err(new[i:i + 1], f64) < TOL


BAD = [
    (lambda x, s: ((x[0].double(), *x[1:], s), {}), TypeError, "q must be"),
    (lambda x, s: ((*x[:2], x[2][..., :-1], *x[3:], s), {}), ValueError, "state must be \\(N, HV, K, V\\)"),
    (lambda x, s: ((*x, s.double()), {}), TypeError, "state must be float32"),
    (lambda x, s: ((*x, s), {"scale": True}), TypeError, "scale must be a float or None"),
    (lambda x, s: ((*x, s), {"use_qk_l2norm": 1}), TypeError, "use_qk_l2norm must be a bool"),
    (lambda x, s: ((*x, s), {"read_order": "fla "}), ValueError, "read_order must be one of"),
    (lambda x, s: ((*x, s), {"read_order": ["fla"]}), ValueError, "read_order must be one of"),
    (lambda x, s: ((*x, s), {"cu_seqlens": torch.tensor([0, 1], dtype=torch.int16)}), TypeError, "cu_seqlens must be"),
]


@pytest.mark.kernels_ci
@pytest.mark.parametrize("bad,exc,match", BAD)
def test_direct_route_raises_as_the_op_does(comba, direct, monkeypatch, bad, exc, match):
    """After a good call of the same tensors (its signature remembered), a bad one still raises the checks' error
    before any launch."""
    monkeypatch.setattr(direct, "comba_decode_cuda", lambda *args: pytest.fail("a bad call reached the launch"))
    x, state = model_inputs(1, 1, 1, 1, 8, 8)
    direct._checked_decode.add(direct._decode_signature(*x, state, None, None, False, "decay_first"))
    args, kwargs = bad(x, state)
    with pytest.raises(exc, match=match):
        comba.comba_decode(*args, **kwargs)


@pytest.mark.kernels_ci
def test_a_signature_seen_before_skips_the_checks(comba, monkeypatch):
    """Every change the checks read (dtype, shape, device, state, offsets, the scalars) checks again; the same call
    does not; more than 64 tokens raises again after a good call of 64."""
    op = submodule(comba, "op")
    count = []
    check = op.check_model_args
    monkeypatch.setattr(op, "check_model_args", lambda *args: count.append(1) or check(*args))
    monkeypatch.setattr(op, "_checked_decode", type(op._checked_decode)())
    x, state = model_inputs(1, 65, 1, 1, 8, 8, seed=81)
    x64 = [t[:, :64] for t in x]
    calls = [
        lambda: comba.comba_decode(*x64, state),
        lambda: comba.comba_decode(*x64),
        lambda: comba.comba_decode(*[t[:, :3] for t in x], state),
        lambda: comba.comba_decode(*x64, state, 0.5),
        lambda: comba.comba_decode(*x64, state, read_order="fla"),
        lambda: comba.comba_decode(*x64, state, use_qk_l2norm=True),
        lambda: comba.comba_decode(*[t.to("meta") for t in x64], state.to("meta")),
        lambda: comba.comba_decode(*[t[:, :4] for t in x], state, cu_seqlens=torch.tensor([0, 4])),
    ]
    for i, call in enumerate(calls):
        call()
        call()
        assert len(count) == i + 1
    for _ in range(2):
        with pytest.raises(ValueError, match="1 to 64 new tokens per sequence, got a sequence of 65"):
            comba.comba_decode(*x, state)


@pytest.mark.kernels_ci
def test_fake_tensor_mode_runs_the_registered_op(comba):
    """Fake tensors take the registered op's fake implementation: shapes and dtypes, no kernel."""
    x, state = model_inputs(1, 3, 1, 2, 8, 16, seed=82)
    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(t) for t in x]
        o, new = comba.comba_decode(*fake, mode.from_tensor(state))
    assert o.shape == (1, 3, 2, 16) and o.dtype == torch.float32 and new.shape == (1, 2, 8, 16)


@pytest.mark.kernels_ci
def test_torch_compile_runs_the_registered_op(comba):
    """Under torch.compile(fullgraph=True) the graph holds the registered op, and the compiled step equals the eager
    one."""
    x, state = model_inputs(1, 3, 1, 2, 8, 16, seed=83)
    targets = []

    def recording(gm, inputs):
        targets.extend(str(node.target) for node in gm.graph.nodes)
        return gm.forward

    def step(q, k, v, p, beta, g, state):
        o, new = comba.comba_decode(q, k, v, p, beta, g, state, use_qk_l2norm=True, read_order="fla")
        return o * 2, new

    torch._dynamo.reset()
    with torch.no_grad():
        got = torch.compile(step, fullgraph=True, backend=recording)(*x, state)
        want = step(*x, state)
    assert sum("comba_decode" in t for t in targets) == 1
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.kernels_ci
def test_opcheck(comba):
    x, state = model_inputs(1, 2, 1, 2, 8, 16, seed=84)
    torch.library.opcheck(comba.op.comba_decode_op, (*x, state, None, 0.5, True, "fla"))
    packed, offsets = pack([t.expand(2, *t.shape[1:]) for t in x], [1, 2])
    torch.library.opcheck(comba.op.comba_decode_op, (*packed, None, offsets, 0.5, False, "decay_first"))


@needs_cuda
def test_cuda_calls_directly_and_repeat_the_first(comba, monkeypatch):
    """On CUDA the eager call takes the direct route (the registered op refuses) and its kept launcher: the second
    call of a shape gives the bits of the first."""
    op = submodule(comba, "op")
    x, state = model_inputs(2, 1, 2, 4, 128, 256, seed=85)
    x, state = [t.to("cuda", torch.bfloat16) for t in x[:5]] + [x[5].cuda()], state.cuda()
    with torch.no_grad():
        first = comba.comba_decode(*x, state, use_qk_l2norm=True, read_order="fla")
        monkeypatch.setattr(op, "comba_decode_op", lambda *args: pytest.fail("the registered op ran"))
        again = comba.comba_decode(*x, state, use_qk_l2norm=True, read_order="fla")
    assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])


@pytest.mark.kernels_ci
def test_vmap_runs_the_registered_op_a_sample_at_a_time(comba):
    """Under torch.func.vmap the registered op runs once a sample (the recurrent reference reads g's values, which
    vmap cannot batch): the batch of calls equals the calls one by one."""
    x, state = model_inputs(3, 2, 1, 2, 8, 8, seed=86)

    def one(*args):
        o, new = comba.comba_decode(*(t[None] for t in args[:6]), args[6][None], read_order="fla")
        return o[0], new[0]

    got = torch.func.vmap(one)(*x, state)
    for i in range(3):
        assert all(torch.allclose(a[i], b) for a, b in zip(got, one(*(t[i] for t in x), state[i])))


@pytest.fixture
def entered(comba, monkeypatch):
    """The calls of the entry point `comba_decode_cuda` from the public function, no direct call kept before or
    after."""
    yield entry_calls(comba, "comba_decode_cuda", monkeypatch)
    submodule(comba, "op").DIRECT_DECODES.clear()


# (state given, packed sequences): a carried state, zeros, two packed sequences of one and two tokens from a state
KEPT_CASES = [(True, False), (False, False), (True, True)]


@needs_triton
@pytest.mark.parametrize("with_state,packed", KEPT_CASES)
def test_a_kept_direct_call_gives_the_entry_points_results(comba, direct, entered, monkeypatch, with_state, packed):
    """The kernel interpreted on the CPU: a signature's first call runs the entry point, its later calls on new
    values the kept direct call, which gives the entry point's bits and the float64 recurrence, a new state each
    call, the given one left as it is. A call of another signature (scale, read order, T) runs the entry point."""
    interpreted_kept_launches(comba, "portable.decode", monkeypatch)
    dispatch = submodule(comba, "dispatch")

    def inputs(seed, T=2):
        x, state = model_inputs(2, T, 1, 2, 64, 64, seed=seed, unit_keys=False)
        offsets = None
        if packed:
            x, offsets = pack(x, [1, T])
            offsets = offsets.to(DEVICE)
        return [t.to(DEVICE) for t in x], state.to(DEVICE) if with_state else None, offsets

    def check(x, state, offsets, scale=None, read_order="fla"):
        before = None if state is None else state.clone()
        o, new = comba.comba_decode(*x, state, scale, cu_seqlens=offsets, use_qk_l2norm=True, read_order=read_order)
        want = dispatch.comba_decode_cuda(*x, state, scale, offsets, True, read_order)
        assert torch.equal(o, want[0]) and torch.equal(new, want[1])
        assert state is None or (torch.equal(state, before) and new is not state)
        lengths = [1, x[0].shape[1] - 1] if packed else [x[0].shape[1]] * 2
        for i, n in enumerate(lengths):
            a = sum(lengths[:i]) if packed else 0
            rows = [t[:, a:a + n] if packed else t[i:i + 1] for t in x]
            o64, f64 = recurrence64(*rows, scale, None if state is None else state[i:i + 1], read_order, True)
            assert rel_err(o[:, a:a + n] if packed else o[i:i + 1], o64) < TOL and rel_err(new[i:i + 1], f64) < TOL

    for seed in (90, 91, 92):
        check(*inputs(seed))
    assert len(entered) == 1 and len(submodule(comba, "op").DIRECT_DECODES) == 1
    check(*inputs(93), scale=0.5)
    check(*inputs(94), read_order="decay_first")
    check(*inputs(95, T=3))
    assert len(entered) == 4


@pytest.mark.kernels_ci
def test_a_kept_direct_call_launches_what_the_first_call_did(comba, entered):
    """From a signature's second call on, the kept direct call launches the kernel the entry point launched, with the
    same arguments, without the entry point (CUDA's path, taken on CPU tensors under `tools.host_time`'s stubs)."""
    x, state = model_inputs(1, 1, 2, 4, 128, 256, seed=96)
    x = [t.bfloat16() for t in x[:5]] + [x[5]]
    with torch.no_grad():
        first, kept, again = recorded_launches(
            comba, lambda: comba.comba_decode(*x, state, use_qk_l2norm=True, read_order="fla"), calls=3)
    assert len(first) == 1 and kept == first and again == first and entered == [1]
    bf16, fp32 = torch.bfloat16, torch.float32
    assert first[0][9:19] == ((bf16, (1, 1, 2, 128)), (bf16, (1, 1, 2, 128)), (bf16, (1, 1, 4, 256)),
                              (bf16, (1, 1, 2, 128)), (bf16, (1, 1, 4)), (fp32, (1, 1, 4)), (fp32, (1, 4, 128, 256)),
                              (fp32, (1, 4, 128, 256)), (bf16, (1, 1, 4, 256)), None)
    assert not submodule(comba, "op").DIRECT_DECODES  # forgotten with the stubs


@pytest.mark.kernels_ci
def test_calls_the_kept_direct_call_cannot_prove_take_the_other_routes(comba, entered):
    """A signature's later call with a tensor off 16 bytes or a non-contiguous state takes the entry point; one with a
    state that requires grad the differentiable reference, one under a dispatch mode the registered op (here the CPU
    reference): none of them launches a kept direct call, and a call of another scale is not served by the kept one."""
    x, state = model_inputs(1, 1, 1, 2, 64, 64, seed=97)
    off = torch.empty(state.numel() + 1)[1:].view(state.shape).copy_(state)
    strided = torch.empty(*state.shape[:-1], 2 * state.shape[-1])[..., ::2].copy_(state)
    grad = state.clone().requires_grad_()

    def calls():
        comba.comba_decode(*x, state)
        comba.comba_decode(*x, off)
        comba.comba_decode(*x, strided)
        o, _ = comba.comba_decode(*x, grad)
        assert o.grad_fn is not None
        with FlopCounterMode(display=False):
            comba.comba_decode(*x, state)

    first, second = recorded_launches(comba, calls)
    assert len(first) == len(second) == 3 and entered == [1] * 5  # the second round's first call is kept
    (other,) = recorded_launches(comba, lambda: [comba.comba_decode(*x, state, s) for s in (None, 0.5, 0.5, None)],
                                 calls=1)
    assert len(other) == 4 and entered == [1] * 7 and other[0] == other[3] != other[1] == other[2]


@needs_cuda
@pytest.mark.parametrize("with_state", [True, False])
def test_cuda_kept_direct_calls_give_the_entry_points_results(comba, entered, with_state):
    """Back-to-back kept direct calls of one signature (the latency row's: B = 1, (H, K, V) = (6, 256, 512), bf16,
    fla's order, L2 norm) on changing inputs give what the entry point gives on each; an input off 16 bytes takes the
    entry point (another specialization of the kernel) and gives its result."""
    dispatch = submodule(comba, "dispatch")

    def inputs(seed):
        x, state = model_inputs(1, 1, 6, 6, 256, 512, seed=seed)
        return [t.to("cuda", torch.bfloat16) for t in x[:5]] + [x[5].cuda()], state.cuda() if with_state else None

    args = [inputs(98), inputs(99)]
    expected = [dispatch.comba_decode_cuda(*x, state, None, None, True, "fla") for x, state in args]
    with torch.no_grad():
        comba.comba_decode(*args[0][0], args[0][1], use_qk_l2norm=True, read_order="fla")
        assert len(dispatch.DIRECT_DECODES) == 1
        outs = [comba.comba_decode(*x, state, use_qk_l2norm=True, read_order="fla") for x, state in args * 3]
        x, state = args[1]
        v = x[2]
        shifted = torch.empty(v.numel() + 8, dtype=v.dtype, device="cuda")[1:1 + v.numel()].view(v.shape).copy_(v)
        off = comba.comba_decode(*x[:2], shifted, *x[3:], state, use_qk_l2norm=True, read_order="fla")
    torch.cuda.synchronize()
    assert all(torch.equal(o, expected[i % 2][0]) and torch.equal(new, expected[i % 2][1])
               for i, (o, new) in enumerate(outs))
    assert rel_err(off[0], expected[1][0]) < 1e-2 and rel_err(off[1], expected[1][1]) < 1e-5
    assert entered == [1, 1]  # the first call and the one off 16 bytes


@needs_cuda
def test_cuda_graph_capture_replays_the_kept_direct_call(comba, entered):
    """A kept direct call captured in a CUDA graph reads the inputs' buffers at replay: new values give the eager
    call's results."""
    x, state = model_inputs(1, 1, 6, 6, 256, 512, seed=100)
    x, state = [t.to("cuda", torch.bfloat16) for t in x[:5]] + [x[5].cuda()], state.cuda()
    with torch.no_grad():
        for _ in range(2):  # the entry point, then the kept direct call
            comba.comba_decode(*x, state, use_qk_l2norm=True, read_order="fla")
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = comba.comba_decode(*x, state, use_qk_l2norm=True, read_order="fla")
        state.copy_(state.flip(-1))
        x[2].copy_(x[2].flip(-1))
        graph.replay()
        torch.cuda.synchronize()
        eager = comba.comba_decode(*x, state, use_qk_l2norm=True, read_order="fla")
    assert torch.equal(captured[0], eager[0]) and torch.equal(captured[1], eager[1])
    assert entered == [1]  # the captured call and the eager one after it are kept direct calls
