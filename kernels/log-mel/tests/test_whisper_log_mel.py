"""`whisper_log_mel` from the waveform: against transformers' WhisperFeatureExtractor (its torch path, float32) and a
float64 construction, on speech-like clips with noise, digital silence and a clip 80 dB down in one batch; every
audio and output dtype, lengths, bad input; the Triton kernel itself (interpreted on CPU, compiled on CUDA); and a
tiny Whisper model giving the same logits from our features as from the feature extractor's."""

import importlib.util
import math
from pathlib import Path

import pytest
import torch

from testkit import HAS_CUDA, load, needs_cuda, needs_triton, submodule

DEVICE = "cuda" if HAS_CUDA else "cpu"
_BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "benchmark.py"
_spec = importlib.util.spec_from_file_location("log_mel_benchmark", _BENCH)
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


@pytest.fixture(scope="module")
def lm():
    return load("log-mel")


@pytest.fixture(scope="module")
def waveform(lm):
    pytest.importorskip("triton")
    return submodule(lm, "portable.waveform")


def features(lm, main_pass, audio, lengths, n_mels, out_dtype, with_floor=False):
    """`main_pass` (a waveform module: `portable.waveform` or `hopper.waveform`) and the floor pass on `audio`, or
    `with_floor` the main pass with the floor folded into its launch."""
    out, stats, block_f = main_pass.launch(audio, lengths, n_mels, out_dtype, with_floor=with_floor)
    if not with_floor:
        submodule(lm, "portable.floor").launch(out, stats, block_f)
    return out


def same_bits(x, y) -> bool:
    """x and y equal, NaN where the other is NaN."""
    return torch.equal(x.isnan(), y.isnan()) and torch.equal(x.nan_to_num(), y.nan_to_num())


def transformers_features(audio: torch.Tensor, n_mels: int) -> torch.Tensor:
    fe = pytest.importorskip("transformers").WhisperFeatureExtractor(feature_size=n_mels)
    return torch.from_numpy(fe._torch_extract_fbank_features(audio.float().cpu().numpy(), device="cpu"))


