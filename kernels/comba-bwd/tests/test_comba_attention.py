"""The fused forward through `get_kernel`: its stages (interpreter on the CPU, the GPU for real) against an
independent float64 recurrence, at strong decay and hard resets; on CUDA the Gluon forward against the Triton one, the
public `comba_attention` against the spec's fp32 forward at the spec's shapes, a
training step through autograd against the spec's gradients, `torch.compile(fullgraph=True)`, a CUDA-graph replay of
a whole step, and the training example on both devices. (tests/test_devices.py runs the step on the inputs' GPU
whatever the current device.)"""

import importlib.util
import math
from pathlib import Path

import pytest
import torch

from test_comba_backward import (
    CORRECT_SHAPES,
    MEASURE_SHAPES,
    assert_grads_close,
    comba_recurrence,
    make_inputs,
    take_the_triton_kernels,
)
from testkit import HAS_CUDA, needs_cuda, needs_triton, rel_err, spec

TRITON_DEVICE = "cuda" if HAS_CUDA else "cpu"
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "train_causal_lm.py"


def spec_forward():
    """The spec's chunked fp32 forward `_comba_forward`, as its reference code defines it."""
    s = spec("comba_backward")
    env = {}
    exec(s.reference_imports, env)
    exec(s.reference_src, env)
    return env["_comba_forward"]


def strong_decay(inputs, g_min, seed, resets=()):
    """`inputs` with g uniform in (g_min, 0), beta in (0.999, 1) and g = -inf (a hard reset) at the steps `resets`."""
    q, k, v, p, beta, g, do = inputs
    gen = torch.Generator().manual_seed(seed)
    g = (g_min * torch.rand(g.shape, generator=gen)).to(g.device)
    g[:, list(resets)] = -math.inf
    beta = (1 - 1e-3 * torch.rand(beta.shape, generator=gen)).to(device=beta.device, dtype=beta.dtype)
    return q, k, v, p, beta, g, do


# ---------------------------------------------------------------- the fused forward's stages


@needs_triton
@pytest.mark.kernels_ci
@pytest.mark.parametrize("shape", [(1, 128, 1, 64, 64), (1, 100, 2, 64, 128), (1, 64, 1, 128, 128),
                                   (3, 128, 3, 64, 64), (1, 192, 1, 128, 64)])
def test_fused_forward_matches_float64(dispatch, shape):
    """Tiny shapes (the interpreter runs them on the CPU): T = 100 is padded to two chunks; B = H = 3 checks the
    (b, t, h) offsets of every stage; K = 128 with V = 64 and V = 128 with K = 64 the state's two orientations."""
    B, T, H, K, V = shape
    *x, _ = make_inputs(*shape, torch.bfloat16, TRITON_DEVICE, seed=21)
    o = dispatch.comba_forward_cuda(*x, 0.9 * K**-0.5)
    assert o.shape == (B, T, H, V) and o.dtype == torch.bfloat16 and o.is_contiguous()
    assert rel_err(o, comba_recurrence(*[t.double().cpu() for t in x], scale=0.9 * K**-0.5)) < 1e-2


@needs_triton
@pytest.mark.parametrize("K,V", [(64, 64), (128, 128)])
def test_fused_forward_under_strong_decay_and_resets(dispatch, K, V):
    """g down to -20 a step (a chunk's summed log-decay far below fp32's exp range), beta near 1, and hard resets
    (g = -inf) at the first step, inside a chunk and at a chunk's last step: finite, and as right as at mild decay."""
    inputs = strong_decay(make_inputs(1, 192, 2, K, V, torch.bfloat16, TRITON_DEVICE, seed=22), -20.0, 1,
                          resets=(0, 70, 127))
    *x, _ = inputs
    o = dispatch.comba_forward_cuda(*x, K**-0.5)
    assert o.isfinite().all()
    assert rel_err(o, comba_recurrence(*[t.double().cpu() for t in x])) < 1e-2


@needs_cuda
@pytest.mark.parametrize("shape", [(3, 100, 3, 128, 128), (1, 64, 1, 128, 128), (3, 100, 3, 64, 128),
                                   (1, 64, 1, 64, 128)])
def test_cuda_gluon_forward_matches_the_triton_forward(dispatch, shape, monkeypatch):
    """Where Gluon kernels run (bf16, V = 128, Hopper), the forward with them against the forward with the Triton
    kernels, and both against float64: T = 100 is padded, T = 64 is one chunk."""
    if not dispatch.gluon_stages(torch.device("cuda", 0), torch.bfloat16, shape[3], shape[4]):
        pytest.skip("the Gluon kernels run on Hopper only")
    *x, _ = make_inputs(*shape, torch.bfloat16, "cuda", seed=30)
    with_gluon = dispatch.comba_forward_cuda(*x, 0.1)
    take_the_triton_kernels(dispatch, monkeypatch)
    with_triton = dispatch.comba_forward_cuda(*x, 0.1)
    ref = comba_recurrence(*[t.double().cpu() for t in x], scale=0.1)
    assert rel_err(with_gluon, ref) < 1e-2 and rel_err(with_triton, ref) < 1e-2
    assert rel_err(with_gluon, with_triton) < 5e-3


# ---------------------------------------------------------------- the public op on CUDA


def _check_forward_against_spec(comba, shape, tol=2e-2):
    s = spec("comba_backward")
    q, k, v, p, beta, g, _ = s.make(*shape, 0)
    with torch.no_grad():
        o = comba.comba_attention(q, k, v, p, beta, g)
    err = rel_err(o, spec_forward()(*(x.float() for x in (q, k, v, p, beta, g))))
    print(shape, f"forward err {err:.1e}")
    assert err < tol, (shape, err)


