"""log-mel benchmarks: the `kernels benchmark` class (small, medium and large workloads) and the side-by-side table
for tools/gpu_bench.py.

`side_by_side` times, at every measure shape of the spec and in one run: the public op (the design and
config `pick` chooses), the same config clip-resident, the eager reference and torch.compile(reference);
GB/s on the spec's canonical bytes, % of the copy bandwidth measured in the same run, speed-up over
torch.compile, and the relative Frobenius error against the spec's fp32 reference. Then a sweep of every
shipped tile config (two-pass, plus one clip-resident row) at the first measure shape of each (NF, NM):
(208, 3000, 201, 128), (104, 3000, 401, 80) and (208, 3000, 201, 80); a batch with silent clips (the floor
pass has real work) and batches with Whisper's Slaney filterbank (NM 80 and 128).
"""

import importlib

import torch

from kernels.benchmark import Benchmark

SPEC = "audio_mel_spectrogram_fused"
WHISPER_SHAPE = (208, 3000, 201)  # 30 s clips, n_fft 400


def speech_batch(B, F, NF, NM, device, seed=0):
    """Inputs shaped like the spec's make_inputs (speech-like STFT, triangular filterbank)."""
    g = torch.Generator(device=device).manual_seed(seed)
    tilt = torch.exp(-torch.arange(NF, device=device) / (NF / 3.0))
    env = 0.05 + torch.rand(B, F, 1, device=device, generator=g) ** 2
    stft = torch.complex(torch.randn(B, F, NF, device=device, generator=g) * tilt * env,
                         torch.randn(B, F, NF, device=device, generator=g) * tilt * env)
    centres = torch.linspace(0, NF - 1, NM + 2, device=device)
    k = torch.arange(NF, device=device, dtype=torch.float32)
    lo, mid, hi = centres[:-2, None], centres[1:-1, None], centres[2:, None]
    w = torch.minimum((k - lo) / (mid - lo).clamp(min=1e-6), (hi - k) / (hi - mid).clamp(min=1e-6))
    return stft, w.clamp(min=0.0).contiguous()


# (B, F, NF, NM) of the `kernels benchmark` workloads by device: on CUDA 30-s clips at Whisper's sizes, the large one
# a measure shape of the spec (1.3 GB a call); on the CPU (the eager reference) sizes that take milliseconds.
WORKLOADS = {
    "cuda": {"small": (16, 3000, 201, 80), "medium": (64, 3000, 201, 80), "large": (208, 3000, 201, 128)},
    "cpu": {"small": (1, 100, 201, 80), "medium": (2, 300, 201, 80), "large": (4, 500, 201, 128)},
}


class LogMelSpectrogram(Benchmark):
    """`log_mel_spectrogram` on a speech-like STFT and the spec's triangular filterbank at a small, a medium and a
    large (B, F, NF, NM) (`WORKLOADS`), against the eager reference."""

    seed = 0

    def _setup(self, workload: str):
        B, F, NF, NM = WORKLOADS["cuda" if str(self.device).startswith("cuda") else "cpu"][workload]
        self.stft, self.mel_filters = speech_batch(B, F, NF, NM, self.device)
        self.out = None

    def _run(self):
        self.out = self.kernel.log_mel_spectrogram(self.stft, self.mel_filters)

    def _verify(self) -> torch.Tensor:
        return self.kernel.log_mel_spectrogram_reference(self.stft, self.mel_filters)

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


def _fused_variants(kernel, fused, stft, w):
    """The public op (the design and config `pick` chooses) and the same config in the other design."""
    _, config = fused.pick(*stft.shape, w.shape[0])
    return {
        "public op (pick)": lambda: kernel.log_mel_spectrogram(stft, w),
        f"fused clip_resident {config.name}": lambda: fused.log_mel_triton(stft, w, "clip_resident", config),
    }


def _sweep(fused, stft, w):
    """Every shipped config with the two-pass design, and the default config once clip-resident (it lost
    every comparison of the first H200 run)."""
    impls = {f"two_pass {c.name}": (lambda c=c: fused.log_mel_triton(stft, w, "two_pass", c))
             for c in fused.SHIPPED_CONFIGS}
    impls[f"clip_resident {fused.DEFAULT_CONFIG.name}"] = lambda: fused.log_mel_triton(
        stft, w, "clip_resident", fused.DEFAULT_CONFIG)
    return impls


def _rows(case, impls, ref, work, bench, compile_ms=None):
    """Time each impl, then one row each: GB/s on canonical bytes, % of copy, x vs compile, error."""
    rows = []
    for name, fn in impls.items():
        ms = bench.time(fn)
        gbps = work / ms / 1e6
        row = {"case": case, "impl": name, "ms": ms, "metric": "GB/s", "value": gbps,
               "err": None if name == "eager reference" else bench.rel_err(fn(), ref),
               "pct_copy": 100.0 * gbps / bench.copy_gbps}
        if name == "torch.compile(reference)":
            compile_ms = ms
        if compile_ms is not None:
            row["x_vs_compile"] = compile_ms / ms
        rows.append(row)
    return rows


