"""ldsa's `kernels benchmark` class: the forward at a small, a medium and a large workload, verified against the
eager reference."""

import torch
from kernels.benchmark import Benchmark

H, DH = 8, 64


def make_inputs(B, T, left, right, dtype, device, seed=0):
    """a_logits [B, H, W, T] of standard deviation 2 and v [B, H, Dh, T] of 1, for a window of left + right + 1."""
    g = torch.Generator(device=device).manual_seed(seed)
    a_logits = (2 * torch.randn(B, H, left + right + 1, T, generator=g, device=device)).to(dtype)
    v = torch.randn(B, H, DH, T, generator=g, device=device).to(dtype)
    return a_logits, v


# The `kernels benchmark` workloads, [B, T] by device: the card's launch-bound, middle and largest bf16 shapes on a
# GPU; on a CPU, where the op is the eager reference, shapes that cost seconds in all.
WORKLOADS = {
    "cuda": {"small": (16, 256), "medium": (32, 1024), "large": (64, 3000)},
    "cpu": {"small": (1, 256), "medium": (2, 1024), "large": (4, 3000)},
}
# The CLI compares outputs with torch.allclose(atol=1e-2): values of standard deviation 1/4 keep every output below 2,
# where one bf16 rounding step (a kernel and the reference may round a float32 sum differently) is below 1e-2.
WORKLOAD_VALUE_SCALE = 0.25


class LDSAForward(Benchmark):
    """The forward, bf16, H=8, Dh=64, causal W=15, at a small, a medium and a large [B, T] (WORKLOADS)."""

    seed = 0

    def _setup(self, size: str):
        B, T = WORKLOADS["cuda" if self.device == "cuda" else "cpu"][size]
        self.a_logits, v = make_inputs(B, T, 14, 0, torch.bfloat16, self.device)
        self.v = v * WORKLOAD_VALUE_SCALE
        self.out = torch.empty_like(self.v)

    def _run(self):
        self.out = self.kernel.ldsa_local_attention(self.a_logits, self.v, 14, 0)

    def _reference(self) -> torch.Tensor:
        return self.kernel.ldsa_forward_reference(self.a_logits, self.v, 14, 0)

    def setup_small(self):
        self._setup("small")

    def benchmark_small(self):
        self._run()

    def verify_small(self) -> torch.Tensor:
        return self._reference()

    def setup_medium(self):
        self._setup("medium")

    def benchmark_medium(self):
        self._run()

    def verify_medium(self) -> torch.Tensor:
        return self._reference()

    def setup_large(self):
        self._setup("large")

    def benchmark_large(self):
        self._run()

    def verify_large(self) -> torch.Tensor:
        return self._reference()

