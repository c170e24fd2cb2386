"""comba-bwd through `get_kernel`: the eager forward and analytic backward against an independent float64
token-by-token recurrence (and its autograd) and against the spec's code, the public functions, autograd
through `comba_attention`, strong decay and hard resets (g = -inf), the registered ops (opcheck, torch.compile),
bad input, the layer through `kernelize`, and the fused Triton backward (interpreter on CPU, the spec's shapes on
CUDA)."""

import sys
import threading
import warnings
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from testkit import HAS_CUDA, needs_cuda, needs_triton, rel_err, spec, submodule

DEVICES = ["cpu"] + (["cuda"] if HAS_CUDA else [])
NAMES = ("dq", "dk", "dv", "dp", "dbeta", "dg")


def make_inputs(B, T, H, K, V, dtype=torch.float32, device="cpu", seed=0):
    """The spec's input distribution: unit-norm k and p, beta in (0.5, 0.73), log-decay g <= 0 (float32)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=gen)
    k = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    v = torch.randn(B, T, H, V, generator=gen)
    p = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    beta = torch.rand(B, T, H, generator=gen).sigmoid()
    g = F.logsigmoid(torch.randn(B, T, H, generator=gen)) / 4
    do = torch.randn(B, T, H, V, generator=gen)
    cast = [x.to(device=device, dtype=dtype) for x in (q, k, v, p, beta)]
    return (*cast, g.to(device), do.to(device=device, dtype=dtype))


def comba_recurrence(q, k, v, p, beta, g, scale=None):
    """The spec's definition, one token at a time, in the inputs' dtype (float64 in the tests)."""
    B, T, H, K = q.shape
    scale = K**-0.5 if scale is None else scale
    S = q.new_zeros(B, H, K, v.shape[-1])
    out = []
    for t in range(T):
        S = g[:, t, :, None, None].exp() * S
        u = beta[:, t, :, None] * (v[:, t] - torch.einsum("bhkv,bhk->bhv", S, p[:, t]))
        S = S + k[:, t, :, :, None] * u[:, :, None, :]
        out.append(torch.einsum("bhkv,bhk->bhv", S, scale * q[:, t]))
    return torch.stack(out, 1)


def float64_grads(inputs, scale=None):
    """(dq, dk, dv, dp, dbeta, dg) by float64 autograd through the token recurrence."""
    *x, do = [t.detach().double().cpu() for t in inputs]
    x = [t.requires_grad_() for t in x]
    return torch.autograd.grad(comba_recurrence(*x, scale=scale), x, do)


def tol_for(device, dtype, cpu_tol):
    """CUDA runs the fused kernel, whose matmul operands are bf16 whatever the input dtype (spec gate: 2e-2)."""
    return 2e-2 if device == "cuda" else cpu_tol


def assert_grads_close(got, ref, tol):
    errs = {n: rel_err(a, b) for n, a, b in zip(NAMES, got, ref)}
    assert all(e < tol for e in errs.values()), errs


# ---------------------------------------------------------------- eager reference (float64, spec)


@pytest.mark.kernels_ci
@pytest.mark.parametrize("T", [64, 77, 192])
def test_forward_reference_matches_float64_recurrence(comba, T):
    *x, _ = make_inputs(2, T, 2, 16, 8)
    o = comba.comba_forward_reference(*x)
    assert o.shape == (2, T, 2, 8) and o.dtype == torch.float32
    assert rel_err(o, comba_recurrence(*[t.double() for t in x])) < 1e-5


@pytest.mark.kernels_ci
@pytest.mark.parametrize("T,scale", [(128, None), (100, 0.3), (3, None)])
def test_backward_reference_matches_float64_autograd(comba, T, scale):
    inputs = make_inputs(1, T, 2, 32, 16, seed=1)
    assert_grads_close(comba.comba_backward_reference(*inputs, scale=scale), float64_grads(inputs, scale), 1e-5)


@pytest.mark.kernels_ci
@pytest.mark.parametrize("shape", [(1, 128, 2, 64, 64), (1, 128, 2, 128, 64), (1, 192, 1, 64, 128)])
def test_backward_reference_matches_spec(comba, shape):
    """CPU-sized cuts of the spec's correct_shapes, against the spec's own autograd-through-forward code."""
    s = spec("comba_backward")
    inputs = [x.cpu().float() for x in s.make(*shape, 0)]
    assert_grads_close(comba.comba_backward_reference(*inputs), s.ref(*inputs), 1e-5)


# ---------------------------------------------------------------- strong decay and hard resets


@pytest.fixture(scope="module")
def g_floor(comba):
    return submodule(comba, "reference").G_FLOOR


def strong_gates(kind, shape):
    """g = -2 everywhere (a chunk's summed log-decay reaches -128) or fla's gate -16 softplus(x) (about -700)."""
    if kind == "constant":
        return torch.full(shape, -2.0)
    return -16 * F.softplus(torch.randn(shape, generator=torch.Generator().manual_seed(21)))


@pytest.mark.kernels_ci
@pytest.mark.parametrize("kind,T,tol", [("constant", 64, 2e-5), ("constant", 128, 2e-5), ("softplus", 128, 1e-4)])
def test_backward_reference_under_strong_decay(comba, kind, T, tol):
    """Once gam = exp(gc) underflows to 0 in fp32 the backward still forms every decay as the exp of a
    difference, so all six gradients stay finite and match float64 autograd through the token recurrence, and
    fp32 autograd through the reference forward. The softplus gate's tolerance is wider because gc reaches about
    -900 inside a chunk, where fp32 spacing (6e-5) limits every gc difference."""
    inputs = list(make_inputs(2, T, 2, 32, 16, seed=20))
    inputs[5] = strong_gates(kind, inputs[5].shape)
    got = comba.comba_backward_reference(*inputs)
    assert all(gr.isfinite().all() for gr in got)
    assert_grads_close(got, float64_grads(inputs), tol)
    *x, do = inputs
    x = [t.clone().requires_grad_() for t in x]
    assert_grads_close(got, torch.autograd.grad(comba.comba_forward_reference(*x), x, do), tol)


def test_g_floor_is_the_largest_whole_number_with_a_zero_fp32_gate(g_floor):
    assert torch.tensor(g_floor).exp().item() == 0.0
    assert torch.tensor(g_floor + 1).exp().item() > 0.0


def with_resets(g, value):
    """g with `value` at the first step, in the first and at the last step of a chunk, at the chunk boundary,
    at the last step, at one (b, h) alone, and a run of steps of one (b, h)."""
    g = g.clone()
    g[:, [0, 5, 63, 64, g.shape[1] - 1]] = value
    g[0, 30, 1] = value
    g[1, 40:50, 0] = value
    return g


@pytest.mark.kernels_ci
def test_minus_inf_gate_is_the_floor(comba, g_floor):
    """g = -inf, and any g below the floor, gives what g = G_FLOOR gives, bit for bit, finite everywhere; dg is
    0 there, as float64 autograd through the token recurrence (where exp(-inf) = 0 resets the state) gives, and
    the other gradients match it."""
    inputs = list(make_inputs(2, 128, 2, 32, 16, seed=22))
    g = inputs[5]
    at_inf = [*inputs[:5], with_resets(g, float("-inf")), inputs[6]]
    below = [*inputs[:5], with_resets(g, -1e30), inputs[6]]
    at_floor = [*inputs[:5], with_resets(g, g_floor), inputs[6]]
    got = comba.comba_backward(*at_inf)
    assert all(gr.isfinite().all() for gr in got)
    for other in (below, at_floor):
        assert all(torch.equal(a, b) for a, b in zip(got, comba.comba_backward(*other)))
        assert torch.equal(comba.comba_attention(*at_inf[:6]), comba.comba_attention(*other[:6]))
    assert (got[5][at_inf[5] == float("-inf")] == 0).all()
    assert_grads_close(got, float64_grads(at_inf), 5e-5)


@pytest.mark.kernels_ci
@pytest.mark.parametrize("r", [64, 77])
def test_minus_inf_gate_resets_the_state(comba, r):
    """With g = -inf at step r (every b, h), the output from r on is that of the sequence started afresh at r
    from a zero state, and before r that of the sequence cut at r; at a chunk boundary (64) and inside a chunk."""
    *x, _ = make_inputs(2, 128, 2, 32, 16, seed=23)
    x[5] = x[5].clone()
    x[5][:, r] = float("-inf")
    o = comba.comba_attention(*x)
    assert o.isfinite().all()
    assert rel_err(o[:, r:], comba.comba_attention(*[t[:, r:] for t in x])) < 1e-5
    assert rel_err(o[:, :r], comba.comba_attention(*[t[:, :r] for t in x])) < 1e-5
    assert rel_err(o, comba_recurrence(*[t.double() for t in x])) < 1e-5


# ---------------------------------------------------------------- public functions and autograd


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2), (torch.float16, 1e-2)])
@pytest.mark.parametrize("K,V", [(64, 64), (128, 128)])
def test_public_backward(comba, device, dtype, tol, K, V):
    """Every dtype at both K; at K = V = 128 on Hopper bf16 takes the Gluon kernels, the others the Triton ones."""
    inputs = make_inputs(1, 128, 2, K, V, dtype, device, seed=2)
    grads = comba.comba_backward(*inputs)
    for name, gr, x in zip(NAMES, grads, inputs):
        assert gr.shape == x.shape and gr.device == x.device, name
    assert [gr.dtype for gr in grads] == [dtype] * 5 + [torch.float32]
    assert_grads_close(grads, float64_grads(inputs), tol_for(device, dtype, tol))
    assert comba.kernel_path(inputs[0]) == ("triton" if device == "cuda" else "reference")


@pytest.mark.parametrize("device", DEVICES)
def test_scale_is_applied_to_q(comba, device):
    inputs = make_inputs(1, 64, 1, 64, 64, device=device, seed=3)
    assert_grads_close(comba.comba_backward(*inputs, scale=0.7), float64_grads(inputs, 0.7),
                       tol_for(device, torch.float32, 1e-4))
    *x, _ = inputs
    o = comba.comba_attention(*x, scale=0.7)  # the fused forward on CUDA: bf16 operands whatever the dtype
    assert rel_err(o, comba_recurrence(*[t.double().cpu() for t in x], scale=0.7)) < tol_for(device, o.dtype, 1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
def test_comba_attention_trains_in_all_six_inputs(comba, device, dtype, tol):
    *x, do = make_inputs(1, 128, 2, 64, 64, dtype, device, seed=4)
    x = [t.requires_grad_() for t in x]
    o = comba.comba_attention(*x)
    assert o.dtype == dtype and o.shape == do.shape
    o.backward(do)
    assert_grads_close([t.grad for t in x], float64_grads((*x, do)), tol_for(device, dtype, tol))


@pytest.mark.kernels_ci
def test_opcheck(comba):
    q, k, v, p, beta, g, do = make_inputs(1, 64, 2, 16, 8, seed=5)
    x = [t.clone().requires_grad_() for t in (q, k, v, p, beta, g)]
    torch.library.opcheck(comba.op.comba_forward_op, (*x, 0.25))
    torch.library.opcheck(comba.op.comba_backward_op, (q, k, v, p, beta, g, do, 0.25))


def test_torch_compile_fullgraph_training_step(comba):
    *x, do = make_inputs(1, 128, 2, 16, 8, seed=6)
    x = [t.requires_grad_() for t in x]

    def step(*x):
        return (comba.comba_attention(*x) * do).sum()

    torch._dynamo.reset()
    torch.compile(step, fullgraph=True)(*x).backward()
    compiled = [t.grad.clone() for t in x]
    for t in x:
        t.grad = None
    step(*x).backward()
    assert_grads_close(compiled, [t.grad for t in x], 1e-6)


def test_noncontiguous_inputs_are_copied(comba):
    inputs = make_inputs(1, 64, 2, 16, 8, seed=7)
    strided = [t.transpose(0, 1).contiguous().transpose(0, 1) if t.dim() == 4 else t for t in inputs]
    strided[0] = inputs[0].transpose(2, 3).contiguous().transpose(2, 3)
    assert not strided[0].is_contiguous()
    for a, b in zip(comba.comba_backward(*strided), comba.comba_backward(*inputs)):
        assert torch.equal(a, b)


def _replace(i, fn):
    return lambda args: [fn(a) if j == i else a for j, a in enumerate(args)]


BAD = [
    (_replace(0, lambda q: q.numpy()), TypeError, "q must be a torch.Tensor"),
    (_replace(1, lambda k: k.double()), TypeError, "k must be bfloat16, float16 or float32"),
    (_replace(2, lambda v: v.bfloat16()), TypeError, "v must have q's dtype"),
    (_replace(5, lambda g: g.bfloat16()), TypeError, "g must be float32"),
    (_replace(6, lambda do: do.int()), TypeError, "do must be"),
    (_replace(0, lambda q: q[0]), ValueError, "q must have rank 4"),
    (_replace(4, lambda b: b[..., None]), ValueError, "beta must have rank 3"),
    (_replace(1, lambda k: k[..., :8]), ValueError, "k must have q's shape"),
    (_replace(3, lambda p: p[:, :32]), ValueError, "p must have q's shape"),
    (_replace(2, lambda v: v[:, :, :1]), ValueError, "v must be \\(B, T, H, V\\)"),
    (_replace(5, lambda g: g[:, :32]), ValueError, "g must be \\(B, T, H\\)"),
    (_replace(6, lambda do: do[..., :4]), ValueError, "do must have v's shape"),
    (_replace(0, lambda q: q[:, :0]), ValueError, "every size must be >= 1"),
]


@pytest.mark.kernels_ci
@pytest.mark.parametrize("bad,exc,match", BAD)
def test_bad_input_raises(comba, bad, exc, match):
    args = bad(list(make_inputs(1, 64, 2, 16, 8)))
    with pytest.raises(exc, match=match):
        comba.comba_backward(*args)


@pytest.mark.kernels_ci
@pytest.mark.parametrize("scale", ["0.5", True, torch.tensor(0.5)])
def test_bad_scale_raises(comba, scale):
    *x, _ = make_inputs(1, 64, 2, 16, 8)
    with pytest.raises(TypeError, match="scale must be a float or None"):
        comba.comba_attention(*x, scale=scale)


@pytest.mark.kernels_ci
@pytest.mark.parametrize("scale", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_scale_raises(comba, scale):
    """The rule based-bwd has: any finite scale (zero and negative too), never nan or inf."""
    inputs = make_inputs(1, 64, 2, 16, 8)
    with pytest.raises(ValueError, match="scale must be finite"):
        comba.comba_attention(*inputs[:6], scale=scale)
    with pytest.raises(ValueError, match="scale must be finite"):
        comba.comba_backward(*inputs, scale=scale)


@needs_cuda
def test_cuda_errors(comba):
    inputs = make_inputs(1, 64, 2, 64, 64, torch.bfloat16, "cuda")
    with pytest.raises(ValueError, match="must be on q's device"):
        comba.comba_backward(*inputs[:6], inputs[6].cpu())
    small = make_inputs(1, 64, 2, 32, 64, torch.bfloat16, "cuda")
    sizes = r"K in \(64, 128, 256\) \(K = 256 on GPUs with 104 KB .*\) and V in \(64, 128\), got K=32"
    with pytest.raises(ValueError, match=sizes):
        comba.comba_backward(*small)


# ---------------------------------------------------------------- the layer through kernelize


@pytest.mark.parametrize("device", DEVICES)
def test_layer_kernelize_training(comba, device):
    from kernels import LayerRepository, Mode, kernelize, use_kernel_forward_from_hub, use_kernel_mapping

    @use_kernel_forward_from_hub("CombaAttention")
    class HostComba(nn.Module):
        def forward(self, q, k, v, p, beta, g):
            return comba_recurrence(q, k, v, p, beta, g)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(64, 64)
            self.mixer = HostComba()

        def forward(self, q, k, v, p, beta, g):
            return self.mixer(self.proj(q), k, v, p, beta, g)

    torch.manual_seed(0)
    host = Block().to(device)
    *x, do = make_inputs(1, 64, 2, 64, 64, device=device, seed=8)
    x = [t.requires_grad_() for t in x]
    host(*x).backward(do)
    expected = [t.grad.clone() for t in x] + [host.proj.weight.grad.clone()]
    for t in x:
        t.grad = None
    host.zero_grad()

    repo = LayerRepository("tessera/comba-bwd", layer_name="CombaAttention", version=1, trust_remote_code=True)
    with use_kernel_mapping({"CombaAttention": {device: repo}}, inherit_mapping=False):
        kernelized = kernelize(host, mode=Mode.TRAINING, device=device, use_fallback=False)
    assert kernelized.mixer.forward.__func__.__qualname__.startswith("CombaAttention")
    kernelized(*x).backward(do)
    got = [t.grad for t in x] + [kernelized.proj.weight.grad]
    errs = [rel_err(a, b) for a, b in zip(got, expected)]
    assert max(errs) < tol_for(device, torch.float32, 1e-4), errs


# ---------------------------------------------------------------- the fused Triton backward


@pytest.fixture(scope="module")
def pipeline(comba):
    pytest.importorskip("triton")
    return submodule(comba, "pipeline")


@pytest.fixture(scope="module")
def portable(comba):
    pytest.importorskip("triton")
    return submodule(comba, "portable")


TRITON_DEVICE = "cuda" if HAS_CUDA else "cpu"


@needs_triton
@pytest.mark.kernels_ci
@pytest.mark.parametrize("shape", [(1, 128, 1, 64, 64), (1, 100, 2, 64, 128), (1, 64, 1, 128, 64), (3, 128, 3, 64, 64),
                                   (1, 128, 1, 128, 128)])
def test_triton_backward_matches_float64(dispatch, shape):
    """Tiny shapes (the interpreter runs them on the CPU); T=100 ends in a chunk of 36 rows (masked), and with K = 64,
    V = 128 one scan program taking all of V and two V steps in each gradient part a (b, h); B = 3 is cut into
    batch pieces of 1 and 2, so with H = 3 the second piece checks the (b, t, h) offsets of every kernel;
    K = V = 128 cuts V in two scan blocks (the reverse scan then updates dS from X, and dbeta has two v parts)."""
    inputs = make_inputs(*shape, torch.bfloat16, TRITON_DEVICE, seed=9)
    grads = dispatch.comba_backward_cuda(*inputs, 0.9 * shape[3] ** -0.5)
    assert [gr.dtype for gr in grads] == [torch.bfloat16] * 5 + [torch.float32]
    assert all(gr.is_contiguous() and gr.shape == x.shape for gr, x in zip(grads, inputs))
    assert_grads_close(grads, float64_grads(inputs, 0.9 * shape[3] ** -0.5), 1e-2)


def chunk_inverse_float64(k, p, beta, g, chunk=64):
    """A = (I + strict_lower((beta P) K^T * E))^-1 per (b, h, chunk), in float64: [B*H, N, chunk, chunk]."""
    B, T, H, K = k.shape
    split = lambda x: x.double().transpose(1, 2).reshape(B * H, T // chunk, chunk, *x.shape[3:])  # noqa: E731
    k, p, beta, g = split(k), split(p), split(beta), split(g)
    gc = g.cumsum(-1)
    lower = torch.ones(chunk, chunk, dtype=torch.bool).tril(-1)
    E = torch.exp((gc[..., :, None] - gc[..., None, :]).masked_fill(~lower, float("-inf")))
    L = (beta[..., None] * p) @ k.transpose(-1, -2) * E
    return torch.linalg.inv(torch.eye(chunk, dtype=torch.float64) + L)


@needs_triton
def test_transform_kernel_inverts_the_chunk_system(portable):
    """The chunk transform (fp32 A) against a float64 inverse of the same (bf16) inputs, every entry of A: it
    assembles its off-diagonal 16 x 16 blocks from products, so a wrong block shows here."""
    B, T, H, K = 1, 128, 2, 64
    q, k, v, p, beta, g, do = make_inputs(B, T, H, K, 64, torch.bfloat16, TRITON_DEVICE, seed=3)
    A = torch.full((B * H, T // 64, 64, 64), float("nan"), device=TRITON_DEVICE)
    portable.transform.launch(k, p, beta, g, A)
    expected = chunk_inverse_float64(k.cpu(), p.cpu(), beta.cpu(), g.cpu())
    assert rel_err(A, expected) < 1e-5


@needs_cuda
def test_cuda_gluon_transform_inverts_the_chunk_system(comba, dispatch):
    """The Gluon transform (fp32 A), which takes its products' operands from accumulators by relabelling them, against a
    float64 inverse, every entry of A: a wrong relabelling or orientation of a block shows here. B * H = 6 chunks of
    T = 128 a (b, h), so that the (b, t, h) offsets are checked too."""
    if "transform" not in dispatch.gluon_stages(torch.device("cuda", 0), torch.bfloat16, 64, 128):
        pytest.skip("the Gluon transform runs on Hopper only")
    B, T, H, K = 2, 128, 3, 64
    q, k, v, p, beta, g, do = make_inputs(B, T, H, K, 128, torch.bfloat16, "cuda", seed=3)
    A = torch.full((B * H, T // 64, 64, 64), float("nan"), device="cuda")
    submodule(comba, "hopper.transform").launch(k, p, beta, g, A)
    assert rel_err(A.cpu(), chunk_inverse_float64(k.cpu(), p.cpu(), beta.cpu(), g.cpu())) < 1e-5


@needs_triton
@pytest.mark.kernels_ci
def test_scans_pipeline_only_where_shared_memory_allows(portable, monkeypatch):
    """The pipelined reverse scan takes 113 KB of shared memory a block at K = 128 and 193 KB at K = 256: GPUs with
    99 KB (sm_86, sm_89, sm_120) run the scans unpipelined, the A100's 163 KB pipelines them at K <= 128 only and the
    H200's 227 KB at every K; at K = 256 only Hopper pipelines them. Meta tensors (an offline compile) as the GPU they
    stand for (`common.devices.meta_gpu`)."""
    scan_stages = portable.chunk.scan_stages
    devices = sys.modules[portable.chunk.gpu.__module__]

    def with_shared_memory(optin, K, major=8):
        monkeypatch.setattr(torch.cuda, "get_device_properties",
                            lambda device: SimpleNamespace(major=major, minor=0, shared_memory_per_block_optin=optin))
        devices._cuda_gpu.cache_clear()
        return scan_stages(torch.device("cuda", 0), K)

    try:
        assert [with_shared_memory(kb * 1024, 128) for kb in (99, 163, 227)] == [1, 2, 2]
        assert [with_shared_memory(kb * 1024, 256, major=9) for kb in (99, 163, 227)] == [1, 1, 2]
        assert with_shared_memory(227 * 1024, 256, major=10) == 1
    finally:
        devices._cuda_gpu.cache_clear()
    assert scan_stages(torch.device("meta"), 256) == 2  # an H100 / H200 unless an offline compile says otherwise
    for kb, stages in ((99, 1), (163, 2)):
        monkeypatch.setattr(devices, "meta_gpu", devices.Gpu((8, 9), kb * 1024))
        assert scan_stages(torch.device("meta"), 64) == stages
    monkeypatch.setattr(devices, "meta_gpu", devices.Gpu((10, 0), 227 * 1024))  # sm_100: K = 256 unpipelined
    assert [scan_stages(torch.device("meta"), K) for K in (128, 256)] == [2, 1]


def test_fused_kernels_take_k256_only_with_its_shared_memory(comba, monkeypatch):
    """K = 256 needs 104 KB of shared memory a block (the unpipelined reverse scan under Triton 3.8): GPUs with 99 KB
    (sm_86, sm_89, sm_120) leave it to the eager reference; K = 64 and 128 run everywhere; other K nowhere."""
    validation, devices = submodule(comba, "validation"), submodule(comba, "common.devices")
    meta = torch.device("meta")
    for kb, k256 in ((99, False), (163, True), (227, True)):
        monkeypatch.setattr(devices, "meta_gpu", devices.Gpu((8, 9), kb * 1024))
        assert [validation.fused_k(meta, K) for K in (64, 128, 256, 96)] == [True, True, k256, False]
    assert validation.fused_k(torch.device("cpu"), 256)


@needs_triton
@pytest.mark.parametrize("K,names", [
    (64, ["transform", "forward_scan", "reverse_scan", "grads", "dg"]),
    (128, ["transform", "scan_terms", "forward_scan", "reverse_scan", "adjoint", "grads", "dg"])])
def test_stages_rerun_alone_give_the_same_gradients(pipeline, K, names):
    """The benchmark times each stage alone after one full pass: re-running a stage must not change anything. At
    K = 64 the scans form their chunk-local terms and the adjoint in their loops (`dispatch.Plan.local_terms`), at
    K = 128 the scan_terms and adjoint stages do."""
    inputs = make_inputs(1, 128, 1, K, 64, torch.bfloat16, TRITON_DEVICE, seed=11)
    stages, grads = pipeline.backward_stages(*inputs, 0.125)
    assert [stage.name for stage in stages] == names
    for stage in stages:
        stage.run()
    first = [x.clone() for x in grads]
    for stage in reversed(stages):
        stage.run()
    assert all(torch.equal(a, b) for a, b in zip(first, grads))


@needs_triton
def test_gluon_path_that_fails_to_compile_falls_back_once(comba, pipeline, dispatch, monkeypatch):
    """Where the Gluon kernels' first launch raises, the Gluon path is switched off with one warning and the call (and
    later ones) run the Triton kernels: the Gluon stages stood in for by a backward that fails while they run."""
    fast_paths = submodule(comba, "common.fast_paths")
    monkeypatch.setattr(dispatch.FAST_PATHS, "switched_off", {})
    gluon_on = lambda: dispatch.CHUNK_GLUON not in dispatch.FAST_PATHS.switched_off  # noqa: E731
    triton_plan = dispatch.plan
    monkeypatch.setattr(dispatch, "plan",
                        lambda q, V: triton_plan(q, V)._replace(gluon=("grads",) if gluon_on() else ()))
    triton_backward = pipeline.run_backward

    def failing_backward(*args):
        if gluon_on():
            raise RuntimeError("error encountered during parsing")
        return triton_backward(*args)

    monkeypatch.setattr(pipeline, "run_backward", failing_backward)
    inputs = make_inputs(1, 64, 1, 64, 64, device=TRITON_DEVICE)
    with pytest.warns(fast_paths.FastPathFallback, match="comba-bwd: the chunk-gluon path failed to compile"):
        grads = dispatch.comba_backward_cuda(*inputs, 0.125)
    assert_grads_close(grads, float64_grads(inputs, 0.125), 1e-2)  # bf16 scratch (A, S_n, Vn, X)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again = dispatch.comba_backward_cuda(*inputs, 0.125)
    assert all(torch.equal(a, b) for a, b in zip(grads, again))


@needs_triton
@pytest.mark.kernels_ci
def test_gluon_rule(dispatch):
    """Gluon kernels take bf16 inputs with V = 128 on Hopper (and meta tensors, for the offline compile): the scans and
    the gradients at K = 128, the transform, the forward scan and the gradients at K = 64; never float16 (they would
    read the bf16 scratch as float16) or float32, V = 64, K = 256, nor CPU tensors (the interpreter runs the Triton
    kernels).
    Where they take a call the batch is not cut in pieces; at K = 64 the gradient kernel makes dv."""
    takes = dispatch.gluon_stages
    meta, cpu = torch.device("meta"), torch.device("cpu")
    assert takes(meta, torch.bfloat16, 128, 128) == ("forward_scan", "reverse_scan", "grads")
    assert takes(meta, torch.bfloat16, 64, 128) == ("transform", "forward_scan", "grads")
    assert not any(takes(meta, dtype, K, V) for dtype, K, V in
                   [(torch.float16, 128, 128), (torch.float32, 128, 128), (torch.float16, 64, 128),
                    (torch.bfloat16, 128, 64), (torch.bfloat16, 64, 64), (torch.bfloat16, 32, 128),
                    (torch.bfloat16, 256, 128)])
    assert not takes(cpu, torch.bfloat16, 128, 128) and not takes(cpu, torch.bfloat16, 64, 128)
    q = lambda device, K, B=4: torch.empty(B, 64, 2, K, device=device, dtype=torch.bfloat16)  # noqa: E731
    assert dispatch.plan(q(meta, 128), 128) == (takes(meta, torch.bfloat16, 128, 128), False, 1, False)
    assert dispatch.plan(q(meta, 64), 128) == (takes(meta, torch.bfloat16, 64, 128), True, 1, True)
    assert dispatch.plan(q(meta, 64), 64) == ((), False, 2, True)
    assert dispatch.plan(q(meta, 256), 128) == ((), False, 2, False)  # K = 256: the Triton kernels alone
    assert dispatch.plan(q(cpu, 128), 128) == ((), False, 2, False)
    assert dispatch.plan(q(cpu, 128, B=1), 128).pieces == 1


@needs_triton
@pytest.mark.kernels_ci
def test_local_terms_rule(dispatch):
    """The Triton scans form their chunk-local terms in their loops (`dispatch.Plan.local_terms`) in a plain call at
    K = 64 with V up to 128 (one scan program holds all of V), on every device and whichever stages Gluon takes; never
    at K = 128 or 256, with V = 256 or 512, nor in a model's call."""
    q = lambda device, K: torch.empty(2, 64, 2, K, device=device, dtype=torch.bfloat16)  # noqa: E731
    for device in ("meta", "cpu"):
        assert [dispatch.plan(q(device, 64), V).local_terms for V in (64, 128, 256, 512)] == [True, True, False, False]
        assert not any(dispatch.plan(q(device, K), V).local_terms for K in (128, 256) for V in (64, 128))
        assert not any(dispatch.plan(q(device, 64), V, model=True).local_terms for V in (64, 128))


