"""log-mel's `kernels benchmark` class: `whisper_log_mel` on speech-like 30-s clips at a small, a medium and a
large workload, verified against the eager reference."""

import math

import torch
from kernels.benchmark import Benchmark


def speech_like(n_samples: int, seed: int) -> torch.Tensor:
    """A float32 clip on the CPU that a speech front end sees (no recording needed): a sequence of segments of 0.08
    to 0.33 s, each voiced (a pulse train at 100-180 Hz with vibrato through three formant resonances and a
    -6 dB/kHz tilt), fricative (noise above 3 kHz), near-silent (noise at -80 dB) or digital silence, each under
    a smooth envelope; peak 0.5."""
    g = torch.Generator().manual_seed(seed)
    out = torch.zeros(n_samples, dtype=torch.float64)
    pos = 0
    while pos < n_samples:
        L = int(16000 * (0.08 + 0.25 * torch.rand(1, generator=g).item()))
        kind = torch.randint(0, 4, (1,), generator=g).item()
        t = torch.arange(L, dtype=torch.float64) / 16000
        f = torch.fft.rfftfreq(L, 1 / 16000).double()
        if kind <= 1:
            f0 = 100 + 80 * torch.rand(1, generator=g).item()
            pulses = (torch.sin(2 * math.pi * torch.cumsum(f0 * (1 + 0.05 * torch.sin(2 * math.pi * 5 * t)), 0)
                                / 16000) > 0.95).double()
            envelope = sum(1 / (1 + ((f - centre) / width) ** 2) for centre, width in
                           [(500 + 400 * torch.rand(1, generator=g).item(), 80),
                            (1500 + 800 * torch.rand(1, generator=g).item(), 120),
                            (2500 + 600 * torch.rand(1, generator=g).item(), 200)])
            segment = torch.fft.irfft(torch.fft.rfft(pulses - pulses.mean()) * envelope * torch.exp(-f / 3000), n=L)
        elif kind == 2:
            noise = torch.randn(L, generator=g, dtype=torch.float64)
            segment = torch.fft.irfft(torch.fft.rfft(noise) * (f > 3000) * 0.3, n=L)
        else:
            segment = 1e-4 * torch.randn(L, generator=g, dtype=torch.float64) * (torch.rand(1, generator=g).item() < 0.5)
        end = min(L, n_samples - pos)
        out[pos : pos + end] = (segment * torch.sin(math.pi * torch.arange(L) / L) ** 0.5)[:end]
        pos += L
    return (0.5 * out / out.abs().max().clamp_min(1e-30)).float()


def whisper_batch(B: int, n_samples: int, device, seed: int = 0) -> torch.Tensor:
    """(B, n_samples) float32 on `device`: speech-like clips (8 distinct ones, shifted and scaled by 0.05-1), and
    where B >= 4 a noise clip, a silent clip and a speech clip at -80 dB among them."""
    g = torch.Generator().manual_seed(seed)
    distinct = torch.stack([speech_like(n_samples, seed + i) for i in range(min(B, 8))])
    pick = torch.randint(0, len(distinct), (B,), generator=g)
    gains = 0.05 + 0.95 * torch.rand(B, 1, generator=g)
    audio = torch.stack([distinct[i].roll(int(torch.randint(0, n_samples, (1,), generator=g))) for i in pick]) * gains
    if B >= 4:
        audio[1] = 0.05 * torch.randn(n_samples, generator=g)
        audio[2] = 0
        audio[3] = distinct[0] * 1e-4
    return audio.to(device)


# The `kernels benchmark` workloads, (B, N, n_mels) by device: on CUDA batches of 30-s clips; on the CPU (the eager
# reference) sizes that take milliseconds.
WORKLOADS = {
    "cuda": {"small": (16, 480000, 80), "medium": (64, 480000, 80), "large": (208, 480000, 128)},
    "cpu": {"small": (1, 16000, 80), "medium": (2, 32000, 80), "large": (4, 48000, 128)},
}


class LogMel(Benchmark):
    """`whisper_log_mel` on speech-like clips (with a noise, a silent and a -80 dB clip where B >= 4) at a small, a
    medium and a large (B, N, n_mels) (`WORKLOADS`), against the eager reference."""

    seed = 0

    def _setup(self, workload: str):
        B, N, self.n_mels = WORKLOADS["cuda" if str(self.device).startswith("cuda") else "cpu"][workload]
        self.audio = whisper_batch(B, N, self.device)
        self.out = None

    def _run(self):
        self.out = self.kernel.whisper_log_mel(self.audio, self.n_mels)

    def _verify(self) -> torch.Tensor:
        return self.kernel.whisper_log_mel_reference(self.audio, self.n_mels)

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