@needs_cuda
@pytest.mark.parametrize("shape", CORRECT_SHAPES)
def test_cuda_forward_matches_spec_correct_shapes(comba, shape):
    _check_forward_against_spec(comba, shape)


@needs_cuda
@pytest.mark.parametrize("shape", MEASURE_SHAPES)
def test_cuda_forward_matches_spec_measure_shapes(comba, shape):
    _check_forward_against_spec(comba, shape)
    torch.cuda.empty_cache()


@needs_cuda
@pytest.mark.parametrize("shape", [(1, 512, 4, 128, 128), (2, 1024, 4, 64, 64), (2, 256, 4, 64, 128)])
def test_cuda_training_step_matches_spec_gradients(comba, shape):
    """Forward and backward through autograd against the spec's six gradients."""
    s = spec("comba_backward")
    q, k, v, p, beta, g, do = s.make(*shape, 0)
    x = [t.clone().requires_grad_() for t in (q, k, v, p, beta, g)]
    got = torch.autograd.grad(comba.comba_attention(*x), x, do)
    assert_grads_close(got, s.ref(*(t.float() for t in (q, k, v, p, beta, g, do))), 2e-2)


@needs_cuda
@pytest.mark.parametrize("K,V", [(128, 128), (64, 128), (64, 64)])
def test_cuda_step_under_strong_decay(comba, K, V):
    """g down to -20 a step, beta near 1, two hard resets, at sizes where every path runs (Gluon at V = 128 on
    Hopper): the output and the six gradients against the fp32 reference, which floors g and decays by differences
    of cumulative sums."""
    inputs = strong_decay(make_inputs(2, 1024, 4, K, V, torch.bfloat16, "cuda", seed=24), -20.0, 2, resets=(5, 640))
    *x, do = inputs
    x = [t.clone().requires_grad_() for t in x]
    o = comba.comba_attention(*x)
    got = torch.autograd.grad(o, x, do)
    f32 = [t.detach().float() for t in x]
    assert rel_err(o, comba.comba_forward_reference(*f32)) < 2e-2
    assert_grads_close(got, comba.comba_backward_reference(*f32, do.float()), 2e-2)


@needs_cuda
def test_cuda_inference_takes_the_fused_forward(comba, dispatch):
    """Under no_grad comba_attention runs the fused forward, and its output is the training forward's."""
    *x, _ = make_inputs(2, 256, 3, 128, 128, torch.bfloat16, "cuda", seed=25)
    with torch.no_grad():
        o = comba.comba_attention(*x)
    assert torch.equal(o, dispatch.comba_forward_cuda(*x, 128**-0.5))
    assert torch.equal(o, comba.comba_attention(*[t.clone().requires_grad_() for t in x]).detach())


@needs_cuda
def test_cuda_torch_compile_fullgraph_training_step(comba):
    *x, do = make_inputs(2, 256, 2, 64, 128, torch.bfloat16, "cuda", seed=26)
    x = [t.requires_grad_() for t in x]

    def step(*x):
        return (comba.comba_attention(*x).float() * do.float()).sum()

    torch._dynamo.reset()
    torch.compile(step, fullgraph=True)(*x).backward()
    compiled = [t.grad.clone() for t in x]
    for t in x:
        t.grad = None
    step(*x).backward()
    assert_grads_close(compiled, [t.grad for t in x], 1e-5)


@needs_cuda
@pytest.mark.parametrize("K", [64, 128])
def test_cuda_training_step_replays_in_a_cuda_graph(comba, K):
    """A whole step (forward, backward through autograd) captured in a CUDA graph and replayed on new inputs gives
    what an eager step on those inputs gives."""
    shape = (2, 256, 2, K, 128)
    static = [t.requires_grad_(i < 6) for i, t in enumerate(make_inputs(*shape, torch.bfloat16, "cuda", seed=27))]

    def step():
        o = comba.comba_attention(*static[:6])
        return (o, *torch.autograd.grad(o, static[:6], static[6]))

    step()  # compiles, and makes the side streams, outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    fresh = make_inputs(*shape, torch.bfloat16, "cuda", seed=28)
    with torch.no_grad():
        for t, f in zip(static, fresh):
            t.copy_(f)
    graph.replay()
    expected = step()
    assert all(torch.equal(a, b) for a, b in zip(captured, expected))


# ---------------------------------------------------------------- the training example


def _example():
    spec_ = importlib.util.spec_from_file_location("train_causal_lm", EXAMPLE)
    module = importlib.util.module_from_spec(spec_)
    spec_.loader.exec_module(module)
    return module


SMALL = dict(batch=4, seq=64, d_model=64, heads=2, head_dim=64, layers=1)


def test_example_trains_on_the_cpu(comba):
    """The example's model, kernelized on the CPU (the eager reference), learns: ten steps lower the loss."""
    losses = _example().train("cpu", steps=10, lr=1e-2, **SMALL)
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0] - 0.3, losses


@needs_cuda
def test_cuda_example_loss_curve_matches_the_cpu_reference(comba):
    """Two hundred steps on the GPU (fused forward and backward, bf16 autocast) and on the CPU (the reference, fp32)
    from the same init on the same batches: the two loss curves agree, as means over each 20 steps, and both fall
    toward the bigram language's entropy."""
    example = _example()
    gpu = torch.tensor(example.train("cuda", steps=200, **SMALL))
    cpu = torch.tensor(example.train("cpu", steps=200, **SMALL))
    windows = lambda losses: losses.view(10, 20).mean(1)  # noqa: E731
    assert (windows(gpu) - windows(cpu)).abs().max() < 0.1, (windows(gpu), windows(cpu))
    assert gpu[-20:].mean() < 0.6 * gpu[0] and cpu[-20:].mean() < 0.6 * cpu[0]