@needs_triton
@pytest.mark.parametrize("shape", [(2, 100, 2, 64, 64), (1, 128, 1, 64, 128)])
def test_local_terms_match_the_stages(pipeline, dispatch, shape, monkeypatch):
    """At K = 64 a plain call's scans form their chunk-local terms in their loops and the reverse scan makes X, dv and
    dbeta's v part (`dispatch.Plan.local_terms`): its output and six gradients against those of the scan_terms and
    adjoint stages and against float64, from fp32 inputs (the interpreter's dot); B = 2 runs in two batch pieces and
    T = 100 ends in a masked chunk. The reverse scan's X without dv and dbeta's v part (the form it takes beside the
    K = 64 Gluon gradient kernel, which makes them) is the X it makes with them."""
    inputs = make_inputs(*shape, torch.float32, TRITON_DEVICE, seed=23)
    *x, do = inputs
    scale = 0.9 * shape[3] ** -0.5
    local = (dispatch.comba_forward_cuda(*x, scale), *dispatch.comba_backward_cuda(*inputs, scale))
    stages = pipeline.backward_stages(*inputs, scale)[0]
    for stage in stages:
        stage.run()
    args = list(next(stage for stage in stages if stage.name == "reverse_scan").args)
    X, v_adjoint = args[12], args[16]
    assert args[8] is None and v_adjoint  # the local terms, dv from the scan
    args[12:15], args[16] = (torch.empty_like(X), None, None), False
    pipeline.portable.reverse_scan.launch(*args)
    assert torch.equal(args[12], X)
    plan = dispatch.plan
    monkeypatch.setattr(dispatch, "plan", lambda q, V, model=False: plan(q, V, model)._replace(local_terms=False))
    staged = (dispatch.comba_forward_cuda(*x, scale), *dispatch.comba_backward_cuda(*inputs, scale))
    ref = float64_grads(inputs, scale)
    o_ref = comba_recurrence(*[t.double().cpu() for t in x], scale=scale)
    for got in (local, staged):  # bf16 scratch (A, S_n, Vn, X)
        assert rel_err(got[0], o_ref) < 1e-2
        assert_grads_close(got[1:], ref, 1e-2)
    assert rel_err(local[0], staged[0].double()) < 5e-3
    assert_grads_close(local[1:], [t.double() for t in staged[1:]], 5e-3)


