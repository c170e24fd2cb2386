"""comba-bwd's `kernels benchmark` class: the backward, the forward and the training step at one shape, each verified
against the eager reference."""

import torch
from kernels.benchmark import Benchmark

BENCH_SHAPE = (8, 2048, 32, 128, 128)


def _make(B, T, H, K, V, device, seed=0):
    """The spec's input distribution (the spec itself does not ship with the benchmark)."""
    import torch.nn.functional as F

    gen = torch.Generator(device=device).manual_seed(seed)
    bf = dict(device=device, dtype=torch.bfloat16, generator=gen)
    q = torch.randn(B, T, H, K, **bf)
    k = F.normalize(torch.randn(B, T, H, K, device=device, generator=gen), dim=-1).to(torch.bfloat16)
    v = torch.randn(B, T, H, V, **bf)
    p = F.normalize(torch.randn(B, T, H, K, device=device, generator=gen), dim=-1).to(torch.bfloat16)
    beta = torch.rand(B, T, H, device=device, generator=gen).sigmoid().to(torch.bfloat16)
    g = (F.logsigmoid(torch.randn(B, T, H, device=device, generator=gen)) / 4.0).float()
    do = torch.randn(B, T, H, V, **bf)
    return q, k, v, p, beta, g, do


class CombaBackward(Benchmark):
    """bf16, (B, T, H, K, V) = (8, 2048, 32, 128, 128): the first measure shape of the spec. `out` is dq (the
    backward, the step) or o (the forward)."""

    seed = 0

    def setup(self):
        self.inputs = _make(*BENCH_SHAPE, self.device)
        self.out = torch.empty_like(self.inputs[0])

    def benchmark_backward(self):
        self.out = self.kernel.comba_backward(*self.inputs)[0]

    def verify_backward(self) -> torch.Tensor:
        return self.kernel.comba_backward_reference(*(x.float() for x in self.inputs))[0].to(self.out.dtype)

    def benchmark_forward(self):
        with torch.no_grad():
            self.out = self.kernel.comba_attention(*self.inputs[:6])

    def verify_forward(self) -> torch.Tensor:
        return self.kernel.comba_forward_reference(*(x.float() for x in self.inputs[:6])).to(self.out.dtype)

    def benchmark_step(self):
        self.out = training_step(self.kernel)(*self.inputs)[0]

    def verify_step(self) -> torch.Tensor:
        return self.verify_backward()


def training_step(kernel):
    """The training step: comba_attention's forward and backward through autograd, the six gradients."""

    def step(q, k, v, p, beta, g, do):
        ins = [x.detach().requires_grad_(True) for x in (q, k, v, p, beta, g)]
        return torch.autograd.grad(kernel.comba_attention(*ins), ins, do)

    return step

