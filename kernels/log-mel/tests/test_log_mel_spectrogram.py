"""log-mel through `get_kernel`: the reference against the spec's code and an independent float64
computation, the per-clip floor and digital silence, Whisper's filterbank and front end, the registered op
(opcheck, torch.compile), bad input, the layer through kernelize, and the Triton kernels (under the
interpreter on CPU, for real on CUDA) at small shapes and every config the pick table names; on CUDA also every
spec shape."""

import math

import pytest
import torch
from torch import nn

from testkit import HAS_CUDA, load, needs_cuda, needs_triton, rel_err, spec, submodule

SPEC = "audio_mel_spectrogram_fused"
DEVICE = "cuda" if HAS_CUDA else "cpu"


@pytest.fixture(scope="module")
def lm():
    return load("log-mel")


# ---------------------------------------------------------------------------------------------------------
# Independent constructions (float64, written differently from the package)


def log_mel_float64(stft, mel_filters):
    """|z|^2 through complex128 abs, an einsum projection and a per-clip loop."""
    power = stft.to(torch.complex128).abs() ** 2
    log_spec = torch.einsum("bfk,mk->bfm", power, mel_filters.double()).clamp(min=1e-10).log10()
    out = torch.empty_like(log_spec)
    for b in range(log_spec.shape[0]):
        out[b] = (torch.maximum(log_spec[b], log_spec[b].max() - 8.0) + 4.0) / 4.0
    return out


def speech_stft(B, F, NF, seed=0, device="cpu"):
    """Spectral tilt and a per-frame envelope, like the spec's inputs."""
    g = torch.Generator().manual_seed(seed)
    tilt = torch.exp(-torch.arange(NF) / (NF / 3.0))
    env = 0.05 + torch.rand(B, F, 1, generator=g) ** 2
    re = torch.randn(B, F, NF, generator=g) * tilt * env
    im = torch.randn(B, F, NF, generator=g) * tilt * env
    return torch.complex(re, im).to(device)


def triangles(NM, NF, device="cpu"):
    """NM overlapping triangles over NF bins (the spec's synthetic filterbank)."""
    centres = torch.linspace(0, NF - 1, NM + 2)
    k = torch.arange(NF, dtype=torch.float32)
    lo, mid, hi = centres[:-2, None], centres[1:-1, None], centres[2:, None]
    w = torch.minimum((k - lo) / (mid - lo).clamp(min=1e-6), (hi - k) / (hi - mid).clamp(min=1e-6))
    return w.clamp(min=0.0).contiguous().to(device)


