"""log-mel side by side with its anchors, for the GPU run, and the launches compiled offline.

`side_by_side` times, at every measure shape of the spec and in one run: the public op (the config `pick`
chooses), the eager reference and torch.compile(reference); GB/s on the spec's canonical bytes, % of the copy
bandwidth measured in the same run, speed-up over torch.compile, and the relative Frobenius error against the
spec's fp32 reference. Then a sweep of every config the pick table names at the first measure shape of each (NF, NM):
(208, 3000, 201, 128), (104, 3000, 401, 80) and (208, 3000, 201, 80); a batch with silent clips (the floor
pass has real work) and batches with Whisper's Slaney filterbank (NM 80 and 128). Then `waveform_rows`:
`whisper_log_mel` on 30-s clips beside flashmel and transformers' torch path, and each waveform kernel's config.
"""

import torch

from .harness import device, floor_row, free, gbps_row, hub_benchmark, latency_row, max_abs_err, submodule

SPEC = "audio_mel_spectrogram_fused"
WHISPER_SHAPE = (208, 3000, 201)  # 30 s clips, n_fft 400
WAVEFORM_BATCHES = (16, 64, 208)  # 30-s clips a call of the waveform rows
LATENCY_BATCHES = (1, 4, 16, 64, 208)  # 30-s clips a call of the latency table, from one request to a full batch
whisper_batch = hub_benchmark("log-mel").whisper_batch


def _sweep(fused, stft, w):
    """Every config the pick table names."""
    return {rule.config.name: (lambda c=rule.config: fused.launch(stft, w, c)) for rule in fused.PICK_TABLE}


def _features(main_pass, floor, audio, lengths, n_mels, out_dtype, with_floor=False):
    """A `whisper_log_mel` path's features: `main_pass` (the module `portable.waveform` or `hopper.waveform`), then
    the floor pass (`portable.floor`), or `with_floor` the main pass with the floor folded into its launch."""
    out, stats, block_f = main_pass.launch(audio, lengths, n_mels, out_dtype, with_floor=with_floor)
    if not with_floor:
        floor.launch(out, stats, block_f)
    return out


def _plans(kernel, audio, n_mels, out_dtype=torch.float32):
    """{plan: call} of `whisper_log_mel`'s CUDA entry point in each of `dispatch.WAVEFORM_PLANS` (one launch, the
    floor folded into the main pass's; two launches), on the path `dispatch.waveform_path` picks."""
    dispatch = submodule(kernel, "dispatch")
    return {plan: (lambda p=plan: dispatch.whisper_log_mel_cuda(audio, None, n_mels, out_dtype, plan=p))
            for plan in dispatch.WAVEFORM_PLANS}


def _rows(case, impls, ref, work, bench, compile_ms=None):
    """Time each impl, then one row each: GB/s on canonical bytes, % of copy, x vs compile, error."""
    rows = []
    for name, fn in impls.items():
        err = None if name == "eager reference" else bench.rel_err(fn(), ref)
        row = gbps_row(case, name, bench.time(fn), work, bench, err)
        if name == "torch.compile(reference)":
            compile_ms = row["ms"]
        if compile_ms is not None:
            row["x_vs_compile"] = compile_ms / row["ms"]
        rows.append(row)
    return rows


def side_by_side(kernel, bench, shapes=None, whisper_shape=WHISPER_SHAPE, sweep_shapes=None,
                 waveform_batches=WAVEFORM_BATCHES, n_samples=30 * 16000,
                 latency_batches=LATENCY_BATCHES) -> list[dict]:
    rows = _stft_rows(kernel, bench, shapes, whisper_shape, sweep_shapes)
    rows += waveform_rows(kernel, bench, waveform_batches, n_samples)
    return rows + latency_rows(kernel, bench, latency_batches, n_samples)


def _stft_rows(kernel, bench, shapes, whisper_shape, sweep_shapes) -> list[dict]:
    s = bench.spec(SPEC)
    if s is None:
        return []
    fused = submodule(kernel, "portable.stft")
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
        free()

    # 2. Every config the pick table names, at each (NF, NM).
    for shape in sweep_shapes if bench.sweep else []:
        stft, w = s.make(*shape, 0)
        ref = s.ref(stft, w)
        rows += _rows(f"{shape} config sweep", _sweep(fused, stft, w), ref, s.work(*shape), bench)
        del stft, w, ref
        free()

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
        free()
    return rows


