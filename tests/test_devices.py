"""Every public op runs on its inputs' GPU whatever device is current, from any thread, and inside DDP.

Each case makes its inputs on the CPU, runs the op there (the eager reference) and on a GPU, forward and, for
the differentiable ops, backward, and compares. With two GPUs the op runs on cuda:1 while cuda:0 is current,
and on both GPUs at once from two threads; with one GPU, on cuda:0 under `torch.cuda.device(0)`, and a
DistributedDataParallel step of world size 1 matches the plain step. Sizes are small: this is about where the
kernels run, not how fast.
"""

import threading
from typing import Callable, NamedTuple

import pytest
import torch
import torch.nn.functional as F

from testkit import HAS_CUDA, load, needs_cuda, rel_err

needs_two_gpus = pytest.mark.skipif(not HAS_CUDA or torch.cuda.device_count() < 2, reason="needs two CUDA devices")


class Case(NamedTuple):
    """An op, the float32 leaves its inputs are made from (on the CPU), and how: `args(leaves)` gives the op's
    arguments, so gradients reach the leaves through any casts and gates. `grad`: whether the op is
    differentiable; `tol`: relative error allowed against the CPU result (the dtype's rounding)."""

    fn: Callable
    leaves: tuple
    args: Callable
    tol: float
    grad: bool = True


def _randn(*shapes):
    gen = torch.Generator().manual_seed(0)
    return tuple(torch.randn(*s, generator=gen) for s in shapes)


def _ldsa():
    a, v = _randn((2, 2, 7, 96), (2, 2, 16, 96))
    return Case(load("ldsa").ldsa_local_attention, (a, v), lambda a, v: (a, v, 3, 3), 1e-4)


def _based():
    q, k, v = _randn((1, 128, 2, 16), (1, 128, 2, 16), (1, 128, 2, 64))
    return Case(load("based-bwd").based_attention, (q, k, v), lambda *x: [t.bfloat16() for t in x], 2e-2)


def _comba():
    B, T, H, K, V = 1, 128, 2, 64, 64
    leaves = _randn((B, T, H, K), (B, T, H, K), (B, T, H, V), (B, T, H, K), (B, T, H), (B, T, H))

    def args(q, k, v, p, beta, g):  # the spec's distribution: unit-norm k and p, beta in (0, 1), g <= 0
        k, p = F.normalize(k, dim=-1), F.normalize(p, dim=-1)
        return (*[t.bfloat16() for t in (q, k, v, p, beta.sigmoid())], F.logsigmoid(g) / 4)

    return Case(load("comba-bwd").comba_attention, leaves, args, 2e-2)


def _whisper():
    (audio,) = _randn((2, 16000))
    return Case(load("log-mel").whisper_log_mel, (audio * 0.1,), lambda a: (a,), 1e-4, grad=False)


CASES = {"ldsa": _ldsa, "based": _based, "comba": _comba, "whisper_log_mel": _whisper}


def _run(case: Case, device):
    """(output, gradients of a fixed projection of it w.r.t. the leaves, or None), on `device`."""
    leaves = [x.detach().to(device).requires_grad_(case.grad) for x in case.leaves]
    out = case.fn(*case.args(*leaves))
    if not case.grad:
        return out, None
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(device)
    return out, torch.autograd.grad((out.float() * weight).sum(), leaves)


def _assert_matches_cpu(name, device):
    case = CASES[name]()
    ref_out, ref_grads = _run(case, "cpu")
    out, grads = _run(case, device)
    assert out.device == torch.device(device)
    assert rel_err(out.float().cpu(), ref_out.float()) < case.tol, name
    for got, ref in zip(grads or (), ref_grads or ()):
        assert got.device == torch.device(device)
        assert rel_err(got.float().cpu(), ref.float()) < case.tol, name


@needs_cuda
@pytest.mark.parametrize("name", CASES)
def test_op_on_the_current_gpu(name):
    with torch.cuda.device(0):
        _assert_matches_cpu(name, "cuda:0")


@needs_two_gpus
@pytest.mark.parametrize("name", CASES)
def test_op_on_another_gpu_than_the_current_one(name):
    with torch.cuda.device(0):
        _assert_matches_cpu(name, "cuda:1")
    with torch.cuda.device(1):
        _assert_matches_cpu(name, "cuda:0")


@needs_two_gpus
@pytest.mark.parametrize("name", CASES)
def test_both_gpus_at_once_from_two_threads(name):
    errors = []

    def work(device):
        try:
            for _ in range(3):
                _assert_matches_cpu(name, device)
        except Exception as error:  # reported in the main thread
            errors.append((device, error))

    threads = [threading.Thread(target=work, args=(d,)) for d in ("cuda:0", "cuda:1")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


class _Mixer(torch.nn.Module):
    """The case's leaves as parameters, mixed by its op: a DDP-wrapped model whose gradients are the op's."""

    def __init__(self, name):
        super().__init__()
        self.case = CASES[name]()
        self.leaves = torch.nn.ParameterList(torch.nn.Parameter(x.clone()) for x in self.case.leaves)

    def forward(self, scale):
        return self.case.fn(*self.case.args(*[x * scale for x in self.leaves])).float()


@needs_cuda
@pytest.mark.parametrize("name", ["ldsa", "based", "comba"])
def test_ddp_step_of_world_size_one_matches_the_plain_step(name, tmp_path):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    model, twin = _Mixer(name).cuda(), _Mixer(name).cuda()
    scale = torch.tensor(0.5, device="cuda")
    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        DistributedDataParallel(model, device_ids=[0])(scale).square().mean().backward()
    finally:
        dist.destroy_process_group()
    twin(scale).square().mean().backward()
    for (what, a), b in zip(model.named_parameters(), twin.parameters()):
        assert a.grad is not None and torch.isfinite(a.grad).all(), what
        assert rel_err(a.grad, b.grad) < 1e-5, what
