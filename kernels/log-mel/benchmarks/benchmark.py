"""log-mel benchmarks: the `kernels benchmark` class (waveform and STFT workloads, small to large) and the
side-by-side table for tools/gpu_bench.py.

`side_by_side` times, at every measure shape of the spec and in one run: the public op (the config `pick`
chooses), the eager reference and torch.compile(reference); GB/s on the spec's canonical bytes, % of the copy
bandwidth measured in the same run, speed-up over torch.compile, and the relative Frobenius error against the
spec's fp32 reference. Then a sweep of every config the pick table names at the first measure shape of each (NF, NM):
(208, 3000, 201, 128), (104, 3000, 401, 80) and (208, 3000, 201, 80); a batch with silent clips (the floor
pass has real work) and batches with Whisper's Slaney filterbank (NM 80 and 128). Then `waveform_rows`:
`whisper_log_mel` on 30-s clips beside flashmel and transformers' torch path, and each waveform kernel's config.
"""

import importlib
import math

import torch

from kernels.benchmark import Benchmark

SPEC = "audio_mel_spectrogram_fused"
WHISPER_SHAPE = (208, 3000, 201)  # 30 s clips, n_fft 400
WAVEFORM_BATCHES = (16, 64, 208)  # 30-s clips a call of the waveform rows