def compile_cases(kernel, spec):
    """(label, call) pairs for `python -m tools.compile_offline`, on meta tensors: the STFT op with every config its
    pick table names at every measure shape of the spec, the waveform op's Triton path at 30-s clips for every
    audio and output dtype, with and without lengths, and the Gluon waveform path where `dispatch.FAST_PATHS` runs it
    on meta tensors (the target claims it and it compiles under this Triton; also on clips of one tile); each
    waveform case in both plans (`dispatch.WAVEFORM_PLANS`): the floor pass after the main pass, and the main pass
    with the floor folded in ("with floor")."""
    fused = submodule(kernel, "portable.stft")
    waveform = submodule(kernel, "portable.waveform")
    floor = submodule(kernel, "portable.floor")

    def case(shape, config):
        B, F, NF, NM = shape
        stft = torch.empty(B, F, NF, dtype=torch.complex64, device="meta")
        mel_filters = torch.empty(NM, NF, dtype=torch.float32, device="meta")
        return f"{shape} {config.name}", lambda: fused.launch(stft, mel_filters, config)

    for shape in spec(SPEC).measure_shapes:
        for rule in fused.PICK_TABLE:
            yield case(shape, rule.config)

    def waveform_case(main_pass, name, n_mels, audio_dtype, out_dtype, with_lengths, with_floor, shape=(208, 480000)):
        audio = torch.empty(shape, dtype=audio_dtype, device="meta")
        lengths = torch.empty(shape[0], dtype=torch.int64, device="meta") if with_lengths else None
        label = (f"{name} {n_mels} mels {str(audio_dtype)[6:]}->{str(out_dtype)[6:]}"
                 f"{' lengths' if with_lengths else ''}{' with floor' if with_floor else ''}")
        return label, lambda: _features(main_pass, floor, audio, lengths, n_mels, out_dtype, with_floor)

    dtypes = ((80, torch.float32, torch.float32, False), (128, torch.float32, torch.float32, False),
              (80, torch.int16, torch.bfloat16, True), (128, torch.bfloat16, torch.float16, True))
    dispatch = submodule(kernel, "dispatch")
    gluon = None
    if dispatch.FAST_PATHS.runs("waveform-gluon", torch.device("meta")):
        gluon = submodule(kernel, "hopper.waveform")
    for with_floor in (False, True):
        for case in dtypes:
            yield waveform_case(waveform, f"waveform {waveform.DEFAULT_CONFIG.name}", *case, with_floor)
        if gluon is not None:
            for case in dtypes:
                yield waveform_case(gluon, "waveform-gluon", *case, with_floor)
            # Half-second clips: one tile a clip.
            yield waveform_case(gluon, "waveform-gluon one-tile clips", 80, torch.float32, torch.float32, False,
                                with_floor, (3, 8000))


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
    waveform = submodule(kernel, "portable.waveform")
    floor = submodule(kernel, "portable.floor")
    flashmel = bench.optional("flashmel")
    run_on = device()
    # The Gluon kernel on its own, wherever its GPU takes it (verified or not: these rows verify it).
    dispatch = submodule(kernel, "dispatch")
    gluon = None
    if dispatch.FAST_PATHS.compiles_for("waveform-gluon", torch.device(run_on)):
        gluon = submodule(kernel, "hopper.waveform")
    rows = []
    for B in batches:
        audio = whisper_batch(B, n_samples, run_on)
        pcm = (audio * 32768).round().clamp(-32768, 32767).to(torch.int16)
        pcm_audio = pcm.float() / 32768
        for n_mels in (80, 128):
            filters = kernel.mel_filters(n_mels).to(run_on)
            ref64 = _float64_features(audio, n_mels, filters)
            pcm_ref64 = _float64_features(pcm_audio, n_mels, filters)
            F = n_samples // 160
            fp32_bytes = B * n_samples * 4 + B * n_mels * F * 4
            pcm_bytes = B * n_samples * 2 + B * n_mels * F * 2
            impls = {}
            if flashmel is not None:
                mel_only, with_log = _flashmel_log(flashmel, n_mels, run_on)
                _, with_log_bf16 = _flashmel_log(flashmel, n_mels, run_on, torch.bfloat16)
                impls["flashmel 0.1.0 + torch log/floor, fp32"] = (lambda: with_log(audio), ref64, fp32_bytes)
                impls["flashmel 0.1.0 mel only (no log), fp32"] = (lambda: mel_only(audio), None, fp32_bytes)
                impls["flashmel 0.1.0 + torch log/floor, int16 -> bf16"] = (lambda: with_log_bf16(pcm), pcm_ref64,
                                                                            pcm_bytes)
            impls["transformers torch path (device), fp32"] = (
                lambda: _transformers_torch_path(filters)(audio), ref64, fp32_bytes)
            impls["whisper_log_mel, fp32"] = (lambda: kernel.whisper_log_mel(audio, n_mels), ref64, fp32_bytes)
            impls["whisper_log_mel, int16 -> bf16"] = (
                lambda: kernel.whisper_log_mel(pcm, n_mels, out_dtype=torch.bfloat16), pcm_ref64, pcm_bytes)
            for plan, call in _plans(kernel, audio, n_mels).items():
                impls[f"whisper_log_mel {plan}, fp32"] = (call, ref64, fp32_bytes)
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
                row = gbps_row(case, name, bench.time(fn), work, bench)
                timed[name] = row["ms"]
                if ref is not None:  # the max abs error, against the float64 features in the output's dtype
                    out = fn()
                    row["err"] = max_abs_err(out, ref.to(out.dtype) if out.dtype != torch.float32 else ref)
                    if name.startswith(("whisper_log_mel", "waveform kernel")):
                        row["silent_clip_exact"] = bool((out[2] == -1.5).all()) if B >= 4 else None
                    del out
                rows.append(row)
            for row in rows[-len(impls):]:
                anchor = ("flashmel 0.1.0 + torch log/floor, int16 -> bf16" if "int16" in row["impl"]
                          else "flashmel 0.1.0 + torch log/floor, fp32")
                if anchor in timed:
                    row["x_vs_flashmel_log"] = timed[anchor] / row["ms"]
            del ref64, pcm_ref64
            free()
        del audio, pcm, pcm_audio
        free()
    return rows