def take_the_triton_kernels(dispatch, monkeypatch):
    """Make every call plan the Triton kernels alone: the plan with no Gluon stage, dv from the reverse scan."""
    plan = dispatch.plan
    monkeypatch.setattr(dispatch, "plan", lambda q, V: plan(q, V)._replace(gluon=(), v_adjoint_in_grads=False))


def _check_against_spec(backward, shape, tol=2e-2):
    """All six gradients of `backward` (a CUDA path) against the fp32 spec, at one of the spec's shapes."""
    s = spec("comba_backward")
    q, k, v, p, beta, g, do = s.make(*shape, 0)
    got = backward(q, k, v, p, beta, g, do)
    ref = s.ref(*(x.float() for x in (q, k, v, p, beta, g, do)))
    errs = {n: rel_err(a, b) for n, a, b in zip(NAMES, got, ref)}
    print(shape, {n: f"{e:.1e}" for n, e in errs.items()})
    del got, ref
    torch.cuda.empty_cache()
    assert all(e < tol for e in errs.values()), (shape, errs)


CORRECT_SHAPES = [(1, 512, 4, 128, 128), (2, 1024, 4, 64, 64), (1, 1024, 8, 128, 64), (2, 256, 4, 64, 128)]
MEASURE_SHAPES = [(8, 2048, 32, 128, 128), (12, 2048, 32, 128, 128), (8, 4096, 16, 128, 128),
                  (16, 2048, 32, 64, 128), (10, 4096, 32, 128, 128)]


