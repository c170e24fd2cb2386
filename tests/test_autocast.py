"""Every package under autocast: on the CPU every public function and reference computes in float32 (bit for bit
what it computes without autocast) and returns the dtypes its docstring gives; every registered op declares its
rule on the CPU and on CUDA; on CUDA the differentiable ops take autocast's 16-bit dtype and log-mel stays float32."""

import pytest
import torch
import torch.nn.functional as F

from testkit import load, needs_cuda, rel_err, submodule


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def ldsa_call(device="cpu"):
    a = torch.randn(2, 3, 5, 40, generator=_gen(1)).to(device).requires_grad_()
    v = torch.randn(2, 3, 8, 40, generator=_gen(2)).to(device).requires_grad_()
    return lambda: load("ldsa").ldsa_local_attention(a, v, 2, 2), (a, v)


def based_call(device="cpu", **kwargs):
    q, k = (torch.randn(1, 70, 2, 16, generator=_gen(s)).to(device).requires_grad_() for s in (3, 4))
    v = torch.randn(1, 70, 2, 32, generator=_gen(5)).to(device).requires_grad_()
    return lambda: load("based-bwd").based_attention(q, k, v, **kwargs), (q, k, v)


def comba_call(device="cpu", K=16, V=8, **kwargs):
    gen = _gen(6)
    q = torch.randn(1, 70, 2, K, generator=gen)
    k, p = (F.normalize(torch.randn(1, 70, 2, K, generator=gen), dim=-1) for _ in range(2))
    v = torch.randn(1, 70, 2, V, generator=gen)
    beta = torch.rand(1, 70, 2, generator=gen).sigmoid()
    g = F.logsigmoid(torch.randn(1, 70, 2, generator=gen)) / 4
    x = [t.to(device).requires_grad_() for t in (q, k, v, p, beta, g)]
    return lambda: load("comba-bwd").comba_attention(*x, **kwargs), x


def first(out):
    return out[0] if isinstance(out, tuple) else out


DIFFERENTIABLE = {
    "ldsa_local_attention": ldsa_call,
    "based_attention": based_call,
    "based_attention with a state out": lambda: based_call(output_final_state=True),
    "comba_attention": comba_call,
    "comba_attention, fla's read order": lambda: comba_call(read_order="fla"),
}


# The calls through a registered op, whose backward op declares its autocast rule too: their backward may run
# inside the autocast region. The others run the reference's torch ops, whose backward autocast reaches where it
# runs inside the region (torch's advice: backward outside it).
BACKWARD_INSIDE = ("ldsa_local_attention", "based_attention", "based_attention with a state out", "comba_attention")


@pytest.mark.kernels_ci
@pytest.mark.parametrize("name", DIFFERENTIABLE)
def test_cpu_autocast_changes_no_differentiable_op(name):
    """fp32 inputs under bf16 autocast: the output and the gradients equal, bit for bit, those of the same call
    without autocast, in float32."""
    call, inputs = DIFFERENTIABLE[name]()
    want = first(call())
    want_grads = torch.autograd.grad(want.square().sum(), inputs)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = first(call())
        if name in BACKWARD_INSIDE:
            grads = torch.autograd.grad(got.square().sum(), inputs)
    if name not in BACKWARD_INSIDE:
        grads = torch.autograd.grad(got.square().sum(), inputs)
    assert got.dtype == torch.float32 and torch.equal(got, want)
    for g, w in zip(grads, want_grads):
        assert g.dtype == torch.float32 and torch.equal(g, w)


@pytest.mark.kernels_ci
def test_cpu_autocast_changes_no_backward_or_decode():
    based, comba = load("based-bwd"), load("comba-bwd")
    _, (q, k, v) = based_call()
    do = torch.randn_like(v)
    state = (torch.rand(1, 2, 1 + 16 + 256, 32), torch.rand(1, 2, 1 + 16 + 256))
    _, x = comba_call()
    dx = torch.randn_like(x[2])
    calls = {
        "based_backward": lambda: based.based_backward(q, k, v, do),
        "based_decode": lambda: based.based_decode(q[:, :5], k[:, :5], v[:, :5], state),
        "comba_backward": lambda: comba.comba_backward(*x, dx),
        "comba_decode": lambda: comba.comba_decode(*(t[:, :5] for t in x)),
    }
    for name, call in calls.items():
        with torch.no_grad():
            want = torch.utils._pytree.tree_leaves(call())
            with torch.autocast("cpu", dtype=torch.bfloat16):
                got = torch.utils._pytree.tree_leaves(call())
        for g, w in zip(got, want, strict=True):
            assert g.dtype == w.dtype == torch.float32 and torch.equal(g, w), name