def speech_like(n_samples: int, seed: int) -> torch.Tensor:
    """A float32 clip on the CPU that a speech front end sees (no recording needed): a sequence of 80-330 ms
    segments, each voiced (a pulse train at 100-180 Hz with vibrato through three formant resonances and a
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


# The `kernels benchmark` workloads by device: small, medium and large run `whisper_log_mel` on (B, N) clips
# at n_mels, stft_* run `log_mel_spectrogram` at (B, F, NF, NM). On CUDA 30-s clips (the large STFT one a measure
# shape of the spec, 1.3 GB a call); on the CPU (the eager reference) sizes that take milliseconds.
WORKLOADS = {
    "cuda": {"small": (16, 480000, 80), "medium": (64, 480000, 80), "large": (208, 480000, 128),
             "stft_small": (16, 3000, 201, 80), "stft_medium": (64, 3000, 201, 80),
             "stft_large": (208, 3000, 201, 128)},
    "cpu": {"small": (1, 16000, 80), "medium": (2, 32000, 80), "large": (4, 48000, 128),
            "stft_small": (1, 100, 201, 80), "stft_medium": (2, 300, 201, 80), "stft_large": (4, 500, 201, 128)},
}


class LogMel(Benchmark):
    """`whisper_log_mel` on speech-like clips (with a noise, a silent and a -80 dB clip where B >= 4) and
    `log_mel_spectrogram` on a speech-like STFT with the spec's triangular filterbank, each at a small, a medium
    and a large size (`WORKLOADS`), against the eager references."""

    seed = 0

    def _shape(self, workload: str):
        return WORKLOADS["cuda" if str(self.device).startswith("cuda") else "cpu"][workload]

    def _setup_waveform(self, workload: str):
        B, N, self.n_mels = self._shape(workload)
        self.audio = whisper_batch(B, N, self.device)
        self.out = None

    def _run_waveform(self):
        self.out = self.kernel.whisper_log_mel(self.audio, self.n_mels)

    def _verify_waveform(self) -> torch.Tensor:
        return self.kernel.whisper_log_mel_reference(self.audio, self.n_mels)

    def _setup_stft(self, workload: str):
        self.stft, self.mel_filters = speech_batch(*self._shape(workload), self.device)
        self.out = None

    def _run_stft(self):
        self.out = self.kernel.log_mel_spectrogram(self.stft, self.mel_filters)

    def _verify_stft(self) -> torch.Tensor:
        return self.kernel.log_mel_spectrogram_reference(self.stft, self.mel_filters)

    def setup(self):
        """Both large workloads at once (for a run of every benchmark_* method on one setup, as gpu_profile does)."""
        self._setup_waveform("large")
        self._setup_stft("stft_large")

    def setup_small(self):
        self._setup_waveform("small")

    def benchmark_small(self):
        self._run_waveform()

    def verify_small(self) -> torch.Tensor:
        return self._verify_waveform()

    def setup_medium(self):
        self._setup_waveform("medium")

    def benchmark_medium(self):
        self._run_waveform()

    def verify_medium(self) -> torch.Tensor:
        return self._verify_waveform()

    def setup_large(self):
        self._setup_waveform("large")

    def benchmark_large(self):
        self._run_waveform()

    def verify_large(self) -> torch.Tensor:
        return self._verify_waveform()

    def setup_stft_small(self):
        self._setup_stft("stft_small")

    def benchmark_stft_small(self):
        self._run_stft()

    def verify_stft_small(self) -> torch.Tensor:
        return self._verify_stft()

    def setup_stft_medium(self):
        self._setup_stft("stft_medium")

    def benchmark_stft_medium(self):
        self._run_stft()

    def verify_stft_medium(self) -> torch.Tensor:
        return self._verify_stft()

    def setup_stft_large(self):
        self._setup_stft("stft_large")

    def benchmark_stft_large(self):
        self._run_stft()

    def verify_stft_large(self) -> torch.Tensor:
        return self._verify_stft()


def _sweep(fused, stft, w):
    """Every config the pick table names."""
    return {rule.config.name: (lambda c=rule.config: fused.launch(stft, w, c)) for rule in fused.PICK_TABLE}


def _features(main_pass, floor, audio, lengths, n_mels, out_dtype):
    """A `whisper_log_mel` path's features: `main_pass` (the module `portable.waveform` or `hopper.waveform`), then
    the floor pass (`portable.floor`)."""
    out, stats, block_f = main_pass.launch(audio, lengths, n_mels, out_dtype)
    floor.launch(out, stats, block_f)
    return out


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


def side_by_side(kernel, bench, shapes=None, whisper_shape=WHISPER_SHAPE, sweep_shapes=None,
                 waveform_batches=WAVEFORM_BATCHES, n_samples=30 * 16000) -> list[dict]:
    rows = _stft_rows(kernel, bench, shapes, whisper_shape, sweep_shapes)
    return rows + waveform_rows(kernel, bench, waveform_batches, n_samples)


def _stft_rows(kernel, bench, shapes, whisper_shape, sweep_shapes) -> list[dict]:
    s = bench.spec(SPEC)
    if s is None:
        return []
    fused = importlib.import_module(f"{kernel.__name__}.portable.stft")
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
        public_op = {"public op (pick)": lambda: kernel.log_mel_spectrogram(stft, w)}
        rows += anchor_rows + _rows(f"{shape}", public_op, ref, s.work(*shape), bench, compile_ms)
        del stft, w, ref
        _free()

    # 2. Every config the pick table names, at each (NF, NM).
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


def compile_cases(kernel, spec):
    """(label, call) pairs for `python -m tools.compile_sm90`, on meta tensors: the STFT op with every config its
    pick table names at every measure shape of the spec, the waveform op's Triton path at 30-s clips for every
    audio and output dtype, with and without lengths, and the Gluon waveform path where it compiles (also on clips
    of one tile)."""
    fused = importlib.import_module(f"{kernel.__name__}.portable.stft")
    waveform = importlib.import_module(f"{kernel.__name__}.portable.waveform")
    floor = importlib.import_module(f"{kernel.__name__}.portable.floor")

    def case(shape, config):
        B, F, NF, NM = shape
        stft = torch.empty(B, F, NF, dtype=torch.complex64, device="meta")
        mel_filters = torch.empty(NM, NF, dtype=torch.float32, device="meta")
        return f"{shape} {config.name}", lambda: fused.launch(stft, mel_filters, config)

    for shape in spec(SPEC).measure_shapes:
        for rule in fused.PICK_TABLE:
            yield case(shape, rule.config)

    def waveform_case(n_mels, audio_dtype, out_dtype, with_lengths):
        audio = torch.empty(208, 480000, dtype=audio_dtype, device="meta")
        lengths = torch.empty(208, dtype=torch.int64, device="meta") if with_lengths else None
        label = (f"waveform {n_mels} mels {str(audio_dtype)[6:]}->{str(out_dtype)[6:]}"
                 f"{' lengths' if with_lengths else ''} {waveform.DEFAULT_CONFIG.name}")
        return label, lambda: _features(waveform, floor, audio, lengths, n_mels, out_dtype)

    for n_mels in (80, 128):
        yield waveform_case(n_mels, torch.float32, torch.float32, False)
    yield waveform_case(80, torch.int16, torch.bfloat16, True)
    yield waveform_case(128, torch.bfloat16, torch.float16, True)
    dispatch = importlib.import_module(f"{kernel.__name__}.dispatch")
    if dispatch.FAST_PATHS.compiles("waveform-gluon"):
        gluon = importlib.import_module(f"{kernel.__name__}.hopper.waveform")
        for n_mels, audio_dtype, out_dtype, with_lengths in ((80, torch.float32, torch.float32, False),
                                                             (128, torch.float32, torch.float32, False),
                                                             (80, torch.int16, torch.bfloat16, True),
                                                             (128, torch.bfloat16, torch.float16, True)):
            audio = torch.empty(208, 480000, dtype=audio_dtype, device="meta")
            lengths = torch.empty(208, dtype=torch.int64, device="meta") if with_lengths else None
            yield (f"waveform-gluon {n_mels} mels {str(audio_dtype)[6:]}->{str(out_dtype)[6:]}"
                   f"{' lengths' if with_lengths else ''}",
                   lambda a=audio, l=lengths, m=n_mels, o=out_dtype: _features(gluon, floor, a, l, m, o))
        # Half-second clips: one tile a clip.
        short = torch.empty(3, 8000, dtype=torch.float32, device="meta")
        yield ("waveform-gluon 80 mels float32->float32 one-tile clips",
               lambda: _features(gluon, floor, short, None, 80, torch.float32))


def _transformers_torch_path(mel_filters_t):
    """transformers' WhisperFeatureExtractor._torch_extract_fbank_features on a device tensor (its ops, without the
    numpy round trip): torch.stft, |.|^2 of all but the last frame, filters @, log10, per-clip floor."""

    def run(audio):
        window = torch.hann_window(400, device=audio.device)
        stft = torch.stft(audio, 400, 160, window=window, return_complex=True)
        magnitudes = (stft[..., :-1].abs() ** 2).contiguous()
        log_spec = torch.clamp(mel_filters_t @ magnitudes, min=1e-10).log10()
        max_val = log_spec.max(dim=2, keepdim=True)[0].max(dim=1, keepdim=True)[0]
        return (torch.maximum(log_spec, max_val - 8.0) + 4.0) / 4.0

    return run


def _flashmel_log(flashmel, n_mels, device, out_dtype=torch.float32):
    """flashmel's fused mel spectrogram with Whisper's filterbank, then the log, the per-clip floor and the rescale
    in torch (flashmel's power spectrogram has one frame more than Whisper keeps)."""
    mel = flashmel.MelSpectrogram(sample_rate=16000, n_fft=400, hop_length=160, n_mels=n_mels, norm="slaney",
                                  mel_scale="slaney").to(device)

    def mel_only(audio):
        return mel(audio)

    def with_log(audio):
        log_spec = mel(audio)[..., :-1].clamp(min=1e-10).log10()
        hi = log_spec.amax(dim=(1, 2), keepdim=True)
        return ((torch.maximum(log_spec, hi - 8.0) + 4.0) / 4.0).to(out_dtype)

    return mel_only, with_log


def _float64_features(audio, n_mels, mel_filters):
    """The front end in float64 on the audio's device, clip by clip (torch.stft in float64, the same maths)."""
    out = []
    window = torch.hann_window(400, dtype=torch.float64, device=audio.device)
    w = mel_filters.double().to(audio.device)
    for clip in audio.double():
        stft = torch.stft(clip, 400, 160, window=window, return_complex=True)[..., :-1]
        log_spec = (w @ stft.abs() ** 2).clamp(min=1e-10).log10()
        out.append((torch.maximum(log_spec, log_spec.max() - 8.0) + 4.0) / 4.0)
    return torch.stack(out)


def waveform_rows(kernel, bench, batches=WAVEFORM_BATCHES, n_samples=30 * 16000) -> list[dict]:
    """`whisper_log_mel` from 30-s clips at each batch size and 80 and 128 mels, in fp32 and int16-in / bf16-out,
    beside flashmel (mel only, and with the log and floor in torch: the bar), and transformers' torch path on
    the device. GB/s on the essential bytes (the audio read once, the features written once), % of the copy rate
    in this run, x over flashmel + log, and the max abs error against float64 (fp32 rows) or against the float64
    features rounded to bf16 (bf16 rows). The Gluon and Triton waveform kernels on their own where the GPU takes
    the Gluon one, then each one again under its config's name at the largest batch and 80 mels."""
    waveform = importlib.import_module(f"{kernel.__name__}.portable.waveform")
    floor = importlib.import_module(f"{kernel.__name__}.portable.floor")
    flashmel = bench.optional("flashmel")
    device = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU: the dry run below
    # The Gluon kernel on its own, wherever its GPU takes it (verified or not: these rows verify it).
    dispatch = importlib.import_module(f"{kernel.__name__}.dispatch")
    gluon = None
    if dispatch.FAST_PATHS.compiles_for("waveform-gluon", torch.device(device)):
        gluon = importlib.import_module(f"{kernel.__name__}.hopper.waveform")
    rows = []
    for B in batches:
        audio = whisper_batch(B, n_samples, device)
        pcm = (audio * 32768).round().clamp(-32768, 32767).to(torch.int16)
        pcm_audio = pcm.float() / 32768
        for n_mels in (80, 128):
            filters = kernel.mel_filters(n_mels).to(device)
            ref64 = _float64_features(audio, n_mels, filters)
            pcm_ref64 = _float64_features(pcm_audio, n_mels, filters)
            F = n_samples // 160
            fp32_bytes = B * n_samples * 4 + B * n_mels * F * 4
            pcm_bytes = B * n_samples * 2 + B * n_mels * F * 2
            impls = {}
            if flashmel is not None:
                mel_only, with_log = _flashmel_log(flashmel, n_mels, device)
                _, with_log_bf16 = _flashmel_log(flashmel, n_mels, device, torch.bfloat16)
                impls["flashmel 0.1.0 + torch log/floor, fp32"] = (lambda: with_log(audio), ref64, fp32_bytes)
                impls["flashmel 0.1.0 mel only (no log), fp32"] = (lambda: mel_only(audio), None, fp32_bytes)
                impls["flashmel 0.1.0 + torch log/floor, int16 -> bf16"] = (lambda: with_log_bf16(pcm), pcm_ref64,
                                                                            pcm_bytes)
            impls["transformers torch path (device), fp32"] = (
                lambda: _transformers_torch_path(filters)(audio), ref64, fp32_bytes)
            impls["whisper_log_mel, fp32"] = (lambda: kernel.whisper_log_mel(audio, n_mels), ref64, fp32_bytes)
            impls["whisper_log_mel, int16 -> bf16"] = (
                lambda: kernel.whisper_log_mel(pcm, n_mels, out_dtype=torch.bfloat16), pcm_ref64, pcm_bytes)
            if gluon is not None:
                impls["waveform-gluon kernel, fp32"] = (
                    lambda: _features(gluon, floor, audio, None, n_mels, torch.float32), ref64, fp32_bytes)
                impls["waveform-gluon kernel, int16 -> bf16"] = (
                    lambda: _features(gluon, floor, pcm, None, n_mels, torch.bfloat16), pcm_ref64, pcm_bytes)
                impls["waveform triton kernel, fp32"] = (
                    lambda: _features(waveform, floor, audio, None, n_mels, torch.float32), ref64, fp32_bytes)
            if B == batches[-1] and n_mels == 80 and gluon is not None:
                impls[f"waveform-gluon kernel {gluon.DEFAULT_CONFIG.name}, fp32"] = (
                    lambda: _features(gluon, floor, audio, None, n_mels, torch.float32), ref64, fp32_bytes)
            if B == batches[-1] and n_mels == 80:
                impls[f"waveform kernel {waveform.DEFAULT_CONFIG.name}, fp32"] = (
                    lambda: _features(waveform, floor, audio, None, n_mels, torch.float32), ref64, fp32_bytes)
            case = f"waveform B={B} N={n_samples} mels={n_mels}"
            timed = {}
            for name, (fn, ref, work) in impls.items():
                ms = bench.time(fn)
                timed[name] = ms
                gbps = work / ms / 1e6
                row = {"case": case, "impl": name, "ms": ms, "metric": "GB/s", "value": gbps,
                       "pct_copy": 100.0 * gbps / bench.copy_gbps}
                if ref is not None:
                    out = fn()
                    target = ref.to(out.dtype).double() if out.dtype != torch.float32 else ref
                    row["err"] = (out.double() - target).abs().max().item()
                    if name.startswith("whisper_log_mel") or name.startswith("waveform kernel"):
                        row["silent_clip_exact"] = bool((out[2] == -1.5).all()) if B >= 4 else None
                    del out
                rows.append(row)
            for row in rows[-len(impls):]:
                anchor = ("flashmel 0.1.0 + torch log/floor, int16 -> bf16" if "int16" in row["impl"]
                          else "flashmel 0.1.0 + torch log/floor, fp32")
                if anchor in timed:
                    row["x_vs_flashmel_log"] = timed[anchor] / row["ms"]
            del ref64, pcm_ref64
            _free()
        del audio, pcm, pcm_audio
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
    for row in side_by_side(lm, FakeBench(), shapes=[(2, 37, 201, 128), (3, 20, 401, 80)], whisper_shape=(3, 25, 201),
                            waveform_batches=(4,), n_samples=4000):
        print(row)