@needs_cuda
@pytest.mark.parametrize("shape", CORRECT_SHAPES)
def test_cuda_backward_matches_spec_correct_shapes(comba, shape):
    _check_against_spec(comba.comba_backward, shape)


@needs_cuda
@pytest.mark.parametrize("shape", MEASURE_SHAPES)
def test_cuda_backward_matches_spec_measure_shapes(comba, shape):
    _check_against_spec(comba.comba_backward, shape)


@needs_cuda
@pytest.mark.parametrize("shape", [(3, 100, 3, 128, 128), (1, 768, 12, 128, 128), (1, 64, 1, 128, 128),
                                   (3, 100, 3, 64, 128), (1, 1536, 12, 64, 128), (1, 64, 1, 64, 128)])
def test_cuda_gluon_kernels_match_the_triton_kernels(dispatch, shape, monkeypatch):
    """Where Gluon kernels run (bf16, V = 128, Hopper), the backward with them against the backward with the Triton
    kernels, all six gradients, and both against float64. T = 100 is padded; (1, 768, 12) at K = 128 has 144 chunks,
    more than an H200's 132 persistent CTAs of the gradient kernel, and (1, 1536, 12) at K = 64 has 288, more than
    its 264, so some CTAs take two and copy the next one's tiles while they compute; T = 64 is one chunk (no next tiles
    for any kernel to copy)."""
    if not dispatch.gluon_stages(torch.device("cuda", 0), torch.bfloat16, shape[3], shape[4]):
        pytest.skip("the Gluon kernels run on Hopper only")
    inputs = make_inputs(*shape, torch.bfloat16, "cuda", seed=13)
    with_gluon = dispatch.comba_backward_cuda(*inputs, 0.1)
    take_the_triton_kernels(dispatch, monkeypatch)
    with_triton = dispatch.comba_backward_cuda(*inputs, 0.1)
    ref = float64_grads(inputs, 0.1)
    assert_grads_close(with_gluon, ref, 1e-2)
    assert_grads_close(with_triton, ref, 1e-2)
    assert_grads_close(with_gluon, [x.double() for x in with_triton], 5e-3)