@pytest.mark.kernels_ci
def test_cpu_autocast_log_mel_returns_float32():
    """Both functions return float32 (their docstrings), equal to the call without autocast; whisper_log_mel
    returns out_dtype."""
    log_mel = load("log-mel")
    audio = torch.randn(2, 4000, generator=_gen(7))
    stft = torch.stft(audio, 400, 160, window=torch.hann_window(400), return_complex=True).mT
    filters = log_mel.mel_filters(80) if hasattr(log_mel, "mel_filters") else torch.rand(80, 201, generator=_gen(8))
    for call in (lambda: log_mel.log_mel_spectrogram(stft, filters), lambda: log_mel.whisper_log_mel(audio),
                 lambda: log_mel.whisper_log_mel(audio, out_dtype=torch.float16)):
        want = call()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got = call()
        assert got.dtype == want.dtype and torch.equal(got, want)
    assert want.dtype == torch.float16


def registered_ops():
    return {
        "ldsa": ("ldsa_forward", "ldsa_backward"),
        "based-bwd": ("based_forward", "based_backward"),
        "comba-bwd": ("comba_forward", "comba_backward"),
        "log-mel": ("log_mel_spectrogram", "whisper_log_mel"),
    }


@pytest.mark.kernels_ci
@pytest.mark.parametrize("kernel", registered_ops())
def test_every_registered_op_declares_its_autocast_rule(kernel):
    package = load(kernel)
    for name in registered_ops()[kernel]:
        op = getattr(package._ops.ops, name).default
        for key in ("AutocastCPU", "AutocastCUDA"):
            assert torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), key), (op.name(), key)


@pytest.mark.kernels_ci
def test_cpu_autocast_runs_the_registered_op_with_autocast_off():
    """The registered op itself (no public function around it) under CPU autocast: bf16 inputs stay bf16, the
    reference computes in float32 (the same result as without autocast)."""
    based = load("based-bwd")
    _, (q, k, v) = based_call()
    q, k, v = (x.detach().bfloat16() for x in (q, k, v))
    want = based.op.based_forward_op(q, k, v, 0.25)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = based.op.based_forward_op(q, k, v, 0.25)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)


@pytest.mark.kernels_ci
def test_the_16bit_rule_casts_the_named_arguments_only():
    """The kernel `register_autocast` gives CUDA, built for the CPU here: under bf16 autocast the float32 tensors at
    the named positions arrive in bf16 (comba's q, k, v, p), the others (beta, g) as given, and the op runs with
    autocast off (its result equals the op on the cast arguments without autocast)."""
    comba = load("comba-bwd")
    rule = submodule(comba, "common.autocast")
    _, x = comba_call()
    x = [t.detach() for t in x]
    seen = []
    op = comba._ops.ops.comba_forward.default

    def spy(*args):
        seen.append([a.dtype for a in args[:6]])
        assert not torch.is_autocast_enabled("cpu")
        return op(*args)

    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = rule._autocast_kernel(spy, "cpu", (0, 1, 2, 3))(*x, 0.25)
    assert seen == [[torch.bfloat16] * 4 + [torch.float32] * 2]
    assert torch.equal(got, op(*(t.bfloat16() for t in x[:4]), *x[4:], 0.25))


@needs_cuda
@pytest.mark.parametrize("name", ["ldsa_local_attention", "based_attention", "comba_attention"])
def test_cuda_autocast_takes_16bit_inputs(name):
    """fp32 CUDA inputs under bf16 autocast run as bf16 (the fused kernels' operands): the output is bf16 and
    matches the fp32 call to bf16 accuracy; the gradients reach the fp32 inputs in fp32."""
    call, inputs = {"ldsa_local_attention": lambda: ldsa_call("cuda"), "based_attention": lambda: based_call("cuda"),
                    "comba_attention": lambda: comba_call("cuda", K=64, V=64)}[name]()
    want = call()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        got = call()
    assert got.dtype == torch.bfloat16 and rel_err(got.float(), want) < 2e-2
    grads = torch.autograd.grad(got.float().square().sum(), inputs)
    assert all(g.dtype == x.dtype for g, x in zip(grads, inputs))


@needs_cuda
def test_cuda_autocast_log_mel_stays_float32():
    log_mel = load("log-mel")
    audio = torch.randn(2, 16000, generator=_gen(9)).cuda()
    want = log_mel.whisper_log_mel(audio)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        got = log_mel.whisper_log_mel(audio)
    assert got.dtype == torch.float32 and torch.equal(got, want)