def _free():
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def side_by_side(kernel, bench, shapes=None, whisper_shape=WHISPER_SHAPE, sweep_shapes=None) -> list[dict]:
    s = bench.spec(SPEC)
    if s is None:
        return []
    fused = importlib.import_module(f"{kernel.__name__}.triton.stft")
    shapes = shapes or s.measure_shapes
    # The first measure shape of each (NF, NM): the band layouts the chunk loop sees differ only in those.
    sweep_shapes = sweep_shapes or [x for i, x in enumerate(shapes) if x[2:] not in [y[2:] for y in shapes[:i]]]
    compiled_ref = torch.compile(s.ref)
    rows = []

    # 1. Every measure shape: the anchors first (the compile time sets x_vs_compile), then our variants.
    for shape in shapes:
        stft, w = s.make(*shape, 0)
        ref = s.ref(stft, w)
        anchors = {"torch.compile(reference)": lambda: compiled_ref(stft, w), "eager reference": lambda: s.ref(stft, w)}
        anchor_rows = _rows(f"{shape}", anchors, ref, s.work(*shape), bench)
        compile_ms = anchor_rows[0]["ms"]
        rows += anchor_rows + _rows(f"{shape}", _fused_variants(kernel, fused, stft, w), ref, s.work(*shape),
                                    bench, compile_ms)
        del stft, w, ref
        _free()

    # 2. Every shipped tile config (the table `pick` is set from), at each (NF, NM).
    for shape in sweep_shapes if bench.sweep else []:
        stft, w = s.make(*shape, 0)
        ref = s.ref(stft, w)
        rows += _rows(f"{shape} config sweep", _sweep(fused, stft, w), ref, s.work(*shape), bench)
        del stft, w, ref
        _free()

    # 3. Silent clips (every 8th all zero, every 8th from 4 silent from a third on) and Whisper's filterbank.
    B, F, NF = whisper_shape
    for NM in (80, 128):
        stft, _ = s.make(B, F, NF, NM, 0)
        w = kernel.mel_filters(NM).to(stft.device)
        extra = {"torch.compile(reference)": lambda: compiled_ref(stft, w),
                 "public op (pick)": lambda: kernel.log_mel_spectrogram(stft, w)}
        ref = s.ref(stft, w)
        rows += _rows(f"{(B, F, NF, NM)} whisper slaney filterbank", extra, ref, s.work(B, F, NF, NM), bench)
        if NM == 128:
            stft[::8] = 0
            stft[4::8, F // 3 :] = 0
            ref = s.ref(stft, w)
            rows += _rows(f"{(B, F, NF, NM)} whisper filterbank, silent clips", extra, ref, s.work(B, F, NF, NM), bench)
        del stft, w, ref
        _free()
    return rows


if __name__ == "__main__":
    # CPU dry run of side_by_side at tiny shapes (TRITON_INTERPRET=1 runs the Triton kernels on CPU), from
    # the repo root: HF_HUB_OFFLINE=1 HF_HUB_CACHE=.hub .venv/bin/python kernels/log-mel/benchmarks/benchmark.py
    import os
    import sys
    import time
    from pathlib import Path

    os.environ.setdefault("TRITON_INTERPRET", "1")
    root = Path(__file__).resolve().parents[3]
    sys.path.insert(0, str(root))
    import testkit

    testkit.patch_interpreter()

    class FakeBench:
        copy_gbps = 10.0
        sweep = True

        @staticmethod
        def time(fn):
            t = time.perf_counter()
            fn()
            return 1e3 * (time.perf_counter() - t)

        spec = staticmethod(testkit.spec)
        rel_err = staticmethod(testkit.rel_err)

        @staticmethod
        def optional(name):
            return None

    lm = testkit.load("log-mel")
    for row in side_by_side(lm, FakeBench(), shapes=[(2, 37, 201, 128), (3, 20, 401, 80)], whisper_shape=(3, 25, 201)):
        print(row)


def compile_cases(kernel, spec):
    """(label, call) pairs for `python -m tools.compile_sm90`: both designs with every shipped config at every
    measure shape, on meta tensors."""
    fused = importlib.import_module(f"{kernel.__name__}.triton.stft")

    def case(shape, design, config):
        B, F, NF, NM = shape
        stft = torch.empty(B, F, NF, dtype=torch.complex64, device="meta")
        mel_filters = torch.empty(NM, NF, dtype=torch.float32, device="meta")
        return f"{shape} {design} {config.name}", lambda: fused.log_mel_triton(stft, mel_filters, design, config)

    for shape in spec(SPEC).measure_shapes:
        for design in fused.DESIGNS:
            for config in fused.SHIPPED_CONFIGS:
                yield case(shape, design, config)
