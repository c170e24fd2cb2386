"""based-bwd's `kernels benchmark` class: `based_backward` at a small, a medium and a large workload, verified
against the eager reference."""

import torch
from kernels.benchmark import Benchmark

# (B, T, H, K, V) of the `kernels benchmark` workloads by device: on CUDA the spec's calibration shape is the
# medium one and a measure shape the large one; on the CPU (the eager reference) sizes that take seconds.
WORKLOADS = {
    "cuda": {"small": (1, 2048, 8, 16, 128), "medium": (2, 2048, 8, 16, 128), "large": (8, 4096, 16, 16, 128)},
    "cpu": {"small": (1, 128, 2, 8, 32), "medium": (1, 256, 2, 16, 64), "large": (2, 512, 4, 16, 64)},
}


def _make(B, T, H, K, V, device, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    q, k = (torch.randn(B, T, H, K, generator=g, device=device, dtype=torch.bfloat16) for _ in range(2))
    v, do = (torch.randn(B, T, H, V, generator=g, device=device, dtype=torch.bfloat16) for _ in range(2))
    return q, k, v, do


class BasedBackward(Benchmark):
    """bf16 `based_backward` at a small, a medium and a large (B, T, H, K, V) (`WORKLOADS`). The output is dq,
    dk, dv flattened into one fp32 vector in units of the reference's largest gradient, so that the runner's
    check (absolute 1e-2) asks for 1% of it: the gradients reach magnitudes where bf16's rounding alone is above
    1e-2. The reference is the eager analytic backward in fp32."""

    seed = 0

    def _setup(self, workload: str):
        shape = WORKLOADS["cuda" if str(self.device).startswith("cuda") else "cpu"][workload]
        self.q, self.k, self.v, self.do = _make(*shape, self.device)
        self.unit = 1 / self._reference().abs().max()
        self.out = None

    def _reference(self) -> torch.Tensor:
        ref = self.kernel.based_backward_reference(self.q.float(), self.k.float(), self.v.float(), self.do.float())
        return torch.cat([g.flatten() for g in ref])

    def _run(self):
        grads = self.kernel.based_backward(self.q, self.k, self.v, self.do)
        self.out = torch.cat([g.float().flatten() for g in grads]) * self.unit

    def _verify(self) -> torch.Tensor:
        return self._reference() * self.unit

    def setup_small(self):
        self._setup("small")

    def benchmark_small(self):
        self._run()

    def verify_small(self) -> torch.Tensor:
        return self._verify()

    def setup_medium(self):
        self._setup("medium")

    def benchmark_medium(self):
        self._run()

    def verify_medium(self) -> torch.Tensor:
        return self._verify()

    def setup_large(self):
        self._setup("large")

    def benchmark_large(self):
        self._run()

    def verify_large(self) -> torch.Tensor:
        return self._verify()