def with_silence(stft):
    """Clip 1 all digital silence, clip 2 silent from mid-clip on (Whisper's zero padding): the 80 dB
    floor bites there and only there."""
    stft = stft.clone()
    stft[1] = 0
    if stft.shape[0] > 2:
        stft[2, stft.shape[1] // 2 :] = 0
    return stft


def slaney_filterbank_float64(n_mels, n_fft, sr):
    """librosa's Slaney filterbank, element by element in Python floats."""

    def hz_to_mel(f):
        return f / (200.0 / 3) if f < 1000.0 else 15.0 + math.log(f / 1000.0) * 27.0 / math.log(6.4)

    def mel_to_hz(m):
        return m * 200.0 / 3 if m < 15.0 else 1000.0 * math.exp((m - 15.0) * math.log(6.4) / 27.0)

    top = hz_to_mel(sr / 2)
    edges = [mel_to_hz(top * i / (n_mels + 1)) for i in range(n_mels + 2)]
    rows = []
    for m in range(n_mels):
        left, centre, right = edges[m], edges[m + 1], edges[m + 2]
        row = []
        for k in range(n_fft // 2 + 1):
            f = k * sr / n_fft
            if left <= f <= centre:
                w = (f - left) / (centre - left)
            elif centre < f <= right:
                w = (right - f) / (right - centre)
            else:
                w = 0.0
            row.append(w * 2.0 / (right - left))
        rows.append(row)
    return torch.tensor(rows, dtype=torch.float64)


# ---------------------------------------------------------------------------------------------------------
# The public op on the device at hand (CPU: the eager reference; CUDA: the fused kernel)

CPU_SHAPES = [(3, 301, 201, 128), (5, 128, 65, 40), (2, 3000, 201, 128), (7, 97, 129, 80)]


@pytest.mark.kernels_ci
@pytest.mark.parametrize("shape", CPU_SHAPES)
def test_matches_spec_reference(lm, shape):
    s = spec(SPEC)
    stft, w = s.make(*shape, 0)
    out = lm.log_mel_spectrogram(stft, w)
    assert out.shape == shape[:2] + (shape[3],) and out.dtype == torch.float32 and out.device == stft.device
    assert rel_err(out, s.ref(stft, w)) < 1e-6


@pytest.mark.kernels_ci
@pytest.mark.parametrize("shape", [(3, 97, 129, 80), (4, 50, 65, 40), (3, 301, 201, 128)])
def test_matches_float64(lm, shape):
    B, F, NF, NM = shape
    stft = with_silence(speech_stft(B, F, NF, device=DEVICE))
    w = triangles(NM, NF, DEVICE)
    assert rel_err(lm.log_mel_spectrogram(stft, w), log_mel_float64(stft, w)) < 1e-6
    assert rel_err(lm.log_mel_spectrogram_reference(stft, w), log_mel_float64(stft, w)) < 1e-6


@pytest.mark.kernels_ci
def test_floor_is_per_clip(lm):
    # A loud and a quiet clip, both half silent: a per-batch (or per-frame) floor gives other values.
    stft = speech_stft(2, 80, 65, device=DEVICE)
    stft[0] *= 1e3
    stft[1] *= 1e-3
    stft[:, 40:] = 0
    w = triangles(40, 65, DEVICE)
    out = lm.log_mel_spectrogram(stft, w)
    assert rel_err(out, log_mel_float64(stft, w)) < 1e-6
    log_spec = torch.einsum("bfk,mk->bfm", stft.to(torch.complex128).abs() ** 2, w.double()).clamp(min=1e-10).log10()
    per_batch = (torch.maximum(log_spec, log_spec.max() - 8.0) + 4.0) / 4.0
    assert rel_err(out, per_batch) > 1e-2
    # The silent frames (log10 = -10) of each clip sit on that clip's floor; it bites in the loud clip only.
    floors = log_spec.amax(dim=(1, 2)) - 8.0
    assert floors[0] > -10.0 > floors[1]
    for b in range(2):
        expected = (max(floors[b].item(), -10.0) + 4.0) / 4.0
        torch.testing.assert_close(out[b, 40:].cpu(), torch.full((40, 40), expected), rtol=1e-6, atol=0)


@pytest.mark.kernels_ci
def test_digital_silence_is_exact(lm):
    stft = speech_stft(3, 64, 129, device=DEVICE)
    stft[1] = 0
    w = triangles(80, 129, DEVICE)
    out = lm.log_mel_spectrogram(stft, w)
    assert torch.isfinite(out).all()
    assert torch.equal(out[1], torch.full_like(out[1], -1.5))  # (log10(1e-10) + 4) / 4
    assert torch.equal(out[1], lm.log_mel_spectrogram_reference(stft.cpu(), w.cpu())[1].to(out.device))


def test_nan_input_is_not_silenced(lm):
    stft = speech_stft(2, 40, 65, device=DEVICE)
    stft[0, 3, 10] = float("nan")
    out = lm.log_mel_spectrogram(stft, triangles(40, 65, DEVICE))
    assert out[0, 3].isnan().any()


@pytest.mark.kernels_ci
def test_opcheck(lm):
    stft = with_silence(speech_stft(3, 23, 65))
    torch.library.opcheck(lm.op.log_mel_spectrogram_op, (stft, triangles(40, 65)))


def test_torch_compile_fullgraph(lm):
    stft, w = speech_stft(2, 40, 65, device=DEVICE), triangles(40, 65, DEVICE)

    def front_end(stft, w):
        return lm.log_mel_spectrogram(stft, w) * 2.0

    torch._dynamo.reset()
    compiled = torch.compile(front_end, fullgraph=True)
    assert torch.equal(compiled(stft, w), front_end(stft, w))


def test_noncontiguous_inputs_are_copied(lm):
    stft, w = speech_stft(2, 30, 65, device=DEVICE), triangles(40, 65, DEVICE)
    stft_t = stft.transpose(1, 2).contiguous().transpose(1, 2)
    w_t = w.t().contiguous().t()
    assert not stft_t.is_contiguous() and not w_t.is_contiguous()
    assert torch.equal(lm.log_mel_spectrogram(stft_t, w_t), lm.log_mel_spectrogram(stft, w))


BAD = [
    (lambda s, w: (s.to(torch.complex128), w), TypeError, "stft must be complex64"),
    (lambda s, w: (torch.view_as_real(s), w), TypeError, "stft must be complex64"),
    (lambda s, w: (s, w.double()), TypeError, "mel_filters must be float32"),
    (lambda s, w: (s, w.bfloat16()), TypeError, "mel_filters must be float32"),
    (lambda s, w: (s[0], w), ValueError, "stft must have rank 3"),
    (lambda s, w: (s, w[None]), ValueError, "mel_filters must have rank 2"),
    (lambda s, w: (s, w[:, :-1]), ValueError, "NF = 65"),
    (lambda s, w: (s[:, :0], w), ValueError, "every size must be >= 1"),
    (lambda s, w: (s, w[:0]), ValueError, "every size must be >= 1"),
    (lambda s, w: (s.numpy(), w), TypeError, "stft must be a torch.Tensor"),
    (lambda s, w: (s, w.tolist()), TypeError, "mel_filters must be a torch.Tensor"),
    (lambda s, w: (s.requires_grad_(), w), ValueError, "stft requires grad.*not differentiable"),
    (lambda s, w: (s, w.requires_grad_()), ValueError, "mel_filters requires grad"),
]


@pytest.mark.kernels_ci
@pytest.mark.parametrize("bad,exc,match", BAD)
def test_bad_input_raises(lm, bad, exc, match):
    stft, w = speech_stft(2, 16, 65), triangles(40, 65)
    with pytest.raises(exc, match=match):
        lm.log_mel_spectrogram(*bad(stft, w))


def test_grad_inputs_are_fine_without_grad_mode(lm):
    stft, w = speech_stft(2, 16, 65), triangles(40, 65).requires_grad_()
    with torch.no_grad():
        out = lm.log_mel_spectrogram(stft, w)
    assert not out.requires_grad


@needs_cuda
def test_inputs_on_different_devices_raise(lm):
    with pytest.raises(ValueError, match="one device"):
        lm.log_mel_spectrogram(speech_stft(1, 16, 65).cuda(), triangles(40, 65))


@pytest.mark.parametrize("device", ["cpu", "cuda"] if HAS_CUDA else ["cpu"])
def test_kernel_path(lm, device):
    assert lm.kernel_path(torch.empty(1, device=device)) == ("triton" if device == "cuda" else "reference")


# ---------------------------------------------------------------------------------------------------------
# The layer through kernelize


@pytest.mark.kernels_ci
def test_layer_through_kernelize(lm):
    from kernels import LayerRepository, Mode, kernelize, use_kernel_forward_from_hub, use_kernel_mapping

    @use_kernel_forward_from_hub("LogMelSpectrogram")
    class HostLogMel(nn.Module):
        def forward(self, stft, mel_filters):
            log_spec = (stft.abs() ** 2 @ mel_filters.t()).clamp(min=1e-10).log10()
            hi = log_spec.amax(dim=(1, 2), keepdim=True)
            return (torch.maximum(log_spec, hi - 8.0) + 4.0) / 4.0

    repo = LayerRepository("tessera/log-mel", layer_name="LogMelSpectrogram", version=1, trust_remote_code=True)
    stft, w = with_silence(speech_stft(3, 50, 129, device=DEVICE)), triangles(80, 129, DEVICE)
    host = HostLogMel()
    expected = host(stft, w)
    with use_kernel_mapping({"LogMelSpectrogram": {DEVICE: repo}}):
        model = kernelize(host, mode=Mode.INFERENCE, device=DEVICE, use_fallback=False)
    assert model.forward.__func__ is lm.layers.LogMelSpectrogram.forward
    out = model(stft, w)
    assert torch.equal(out, lm.log_mel_spectrogram(stft, w))
    assert rel_err(out, expected) < 1e-6
    with use_kernel_mapping({"LogMelSpectrogram": {DEVICE: repo}}):
        with pytest.raises(ValueError, match="does not support mode"):
            kernelize(HostLogMel(), mode=Mode.TRAINING, device=DEVICE, use_fallback=False)


# ---------------------------------------------------------------------------------------------------------
# Whisper's filterbank and front end


@pytest.mark.kernels_ci
@pytest.mark.parametrize("n_mels,n_fft,sr", [(80, 400, 16000), (128, 400, 16000), (40, 512, 22050), (64, 1024, 44100)])
def test_mel_filters_match_slaney_float64(lm, n_mels, n_fft, sr):
    w = lm.mel_filters(n_mels, n_fft, sr)
    assert w.shape == (n_mels, n_fft // 2 + 1) and w.dtype == torch.float32
    expected = slaney_filterbank_float64(n_mels, n_fft, sr)
    assert (w.double() - expected).abs().max() < 1e-6 * expected.abs().max()


@pytest.mark.kernels_ci
@pytest.mark.parametrize("n_mels", [80, 128])
def test_mel_filters_match_transformers(lm, n_mels):
    audio_utils = pytest.importorskip("transformers.audio_utils")
    theirs = audio_utils.mel_filter_bank(
        num_frequency_bins=201, num_mel_filters=n_mels, min_frequency=0.0, max_frequency=8000.0,
        sampling_rate=16000, norm="slaney", mel_scale="slaney",
    )
    assert (lm.mel_filters(n_mels) - torch.from_numpy(theirs).T.float()).abs().max() < 1e-6


def whisper_audio(B, N, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = torch.arange(N) / 16000
    audio = 0.1 * torch.randn(B, N, generator=g) + 0.5 * torch.sin(2 * math.pi * 440 * t)
    audio[1] = 0  # a silent clip
    audio[2, N // 2 :] = 0  # zero padding, as whisper pads to 30 s
    return audio


def whisper_float64(audio, n_mels):
    """torch.stft in float64, then the per-clip pipeline in float64."""
    window = torch.hann_window(400, dtype=torch.float64)
    stft = torch.stft(audio.double(), 400, 160, window=window, return_complex=True)[..., :-1]
    filters = slaney_filterbank_float64(n_mels, 400, 16000)
    return log_mel_float64(stft.transpose(1, 2), filters).transpose(1, 2)


@pytest.mark.kernels_ci
@pytest.mark.parametrize("n_mels", [80, 128])
def test_whisper_log_mel(lm, n_mels):
    audio = whisper_audio(3, 16000 + 77)
    out = lm.whisper_log_mel(audio.to(DEVICE), n_mels)
    assert out.shape == (3, n_mels, (16000 + 77) // 160) and out.is_contiguous()
    assert torch.isfinite(out).all()
    assert rel_err(out, whisper_float64(audio, n_mels)) < 1e-5


def test_whisper_log_mel_matches_transformers(lm):
    fe = pytest.importorskip("transformers").WhisperFeatureExtractor(feature_size=80)
    audio = whisper_audio(3, 8000)
    theirs = torch.from_numpy(fe._torch_extract_fbank_features(audio.numpy(), device="cpu"))
    assert rel_err(lm.whisper_log_mel(audio.to(DEVICE), 80), theirs) < 1e-5


@pytest.mark.kernels_ci
@pytest.mark.parametrize(
    "call,exc,match",
    [
        (lambda m: m.whisper_log_mel(torch.zeros(2, 16000, dtype=torch.float64)), TypeError, "audio must be"),
        (lambda m: m.whisper_log_mel(torch.zeros(16000)), ValueError, "audio must have rank 2"),
        (lambda m: m.whisper_log_mel(torch.zeros(2, 200)), ValueError, "N > 200"),
        (lambda m: m.whisper_log_mel(torch.zeros(2, 16000), 80.0), TypeError, "n_mels must be an int"),
        (lambda m: m.mel_filters(0), ValueError, "n_mels must be >= 1"),
        (lambda m: m.mel_filters(80, n_fft=1), ValueError, "n_fft must be >= 2"),
        (lambda m: m.mel_filters(80, sample_rate=16000.0), TypeError, "sample_rate must be an int"),
    ],
)
def test_whisper_bad_input_raises(lm, call, exc, match):
    with pytest.raises(exc, match=match):
        call(lm)


# ---------------------------------------------------------------------------------------------------------
# The Triton kernels themselves: interpreted on CPU, compiled on CUDA

@pytest.fixture(scope="module")
def fused(lm):
    pytest.importorskip("triton")
    return submodule(lm, "portable.stft")


def filterbank(kind, NM, NF, device):
    if kind == "triangles":
        return triangles(NM, NF, device)
    if kind == "dense":  # every weight nonzero: the support is [0, NF) everywhere
        return (torch.rand(NM, NF, generator=torch.Generator().manual_seed(1)) + 0.01).to(device)
    if kind == "empty_bands":  # rows of zeros (their bands are silent) between used ones
        w = triangles(NM, NF)
        w[::3] = 0
        return w.to(device)
    raise ValueError(kind)


@needs_triton
@pytest.mark.kernels_ci
@pytest.mark.parametrize(
    "shape,kind",
    [((3, 97, 65, 40), "triangles"), ((3, 97, 129, 80), "triangles"), ((3, 40, 129, 80), "dense"),
     ((3, 33, 65, 40), "empty_bands"), ((1, 1, 1, 1), "dense")],
)
def test_fused_small_shapes(fused, shape, kind):
    B, F, NF, NM = shape
    stft = with_silence(speech_stft(B, F, NF, device=DEVICE)) if B > 1 else speech_stft(B, F, NF, device=DEVICE)
    w = filterbank(kind, NM, NF, DEVICE)
    out = fused.launch(stft, w)
    expected = log_mel_float64(stft, w)
    assert torch.isfinite(out).all()
    assert rel_err(out, expected) < 1e-6
    if B > 1:
        assert torch.equal(out[1], torch.full_like(out[1], -1.5))


@needs_triton
def test_fused_every_picked_config(fused):
    # F = 150 leaves a ragged last tile for every block_f; NF = 201 gives multi-chunk band blocks.
    stft, w = with_silence(speech_stft(3, 150, 201, device=DEVICE)), triangles(128, 201, DEVICE)
    expected = log_mel_float64(stft, w)
    for config in [rule.config for rule in fused.PICK_TABLE]:
        assert rel_err(fused.launch(stft, w, config), expected) < 1e-6, config.name


@needs_triton
@pytest.mark.kernels_ci
def test_pick_table(fused):
    # 80 bands over 201 bins take 8-band blocks, every other shape 16-band ones; the last row takes every shape.
    assert fused.pick(208, 3000, 201, 80) == fused.pick(1, 1, 1, 1) == fused.NARROW_BANDS_CONFIG
    for shape in [(208, 3000, 201, 128), (104, 3000, 401, 80), (4, 7, 2049, 512)]:
        assert fused.pick(*shape) == fused.DEFAULT_CONFIG
    assert fused.PICK_TABLE[-1].max_nf == fused.PICK_TABLE[-1].max_nm == float("inf")
    assert fused.PICK_TABLE[-1].min_f <= 1


@needs_triton
@pytest.mark.kernels_ci
@pytest.mark.parametrize("block_m", [8, 16, 32])
@pytest.mark.parametrize("kind,NM,NF", [("triangles", 80, 201), ("dense", 40, 65), ("empty_bands", 40, 65), ("whisper", 128, 201)])
def test_band_support(lm, fused, block_m, kind, NM, NF):
    w = lm.mel_filters(NM).to(DEVICE) if kind == "whisper" else filterbank(kind, NM, NF, DEVICE)
    support = fused.band_plan(w, block_m, 16)[0].cpu()
    assert tuple(support.shape) == (2, -(-NM // block_m))
    for block, expected in enumerate(block_supports(w, block_m)):
        assert tuple(support[:, block].tolist()) == expected


def block_supports(w, block_m):
    """[lo, hi) of the used bins of each block of block_m bands ((NF, 0) for an unused block), in Python."""
    NF = w.shape[1]
    supports = []
    for rows in w.cpu().split(block_m):
        used = (rows != 0).any(dim=0).nonzero().flatten()
        supports.append((used.min().item(), used.max().item() + 1) if len(used) else (NF, 0))
    return supports


def unpack_chunk_entries(entries, bits):
    """(band block, first bin, last flag) from packed int64 entries: 21-bit fields (first bin, the block's
    hi, block), the sign bit at a block's last chunk."""
    mask = (1 << bits) - 1
    return [[(e >> 2 * bits) & mask, e & mask, int(e < 0)] for e in entries]


@needs_triton
@pytest.mark.kernels_ci
@pytest.mark.parametrize("block_m,block_k", [(8, 16), (16, 32), (8, 32)])
@pytest.mark.parametrize("kind,NM,NF", [("triangles", 80, 201), ("dense", 40, 65), ("empty_bands", 40, 65), ("whisper", 128, 201)])
def test_chunk_list(lm, fused, block_m, block_k, kind, NM, NF):
    """Every band block's [lo, hi) in BLOCK_K steps, in block order, the last step flagged; an unused block
    gets one step (its bands must still be written). Each entry also carries its block's hi."""
    w = lm.mel_filters(NM).to(DEVICE) if kind == "whisper" else filterbank(kind, NM, NF, DEVICE)
    chunks = fused.band_plan(w, block_m, block_k)[1].cpu()
    expected, his = [], []
    for block, (lo, hi) in enumerate(block_supports(w, block_m)):
        starts = list(range(lo, hi, block_k)) or [min(lo, hi)]
        expected += [[block, k0, int(k0 == starts[-1])] for k0 in starts]
        his += [hi] * len(starts)
    assert chunks[0].item() == len(expected)
    bits = fused.FIELD_BITS.value
    entries = chunks[1 : 1 + len(expected)].tolist()
    assert unpack_chunk_entries(entries, bits) == expected
    assert [(e >> bits) & ((1 << bits) - 1) for e in entries] == his


@needs_triton
@pytest.mark.parametrize("kind,NM,NF,F", [("dense", 40, 65, 70), ("empty_bands", 40, 65, 70), ("whisper", 80, 201, 70),
                                          ("triangles", 36, 65, 33), ("dense", 1, 1, 1)])
def test_fused_chunk_loop_filterbanks(lm, fused, kind, NM, NF, F):
    """Every picked config on filterbanks the picked-config test does not use: dense (several chunks a block),
    unused bands (one masked chunk), Whisper's; a ragged last tile (F = 70: the chunk loop shifts it back over its
    neighbour), clips shorter than a tile (F = 33, 1) and NM not a multiple of the band block (36: the chunk loop
    reads band NM - 1 for the missing bands). Silent clips stay exact."""
    w = lm.mel_filters(NM).to(DEVICE) if kind == "whisper" else filterbank(kind, NM, NF, DEVICE)
    stft = with_silence(speech_stft(3, F, NF, device=DEVICE))
    expected = log_mel_float64(stft, w)
    for config in [rule.config for rule in fused.PICK_TABLE]:
        out = fused.launch(stft, w, config)
        assert rel_err(out, expected) < 1e-6, config.name
        assert torch.equal(out[1], torch.full_like(out[1], -1.5)), config.name


@needs_triton
def test_fused_nan_every_picked_config(fused):
    stft = speech_stft(2, 70, 65, device=DEVICE)
    stft[0, 66, 10] = float("nan")  # in the ragged last tile
    w = triangles(40, 65, DEVICE)
    for config in [rule.config for rule in fused.PICK_TABLE]:
        out = fused.launch(stft, w, config)
        assert out[0, 66].isnan().any() and not out[1].isnan().any(), config.name


@needs_triton
def test_fused_whisper_filterbank(lm, fused):
    audio = whisper_audio(3, 16000)
    window = torch.hann_window(400)
    stft = torch.stft(audio, 400, 160, window=window, return_complex=True)[..., :-1].transpose(1, 2).contiguous()
    for n_mels in (80, 128):
        w = lm.mel_filters(n_mels)
        out = fused.launch(stft.to(DEVICE), w.to(DEVICE))
        assert rel_err(out, log_mel_float64(stft, w)) < 1e-6


# ---------------------------------------------------------------------------------------------------------
# CUDA at the spec's shapes (1.3-1.6 GiB inputs at the measure shapes)


def _spec_shapes():
    try:
        s = spec(SPEC)
    except pytest.skip.Exception:
        return []
    return [("correct", x) for x in s.correct_shapes] + [("measure", x) for x in s.measure_shapes]


@needs_cuda
@pytest.mark.parametrize("kind,shape", _spec_shapes())
def test_cuda_spec_shapes(lm, fused, kind, shape):
    s = spec(SPEC)
    stft, w = s.make(*shape, 0)
    out = fused.launch(stft, w)
    assert torch.isfinite(out).all()
    assert rel_err(out, s.ref(stft, w)) < 1e-4
    del stft, w, out
    torch.cuda.empty_cache()


def _every_config_shapes():
    try:
        s = spec(SPEC)
    except pytest.skip.Exception:
        return []
    return list(s.correct_shapes) + [x for x in s.measure_shapes if x in ((208, 3000, 201, 128), (104, 3000, 401, 80))]


@needs_cuda
@pytest.mark.parametrize("shape", _every_config_shapes())
def test_cuda_every_picked_config(fused, shape):
    """Every config the pick table names, at the spec's correct shapes and the two sweep measure shapes."""
    s = spec(SPEC)
    stft, w = s.make(*shape, 0)
    ref = s.ref(stft, w).double()
    ref_norm = ref.norm()
    for config in [rule.config for rule in fused.PICK_TABLE]:
        out = fused.launch(stft, w, config)
        assert torch.isfinite(out).all(), config.name
        # On the device: a CPU copy of each 80M-element output would dominate the test.
        assert ((out.double() - ref).norm() / ref_norm).item() < 1e-4, config.name
        del out
    del stft, w, ref
    torch.cuda.empty_cache()


@needs_cuda
@pytest.mark.parametrize("shape", [(512, 1500, 201, 128), (208, 3000, 201, 128)])
def test_cuda_large_batch_with_silence(lm, shape):
    s = spec(SPEC)
    stft, w = s.make(*shape, 1)
    stft[::7] = 0  # silent clips
    stft[3::7, shape[1] // 3 :] = 0  # clips that end in silence: the floor bites on part of them
    out = lm.log_mel_spectrogram(stft, w)
    assert torch.isfinite(out).all()
    assert rel_err(out, s.ref(stft, w)) < 1e-4
    assert torch.equal(out[::7], torch.full_like(out[::7], -1.5))
    del stft, w, out
    torch.cuda.empty_cache()