def float64_features(audio: torch.Tensor, n_mels: int) -> torch.Tensor:
    """The front end in float64 by an independent route: frames gathered by index (reflect padding), rfft,
    transformers' filterbank, a per-clip loop."""
    x = audio.double().cpu()
    B, N = x.shape
    j = torch.arange(N // 160)[:, None] * 160 - 200 + torch.arange(400)[None, :]
    j = torch.where(j < 0, -j, j)
    j = torch.where(j >= N, 2 * N - 2 - j, j)
    n = torch.arange(400, dtype=torch.float64)
    frames = x[:, j] * (0.5 - 0.5 * torch.cos(2 * math.pi * n / 400))
    power = torch.fft.rfft(frames, dim=-1).abs() ** 2  # (B, F, 201)
    audio_utils = pytest.importorskip("transformers.audio_utils")
    filters = torch.from_numpy(audio_utils.mel_filter_bank(
        num_frequency_bins=201, num_mel_filters=n_mels, min_frequency=0.0, max_frequency=8000.0,
        sampling_rate=16000, norm="slaney", mel_scale="slaney")).double()  # (201, n_mels)
    log_spec = (power @ filters).clamp(min=1e-10).log10().transpose(1, 2)
    return torch.stack([(torch.maximum(c, c.max() - 8.0) + 4.0) / 4.0 for c in log_spec])


def max_abs(x, ref) -> float:
    return (x.double().cpu() - ref.double().cpu()).abs().max().item()


SILENT = 2  # whisper_batch's silent clip


# ---------------------------------------------------------------------------------------------------------
# The public function on the device at hand (CPU: the reference; CUDA: the fused kernel)


@pytest.mark.kernels_ci
@pytest.mark.parametrize("n_mels", [80, 128])
def test_matches_transformers(lm, n_mels):
    audio = bench.whisper_batch(6, 16000 + 77, "cpu")
    out = lm.whisper_log_mel(audio.to(DEVICE), n_mels)
    assert out.shape == (6, n_mels, (16000 + 77) // 160) and out.dtype == torch.float32 and out.is_contiguous()
    assert max_abs(out, transformers_features(audio, n_mels)) <= 2e-4
    assert max_abs(out, float64_features(audio, n_mels)) <= 1e-4
    assert torch.equal(out[SILENT].cpu(), torch.full_like(out[SILENT].cpu(), -1.5))


@pytest.mark.kernels_ci
@pytest.mark.parametrize("audio_dtype", [torch.int16, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dtypes(lm, audio_dtype, out_dtype):
    audio = bench.whisper_batch(4, 3000 + 33, "cpu")
    if audio_dtype == torch.int16:
        x = (audio * 32768).round().clamp(-32768, 32767).to(torch.int16)
        as_float = x.float() / 32768
    else:
        x = audio.to(audio_dtype)
        as_float = x.float()
    out = lm.whisper_log_mel(x.to(DEVICE), 80, out_dtype=out_dtype)
    assert out.dtype == out_dtype
    ref = float64_features(as_float, 80)
    # Accumulation is fp32 throughout: one rounding to out_dtype (half an ulp of values up to 2) on top.
    ulp = {torch.float32: 0.0, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}[out_dtype]
    assert max_abs(out, ref) <= 1e-4 + ulp
    assert torch.equal(out[SILENT].float().cpu(), torch.full((80, out.shape[2]), -1.5))


@pytest.mark.kernels_ci
def test_lengths_are_zero_padding(lm):
    audio = bench.whisper_batch(5, 4000, "cpu")
    lengths = [4000, 2500, 0, 201, 3999]
    padded = audio * (torch.arange(4000)[None, :] < torch.tensor(lengths)[:, None])
    out = lm.whisper_log_mel(audio.to(DEVICE), 80, lengths=lengths)
    assert max_abs(out, float64_features(padded, 80)) <= 1e-4
    same = lm.whisper_log_mel(audio.to(DEVICE), 80, lengths=torch.tensor(lengths, dtype=torch.int32, device=DEVICE))
    assert torch.equal(out, same)
    # Values are not inspected: past N counts as N, negative as 0.
    clamped = lm.whisper_log_mel(audio.to(DEVICE), 80, lengths=[9000, 2500, -5, 201, 3999])
    assert torch.equal(out, clamped)
    assert torch.equal(out[2].cpu(), torch.full((80, 25), -1.5))


@pytest.mark.kernels_ci
@pytest.mark.parametrize(
    "call,exc,match",
    [
        (lambda m, a: m.whisper_log_mel(a.double()), TypeError, "audio must be float32, float16, bfloat16 or int16"),
        (lambda m, a: m.whisper_log_mel(a.to(torch.int32)), TypeError, "audio must be"),
        (lambda m, a: m.whisper_log_mel(a[0]), ValueError, "audio must have rank 2"),
        (lambda m, a: m.whisper_log_mel(a[:, :200]), ValueError, "N > 200"),
        (lambda m, a: m.whisper_log_mel(a, 80.0), TypeError, "n_mels must be an int"),
        (lambda m, a: m.whisper_log_mel(a, 0), ValueError, "n_mels must be >= 1"),
        (lambda m, a: m.whisper_log_mel(a, out_dtype=torch.float64), TypeError, "out_dtype must be"),
        (lambda m, a: m.whisper_log_mel(a, out_dtype="float32"), TypeError, "out_dtype must be"),
        (lambda m, a: m.whisper_log_mel(a, lengths=[1000]), ValueError, "lengths must be \\(B,\\) with B = 2"),
        (lambda m, a: m.whisper_log_mel(a, lengths=torch.tensor([1.0, 2.0])), TypeError, "lengths must be int64"),
        (lambda m, a: m.whisper_log_mel(a.requires_grad_()), ValueError, "audio requires grad"),
    ],
)
def test_bad_input_raises(lm, call, exc, match):
    audio = torch.zeros(2, 1000)
    with pytest.raises(exc, match=match):
        call(lm, audio)


@pytest.mark.kernels_ci
def test_opcheck(lm):
    audio = bench.whisper_batch(3, 2000, "cpu")
    torch.library.opcheck(lm.op.whisper_log_mel_op, (audio, torch.tensor([2000, 1500, 0]), 80, torch.float32))


# ---------------------------------------------------------------------------------------------------------
# The Triton kernel itself: interpreted on CPU, compiled on CUDA


@needs_triton
@pytest.mark.kernels_ci
@pytest.mark.parametrize("n_mels", [80, 128, 20])
def test_kernel_matches_float64(lm, waveform, n_mels):
    # 8077 samples: 50 frames, tiles at the clip's ends (reflection) and interior ones (plain loads).
    audio = bench.whisper_batch(5, 8000 + 77, "cpu")
    lengths = torch.tensor([8077, 8077, 8077, 3200, 9000])
    out = features(lm, waveform, audio.to(DEVICE), lengths.to(DEVICE), n_mels, torch.float32)
    padded = audio * (torch.arange(8077)[None, :] < lengths[:, None])
    assert max_abs(out, float64_features(padded, n_mels)) <= 1e-4
    assert torch.equal(out[SILENT].cpu(), torch.full_like(out[SILENT].cpu(), -1.5))


@needs_triton
@pytest.mark.kernels_ci
@pytest.mark.parametrize("n_mels", [80, 128])
def test_kernel_floor_in_one_launch_or_two(lm, waveform, n_mels, monkeypatch):
    """The main pass with its floor folded into its launch (floor items taken by ticket, `portable/floor.py`) gives
    the bits of the main pass and the floor pass in two launches, on speech (with silent stretches the floor
    reaches), noise, silence (exactly the floor), speech at -80 dB, speech cut short by its length, and speech with
    a NaN sample (NaN in its own clip only); and it leaves its counters at zero."""
    floor = submodule(lm, "portable.floor")
    used = []
    counters = floor.counters
    monkeypatch.setattr(floor, "counters", lambda device, B: used.append(counters(device, B)) or used[-1])
    # 6477 samples: 40 frames, tiles of 16, 16 and 8 frames, two floor items a clip.
    audio = bench.whisper_batch(6, 6477, "cpu")
    audio[5, 3000] = float("nan")
    lengths = torch.tensor([6477, 6477, 6477, 6477, 2100, 6477])
    one = features(lm, waveform, audio.to(DEVICE), lengths.to(DEVICE), n_mels, torch.float32, with_floor=True)
    two = features(lm, waveform, audio.to(DEVICE), lengths.to(DEVICE), n_mels, torch.float32)
    assert same_bits(one, two)
    padded = audio * (torch.arange(6477)[None, :] < lengths[:, None])
    assert max_abs(one[:5], float64_features(padded[:5], n_mels)) <= 1e-4
    assert torch.equal(one[SILENT].cpu(), torch.full_like(one[SILENT].cpu(), -1.5))
    assert one[5].isnan().any()
    assert len(used) == 1 and not used[0].any()


@needs_triton
@pytest.mark.kernels_ci
def test_dispatch_plans(lm):
    """`whisper_log_mel_cuda` takes either plan by name (the same bits, here on one clip of one tile), the rule's
    choice by batch size without one, and refuses an unknown name."""
    dispatch = submodule(lm, "dispatch")
    limit = dispatch.ONE_LAUNCH_MAX_CLIPS
    assert [dispatch.waveform_plan(B) for B in (1, limit, limit + 1)] == [dispatch.ONE_LAUNCH, dispatch.ONE_LAUNCH,
                                                                          dispatch.TWO_LAUNCHES]
    audio = bench.whisper_batch(1, 1677, DEVICE)
    one, two = [dispatch.whisper_log_mel_cuda(audio, None, 20, torch.float32, plan=p) for p in dispatch.WAVEFORM_PLANS]
    assert torch.equal(one, two)
    assert max_abs(one, float64_features(audio, 20)) <= 1e-4
    with pytest.raises(ValueError, match="unknown plan 'three-launch'"):
        dispatch.whisper_log_mel_cuda(audio, None, 20, torch.float32, plan="three-launch")


@pytest.mark.kernels_ci
def test_stage2_bins_cover_every_bin_once(waveform):
    bins, used = waveform.stage2_bins()
    assert sorted(bins[used].tolist()) == list(range(201))


@needs_triton
@pytest.mark.kernels_ci
def test_fragment_order_is_mma_sync_left_operand_layout(lm):
    # PTX's m16n8k16 16-bit A fragment: lane l's registers a0..a7 hold rows l // 4 (+ 8 for a2, a3, a6, a7) and
    # columns 2 (l % 4) + {0, 1} (+ 8 for a4..a7). Register pair p of every lane lies in 128 consecutive bytes.
    order = submodule(lm, "hopper.waveform").fragment_order()
    assert sorted(order.flatten().tolist()) == list(range(256))
    for p in range(4):
        for lane in range(32):
            row = lane // 4 + 8 * (p % 2)
            col = 2 * (lane % 4) + 8 * (p // 2)
            assert order[row, col] == (32 * p + lane) * 2 and order[row, col + 1] == (32 * p + lane) * 2 + 1


@needs_triton
@pytest.mark.kernels_ci
@pytest.mark.parametrize("n_mels", [80, 128, 20])
def test_chunk_plan_projects_like_the_filterbank(lm, n_mels):
    # The Gluon kernel's projection: power in (k2, k1) order times the split weights, over each band block's
    # marked chunks only, against the filterbank applied to the power in bin order.
    gluon = submodule(lm, "hopper.waveform")
    waveform = submodule(lm, "portable.waveform")
    filters = lm.mel_filters(n_mels)
    plan, projection = gluon.chunk_plan(filters)
    bins, used = waveform.stage2_bins()
    bins = bins.view(16, 16).t().reshape(-1)  # row k2 * 16 + k1
    power = torch.rand(7, 201, dtype=torch.float64) * 10.0 ** torch.randint(-8, 3, (7, 201))
    ordered = power[:, bins]  # unused rows meet zero weights
    order = gluon.fragment_order().flatten()  # [band, k1] -> offset in a chunk
    packed = projection.double().sum(dim=0)  # [block, k2, offset]
    blocks = packed.shape[0]
    weights = packed[..., order].view(blocks, 16, 16, 16).permute(1, 3, 0, 2).reshape(256, blocks * 16)
    mel = torch.zeros(7, blocks * 16, dtype=torch.float64)
    for block in range(blocks):
        for k2 in range(16):
            if (int(plan[block]) >> k2) & 1:
                rows = slice(k2 * 16, k2 * 16 + 16)
                mel[:, block * 16:block * 16 + 16] += ordered[:, rows] @ weights[rows, block * 16:block * 16 + 16]
    ref = power @ filters.double().t()
    assert torch.allclose(mel[:, :n_mels], ref, rtol=3e-5, atol=0)
    assert not mel[:, n_mels:].any()
    # A block's mask marks exactly the chunks where some of its weights are non-zero.
    for block in range(blocks):
        for k2 in range(16):
            nonzero = bool(weights[k2 * 16:k2 * 16 + 16, block * 16:block * 16 + 16].any())
            assert bool((int(plan[block]) >> k2) & 1) == nonzero


# ---------------------------------------------------------------------------------------------------------
# The Gluon kernel (its fast path's GPUs only)


@pytest.fixture(scope="module")
def gluon_waveform(lm):
    if not HAS_CUDA:
        pytest.skip("needs a CUDA device")
    if not submodule(lm, "dispatch").FAST_PATHS.compiles_for("waveform-gluon", torch.device("cuda")):
        pytest.skip("the Gluon waveform kernel does not run on this GPU or Triton")
    return submodule(lm, "hopper.waveform")


@pytest.mark.parametrize("n_mels", [80, 128, 20])
@pytest.mark.parametrize("with_floor", [False, True])
def test_gluon_kernel_matches_float64(lm, gluon_waveform, n_mels, with_floor):
    # 8077 samples: 50 frames, tiles at both clip ends; 20000: 125 frames, interior tiles (no reflection) between
    # ragged ones; a clip 3200 samples long, and one longer than the batch. The floor after the main pass, or in its
    # launch.
    for n_samples in (8077, 20000):
        audio = bench.whisper_batch(5, n_samples, "cpu")
        lengths = torch.tensor([n_samples, n_samples, n_samples, 3200, n_samples + 900])
        padded = audio * (torch.arange(n_samples)[None, :] < lengths[:, None])
        ref = float64_features(padded, n_mels)
        out = features(lm, gluon_waveform, audio.cuda(), lengths.cuda(), n_mels, torch.float32, with_floor)
        assert max_abs(out, ref) <= 1e-4
        assert torch.equal(out[SILENT].cpu(), torch.full_like(out[SILENT].cpu(), -1.5))


@pytest.mark.parametrize("audio_dtype,out_dtype", [(torch.int16, torch.bfloat16), (torch.float16, torch.float16),
                                                   (torch.bfloat16, torch.float32)])
def test_gluon_kernel_dtypes(lm, gluon_waveform, audio_dtype, out_dtype):
    audio = bench.whisper_batch(4, 16000, "cpu")
    if audio_dtype == torch.int16:
        x = (audio * 32768).round().clamp(-32768, 32767).to(torch.int16)
        exact = x.float() / 32768
    else:
        x = audio.to(audio_dtype)
        exact = x.float()
    out = features(lm, gluon_waveform, x.cuda(), None, 80, out_dtype)
    assert out.dtype == out_dtype
    ulp = 0.0 if out_dtype == torch.float32 else (2.0**-7 if out_dtype == torch.bfloat16 else 2.0**-10)
    assert max_abs(out, float64_features(exact, 80)) <= 1e-4 + ulp


def test_gluon_kernel_extreme_gains(lm, gluon_waveform):
    # Per-frame scaling keeps every gain fp32-accurate: a clip at 1e-30 of full scale is all below the 1e-10
    # clamp (silence), one at 1e30 has its mel power near 1e60, past fp32's range. A NaN sample makes its
    # clip's features NaN rather than silence.
    audio = bench.whisper_batch(4, 16000, "cpu")[:1].repeat(3, 1)
    audio[1] *= 1e-30
    audio[2] *= 1e30
    out = features(lm, gluon_waveform, audio.cuda(), None, 80, torch.float32)
    assert max_abs(out, float64_features(audio, 80)) <= 1e-4
    nan = audio[:1].clone()
    nan[0, 8000] = float("nan")
    assert torch.isnan(features(lm, gluon_waveform, nan.cuda(), None, 80, torch.float32)).any()


def test_gluon_fallback_warns_once_and_runs_triton(lm, gluon_waveform, monkeypatch):
    dispatch = submodule(lm, "dispatch")
    fast_paths = submodule(lm, "common.fast_paths")
    monkeypatch.setattr(fast_paths, "TRY_UNVERIFIED", True)

    def broken(*args, **kwargs):
        raise RuntimeError("a compile error")

    monkeypatch.setattr(gluon_waveform, "launch", broken)
    monkeypatch.setattr(dispatch.FAST_PATHS, "switched_off", {})
    audio = bench.whisper_batch(4, 4000, "cpu")
    with pytest.warns(fast_paths.FastPathFallback, match="waveform-gluon"):
        out = dispatch.whisper_log_mel_cuda(audio.cuda(), None, 80, torch.float32)
    assert max_abs(out, float64_features(audio, 80)) <= 1e-4
    assert dispatch.waveform_path(audio.cuda()) == "triton"


# ---------------------------------------------------------------------------------------------------------
# CUDA at Whisper's sizes


@needs_cuda
@pytest.mark.parametrize("n_mels", [80, 128])
def test_cuda_30s_batch_matches_transformers(lm, n_mels):
    audio = bench.whisper_batch(16, 480000, "cpu")
    out = lm.whisper_log_mel(audio.cuda(), n_mels)
    assert max_abs(out, transformers_features(audio, n_mels)) <= 2e-4
    assert torch.equal(out[SILENT].cpu(), torch.full_like(out[SILENT].cpu(), -1.5))
    pcm = (audio * 32768).round().clamp(-32768, 32767).to(torch.int16)
    out_bf16 = lm.whisper_log_mel(pcm.cuda(), n_mels, out_dtype=torch.bfloat16)
    ref = transformers_features(pcm.float() / 32768, n_mels)
    assert max_abs(out_bf16, ref) <= 2e-4 + 2.0**-7


@needs_cuda
@pytest.mark.parametrize("B", [1, 4, 17])
def test_cuda_plans_agree_on_30s_clips(lm, B):
    """On 30-s clips each main pass (the Gluon kernel where it compiles, the Triton kernel) gives the same bits with
    its floor folded into its launch as with the floor pass after it, fp32 and int16 -> bf16, at 80 and 128 mels;
    silent clips exactly the floor; every kept counter back at zero."""
    floor = submodule(lm, "portable.floor")
    mains = [submodule(lm, "portable.waveform")]
    if submodule(lm, "dispatch").FAST_PATHS.compiles_for("waveform-gluon", torch.device("cuda")):
        mains.append(submodule(lm, "hopper.waveform"))
    audio = bench.whisper_batch(B, 480000, "cuda")
    pcm = (audio * 32768).round().clamp(-32768, 32767).to(torch.int16)
    for main in mains:
        for n_mels in (80, 128):
            for x, out_dtype in ((audio, torch.float32), (pcm, torch.bfloat16)):
                one = features(lm, main, x, None, n_mels, out_dtype, with_floor=True)
                assert same_bits(one, features(lm, main, x, None, n_mels, out_dtype)), (main.__name__, n_mels)
                if B >= 4:
                    assert torch.equal(one[SILENT].float(), torch.full_like(one[SILENT].float(), -1.5))
    torch.cuda.synchronize()
    assert all(not kept.any() for kept in floor._kept_counters.values())


@needs_cuda
def test_cuda_one_launch_on_two_streams(lm):
    """Folded launches on two streams at once (each stream its own counters) give the two-launch bits, and leave
    every kept counter at zero."""
    dispatch = submodule(lm, "dispatch")
    floor = submodule(lm, "portable.floor")
    audio = [bench.whisper_batch(4, 160000, "cuda", seed=seed) for seed in (0, 1)]
    expected = [dispatch.whisper_log_mel_cuda(a, None, 80, torch.float32, plan=dispatch.TWO_LAUNCHES) for a in audio]
    streams = [torch.cuda.Stream() for _ in audio]
    for stream in streams:
        stream.wait_stream(torch.cuda.current_stream())
    outs = [[], []]
    for _ in range(20):
        for i, (a, stream) in enumerate(zip(audio, streams)):
            with torch.cuda.stream(stream):
                outs[i].append(dispatch.whisper_log_mel_cuda(a, None, 80, torch.float32, plan=dispatch.ONE_LAUNCH))
    torch.cuda.synchronize()
    assert all(torch.equal(out, expected[i]) for i in range(2) for out in outs[i])
    assert all(not kept.any() for kept in floor._kept_counters.values())


@needs_cuda
@pytest.mark.parametrize("plan", ["one-launch", "two-launch"])
def test_cuda_graphs_of_each_plan_replay_at_once(lm, plan):
    """Two graphs captured from one call, each with counters of its own (a fill node), replayed on two streams at
    once, give the eager result on new inputs."""
    dispatch = submodule(lm, "dispatch")
    x = bench.whisper_batch(4, 16000, "cuda")

    def call():
        return dispatch.whisper_log_mel_cuda(x, None, 80, torch.float32, plan=plan)

    call()
    torch.cuda.synchronize()
    graphs = [torch.cuda.CUDAGraph() for _ in range(2)]
    captured = []
    for graph in graphs:
        with torch.cuda.graph(graph):
            captured.append(call())
    x.copy_(x.flip(0))
    streams = [torch.cuda.Stream() for _ in graphs]
    for stream in streams:
        stream.wait_stream(torch.cuda.current_stream())
    for _ in range(3):
        for graph, stream in zip(graphs, streams):
            with torch.cuda.stream(stream):
                graph.replay()
    torch.cuda.synchronize()
    expected = call()
    assert all(torch.equal(out, expected) for out in captured)


# ---------------------------------------------------------------------------------------------------------
# A Whisper model on our features


@pytest.mark.parametrize("device", ["cpu", "cuda"] if HAS_CUDA else ["cpu"])
def test_tiny_whisper_logits_match_feature_extractor(lm, device):
    transformers = pytest.importorskip("transformers")
    config = transformers.WhisperConfig(
        vocab_size=128, num_mel_bins=80, d_model=64, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=128, decoder_ffn_dim=128, max_source_positions=100,
        max_target_positions=32, pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1)
    torch.manual_seed(0)
    model = transformers.WhisperForConditionalGeneration(config).eval().to(device)
    fe = transformers.WhisperFeatureExtractor(feature_size=80)
    clips = [bench.speech_like(n, seed) for n, seed in [(32000, 0), (20000, 1), (9000, 2)]]
    theirs = fe([c.numpy() for c in clips], sampling_rate=16000, return_tensors="pt", padding="max_length",
                max_length=32000).input_features
    audio = torch.zeros(3, 32000)
    for i, c in enumerate(clips):
        audio[i, : len(c)] = c
    ours = lm.whisper_log_mel(audio.to(device), 80, lengths=[len(c) for c in clips])
    assert max_abs(ours, theirs) <= 2e-4
    decoder_input_ids = torch.tensor([[1, 5, 7, 9]] * 3, device=device)
    with torch.no_grad():
        ours_logits = model(input_features=ours, decoder_input_ids=decoder_input_ids).logits
        their_logits = model(input_features=theirs.to(device), decoder_input_ids=decoder_input_ids).logits
    torch.testing.assert_close(ours_logits, their_logits, rtol=1e-4, atol=1e-4)
    assert torch.equal(ours_logits.argmax(-1), their_logits.argmax(-1))


def test_feature_extractor_swap(lm):
    """The card's two-line swap: a WhisperFeatureExtractor whose torch path is `whisper_log_mel` returns the
    features it computed itself."""
    transformers = pytest.importorskip("transformers")
    fe = transformers.WhisperFeatureExtractor(feature_size=128)
    clips = [bench.speech_like(n, seed).numpy() for n, seed in [(24000, 3), (7000, 4)]]
    theirs = fe(clips, sampling_rate=16000, return_tensors="pt", max_length=24000).input_features
    fe._torch_extract_fbank_features = lambda w, device="cpu": lm.whisper_log_mel(
        torch.from_numpy(w).view(-1, w.shape[-1]).to(DEVICE), fe.feature_size).view(
        *w.shape[:-1], fe.feature_size, -1).cpu().numpy()
    ours = fe(clips, sampling_rate=16000, return_tensors="pt", max_length=24000).input_features
    assert ours.shape == theirs.shape == (2, 128, 150)
    assert max_abs(ours, theirs) <= 2e-4


@needs_cuda
@pytest.mark.parametrize("op", ["whisper_log_mel", "log_mel_spectrogram"])
def test_runs_on_the_inputs_device(lm, op):
    """Each op on cuda:0 inside torch.cuda.device(0) and, with two GPUs, on cuda:1 while cuda:0 is current, gives
    what the CPU gives (the filterbank and DFT tables are cached per device)."""
    audio = bench.whisper_batch(3, 8000, "cpu")
    stft = torch.stft(audio, 400, 160, window=torch.hann_window(400), return_complex=True)[..., :-1]
    stft = stft.transpose(1, 2).contiguous()

    def run(device):
        if op == "whisper_log_mel":
            return lm.whisper_log_mel(audio.to(device), 80, lengths=[8000, 8000, 5000])
        return lm.log_mel_spectrogram(stft.to(device), lm.mel_filters(80).to(device))

    expected = run("cpu")
    for device in ["cuda:0"] + (["cuda:1"] if torch.cuda.device_count() >= 2 else []):
        with torch.cuda.device(0):
            out = run(device)
        assert out.device == torch.device(device)
        assert max_abs(out, expected) <= 1e-4, device