@needs_cuda
def test_cuda_backward_cuts_an_odd_batch(comba):
    """B = 3 runs as batch pieces of 1 and 2, each on streams of its own (V = 64: the Triton kernels, in pieces)."""
    _check_against_spec(comba.comba_backward, (3, 192, 2, 64, 64))


@needs_cuda
def test_cuda_backward_replays_in_a_cuda_graph(comba):
    """The backward forks side streams from the caller's stream and joins them back: captured in a CUDA graph
    and replayed on new inputs, it gives what an eager call on those inputs gives."""
    shape = (2, 128, 2, 64, 128)
    static = list(make_inputs(*shape, torch.bfloat16, "cuda", seed=5))
    comba.comba_backward(*static)  # compiles and makes the side streams outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = comba.comba_backward(*static)
    fresh = make_inputs(*shape, torch.bfloat16, "cuda", seed=6)
    for x, y in zip(static, fresh):
        x.copy_(y)
    graph.replay()
    expected = comba.comba_backward(*fresh)
    assert all(torch.equal(a, b) for a, b in zip(captured, expected))


@needs_cuda
@pytest.mark.parametrize("K", [64, 128])
def test_cuda_backward_runs_on_its_inputs_device(comba, K):
    """The backward launches on its inputs' GPU whatever device is current (V = 128: the Gluon kernels on Hopper, and
    B = 3 in two batch pieces on side streams). With two GPUs, inputs on cuda:1 while cuda:0 is current and the other
    way round, then both GPUs at once from two threads; with one, inputs on cuda:0 inside torch.cuda.device(0)."""
    shape = (3, 100, 2, K, 128)
    cpu_inputs = make_inputs(*shape, torch.bfloat16, "cpu", seed=17)
    ref = float64_grads(cpu_inputs, 0.1)
    count = torch.cuda.device_count()

    def check(index: int, current: int):
        inputs = [x.to(f"cuda:{index}") for x in cpu_inputs]
        with torch.cuda.device(current):
            grads = comba.comba_backward(*inputs, 0.1)
        assert all(gr.device == inputs[0].device for gr in grads)
        assert_grads_close([gr.cpu() for gr in grads], ref, 1e-2)

    for index in range(min(count, 2)):
        check(index, (index + 1) % min(count, 2))
    if count >= 2:
        errors = []

        def work(index):
            try:
                for _ in range(3):
                    check(index, index)
            except Exception as error:  # noqa: BLE001 - reported in the main thread
                errors.append((index, error))

        threads = [threading.Thread(target=work, args=(i,)) for i in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