def latency_rows(kernel, bench, batches=LATENCY_BATCHES, n_samples=30 * 16000) -> list[dict]:
    """The latency table's rows: the empty-launch floor, then at each batch of 30-s clips and 80 and 128 mels the
    wall-clock per eager call (calls back to back, one sync at the end) and GPU time of `whisper_log_mel` in fp32
    and int16 -> bf16, of its registered custom op (the dispatch layers the public function skips), of its CUDA entry
    point in each plan (`dispatch.WAVEFORM_PLANS`: the floor in the main pass's launch, or a launch of its own; the
    rows `dispatch.ONE_LAUNCH_MAX_CLIPS` is set from), and of flashmel + torch log/floor beside them (the bar: half
    its wall-clock at every batch, within 15 us of the floor at one clip)."""
    flashmel = bench.optional("flashmel")
    run_on = device()
    rows = [floor_row(run_on)]
    for B in batches:
        audio = whisper_batch(B, n_samples, run_on)
        pcm = (audio * 32768).round().clamp(-32768, 32767).to(torch.int16)
        for n_mels in (80, 128):
            impls = {
                "whisper_log_mel, fp32": lambda: kernel.whisper_log_mel(audio, n_mels),
                "whisper_log_mel, int16 -> bf16": lambda: kernel.whisper_log_mel(pcm, n_mels,
                                                                                   out_dtype=torch.bfloat16),
                "registered custom op, fp32": lambda: kernel.op.whisper_log_mel_op(audio, None, n_mels,
                                                                                   torch.float32),
                **{f"entry point {plan}, fp32": call for plan, call in _plans(kernel, audio, n_mels).items()},
            }
            if flashmel is not None:
                _, with_log = _flashmel_log(flashmel, n_mels, run_on)
                _, with_log_bf16 = _flashmel_log(flashmel, n_mels, run_on, torch.bfloat16)
                impls["flashmel 0.1.0 + torch log/floor, fp32"] = lambda: with_log(audio)
                impls["flashmel 0.1.0 + torch log/floor, int16 -> bf16"] = lambda: with_log_bf16(pcm)
            case = f"latency B={B} N={n_samples} mels={n_mels}"
            rows += [latency_row(case, impl, fn, run_on) for impl, fn in impls.items()]
        del audio, pcm
        free()
    return rows
