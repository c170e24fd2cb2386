"""The host path of the public functions: an eager call on plain CUDA tensors runs `dispatch`'s entry point without
the registered op (`common.direct_calls.calls_directly`), its argument checks skipped for a call signature that
passed them before; under torch.compile, FakeTensorMode and CUDA graph capture the functions stay correct. On the CPU
the direct route is taken by patching the decision, and runs the Triton kernels under the interpreter."""

import importlib.util
import math
from pathlib import Path

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from testkit import HAS_CUDA, load, needs_cuda, needs_triton, recorded_launches, submodule

DEVICE = "cuda" if HAS_CUDA else "cpu"
_BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "benchmark.py"
_spec = importlib.util.spec_from_file_location("log_mel_benchmark", _BENCH)
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


@pytest.fixture(scope="module")
def lm():
    return load("log-mel")


@pytest.fixture
def direct(lm, monkeypatch):
    """The op module with every call routed directly to the entry point, the registered ops refusing to run."""
    op = submodule(lm, "op")
    monkeypatch.setattr(op, "calls_directly", lambda *tensors: True)

    def refuse(*args):
        raise AssertionError("the registered op ran")

    monkeypatch.setattr(op, "whisper_log_mel_op", refuse)
    monkeypatch.setattr(op, "log_mel_spectrogram_op", refuse)
    return op


@pytest.fixture
def check_counts(lm, monkeypatch):
    """How many times each public function's argument checks ran, with the remembered signatures forgotten."""
    op = submodule(lm, "op")
    counts = {"whisper": 0, "spectrogram": 0}
    for name, key in (("check_whisper_args", "whisper"), ("check_log_mel_args", "spectrogram")):
        def counted(*args, _check=getattr(op, name), _key=key):
            counts[_key] += 1
            return _check(*args)

        monkeypatch.setattr(op, name, counted)
    monkeypatch.setattr(op, "_checked", type(op._checked)())
    return counts


def float64_features(audio: torch.Tensor, n_mels: int, mel_filters: torch.Tensor) -> torch.Tensor:
    """The front end in float64, frames gathered by index (reflect padding), rfft, the filterbank, a per-clip floor."""
    x = audio.double().cpu()
    N = x.shape[1]
    j = torch.arange(N // 160)[:, None] * 160 - 200 + torch.arange(400)[None, :]
    j = torch.where(j < 0, -j, j)
    j = torch.where(j >= N, 2 * N - 2 - j, j)
    n = torch.arange(400, dtype=torch.float64)
    power = torch.fft.rfft(x[:, j] * (0.5 - 0.5 * torch.cos(2 * math.pi * n / 400)), dim=-1).abs() ** 2
    log_spec = (power @ mel_filters.double().t()).clamp(min=1e-10).log10().transpose(1, 2)
    return torch.stack([(torch.maximum(c, c.max() - 8.0) + 4.0) / 4.0 for c in log_spec])


@needs_triton
def test_direct_route_runs_the_entry_point(lm, direct):
    """The direct route computes the features (the kernels, interpreted on the CPU), the floor included, with lengths
    as a list of ints, without the registered op."""
    audio = bench.whisper_batch(3, 1677, DEVICE)  # 10 frames; clip 2 silent
    lengths = [1677, 900, 1677]
    out = lm.whisper_log_mel(audio, 20, lengths=lengths)
    padded = audio.cpu() * (torch.arange(1677)[None, :] < torch.tensor(lengths)[:, None])
    assert out.shape == (3, 20, 10) and out.device == audio.device
    assert (out.double().cpu() - float64_features(padded, 20, lm.mel_filters(20))).abs().max() <= 1e-4
    assert torch.equal(out[2].cpu(), torch.full((20, 10), -1.5))


@needs_triton
def test_direct_route_of_log_mel_spectrogram(lm, direct):
    g = torch.Generator().manual_seed(0)
    stft = torch.randn(2, 9, 33, dtype=torch.complex64, generator=g).to(DEVICE)
    w = torch.rand(12, 33, generator=g).to(DEVICE)
    got = lm.log_mel_spectrogram(stft, w)
    ref = lm.log_mel_spectrogram_reference(stft.cpu().to(torch.complex128), w.cpu().double())
    assert (got.double().cpu() - ref).abs().max() <= 1e-5


BAD_WHISPER = [
    (lambda a: dict(audio=a.double()), TypeError, "audio must be float32, float16, bfloat16 or int16"),
    (lambda a: dict(audio=a[:, :200]), ValueError, "N > 200"),
    (lambda a: dict(audio=a, n_mels=0), ValueError, "n_mels must be >= 1"),
    (lambda a: dict(audio=a, n_mels=True), TypeError, "n_mels must be an int"),
    (lambda a: dict(audio=a, out_dtype=torch.float64), TypeError, "out_dtype must be"),
    (lambda a: dict(audio=a, lengths=torch.tensor([5])), ValueError, "lengths must be \\(B,\\) with B = 2"),
    (lambda a: dict(audio=a, lengths=torch.tensor([1.0, 2.0])), TypeError, "lengths must be int64"),
    (lambda a: dict(audio=a.clone().requires_grad_()), ValueError, "audio requires grad"),
]


@pytest.mark.kernels_ci
@pytest.mark.parametrize("bad,exc,match", BAD_WHISPER)
def test_direct_route_raises_as_the_op_does(lm, direct, bad, exc, match):
    """After a good call of the same shape (its signature remembered), a bad one still raises the checks' error."""
    audio = torch.zeros(2, 1000)
    lm.whisper_log_mel(audio.to(torch.float16), 80, lengths=torch.tensor([1000, 10]), out_dtype=torch.bfloat16)
    call = {"n_mels": 80, **bad(audio)}
    with pytest.raises(exc, match=match):
        lm.whisper_log_mel(call.pop("audio"), **call)


@pytest.mark.kernels_ci
def test_spectrogram_direct_route_raises_as_the_op_does(lm, direct):
    stft, w = torch.zeros(2, 4, 33, dtype=torch.complex64), torch.zeros(12, 33)
    lm.log_mel_spectrogram(stft, w)
    with pytest.raises(ValueError, match="NF = 33"):
        lm.log_mel_spectrogram(stft, w[:, :-1])
    with pytest.raises(TypeError, match="mel_filters must be float32"):
        lm.log_mel_spectrogram(stft, w.double())
    with pytest.raises(ValueError, match="stft requires grad"):
        lm.log_mel_spectrogram(torch.zeros(2, 4, 33, dtype=torch.complex64, requires_grad=True), w)


@pytest.mark.kernels_ci
@pytest.mark.parametrize("path", ["triton", "waveform-gluon"])
@pytest.mark.parametrize("B,lengths", [(1, None), (2, None), (2, [1677, 900])], ids=["1clip", "2clips", "lengths"])
def test_a_kept_direct_call_launches_what_the_first_call_did(lm, monkeypatch, path, B, lengths):
    """From a signature's second call on, the kept direct call (`dispatch.DIRECT_WHISPER`) launches the kernels the
    entry point launched (the main pass with its floor folded in at 1 clip, then the floor pass above), with the same
    arguments, without the entry point (CUDA's path on either main pass, taken on CPU tensors under
    `tools.host_time`'s stubs)."""
    op, dispatch = submodule(lm, "op"), submodule(lm, "dispatch")
    monkeypatch.setattr(dispatch, "waveform_path", lambda audio: path)
    entry = op.whisper_log_mel_cuda
    entered = []
    monkeypatch.setattr(op, "whisper_log_mel_cuda", lambda *args: entered.append(1) or entry(*args))
    audio = bench.whisper_batch(B, 1677, "cpu")
    if lengths is not None:
        lengths = torch.tensor(lengths)
    first, kept = recorded_launches(lm, lambda: lm.whisper_log_mel(audio, 20, lengths=lengths,
                                                                     out_dtype=torch.bfloat16))
    assert len(first) == (1 if B == 1 else 2) and kept == first and entered == [1]
    main = first[0][9:]
    assert main[0] == (torch.float32, (B, 1677)) and main[1] == (None if lengths is None else (torch.int64, (B,)))
    out = (torch.bfloat16, (B, 20, 10))
    assert out in main and (B == 1) == ((torch.int32, (1 + B,)) in main)  # the folded floor's counters
    assert not dispatch.DIRECT_WHISPER  # forgotten with the stubs


@pytest.mark.kernels_ci
def test_a_kept_spectrogram_call_launches_what_the_first_call_did(lm, monkeypatch):
    """From a signature's second call on, the kept direct call (`dispatch.DIRECT_SPECTROGRAM`) launches the four
    kernels the entry point launched (band support, chunk list, main pass, floor), with the same arguments, without
    the entry point (CUDA's path, taken on CPU tensors under `tools.host_time`'s stubs)."""
    op = submodule(lm, "op")
    entry = op.log_mel_spectrogram_cuda
    entered = []
    monkeypatch.setattr(op, "log_mel_spectrogram_cuda", lambda *args: entered.append(1) or entry(*args))
    stft, w = torch.zeros(2, 9, 33, dtype=torch.complex64), torch.zeros(12, 33)
    first, kept = recorded_launches(lm, lambda: lm.log_mel_spectrogram(stft, w))
    assert len(first) == 4 and kept == first and entered == [1]
    assert first[2][9:14] == ((torch.float32, (2, 9, 33, 2)), (torch.float32, (12, 33)), first[1][11],
                              (torch.float32, (2, 9, 12)), first[3][10])  # x, w, chunks, out, stats
    assert not submodule(lm, "dispatch").DIRECT_SPECTROGRAM


@pytest.mark.kernels_ci
def test_a_signature_seen_before_skips_the_checks(lm, check_counts):
    """Every change a check reads (dtype, shape, device, n_mels, out_dtype, lengths, grad) checks again."""
    audio = torch.zeros(2, 1000)
    calls = [
        lambda: lm.whisper_log_mel(audio, 20),
        lambda: lm.whisper_log_mel(audio.to(torch.int16), 20),
        lambda: lm.whisper_log_mel(audio[:, :900], 20),
        lambda: lm.whisper_log_mel(audio.to("meta"), 20),
        lambda: lm.whisper_log_mel(audio, 21),
        lambda: lm.whisper_log_mel(audio, 20, out_dtype=torch.float16),
        lambda: lm.whisper_log_mel(audio, 20, lengths=torch.tensor([1000, 5])),
        lambda: lm.whisper_log_mel(audio, 20, lengths=torch.tensor([1000, 5], dtype=torch.int32)),
    ]
    for i, call in enumerate(calls):
        first = call()
        assert check_counts["whisper"] == i + 1
        again = call()  # the same signature: no check
        assert check_counts["whisper"] == i + 1
        assert first.device.type == "meta" or torch.equal(first, again)
    lm.whisper_log_mel(audio, 20, lengths=[1000, 5])  # a list is checked every call (its items' types)
    lm.whisper_log_mel(audio, 20, lengths=[1000, 5])
    assert check_counts["whisper"] == len(calls) + 2
    stft, w = torch.zeros(1, 4, 33, dtype=torch.complex64), torch.zeros(12, 33)
    for _ in range(2):
        lm.log_mel_spectrogram(stft, w)
    assert check_counts["spectrogram"] == 1
    lm.log_mel_spectrogram(stft, w[:6])
    assert check_counts["spectrogram"] == 2


def test_remembered_lengths_still_reach_the_kernel(lm):
    """A remembered signature with lengths converts each call's own lengths (int32 in, int64 on the device)."""
    audio = bench.whisper_batch(2, 1600, "cpu").to(DEVICE)
    full = lm.whisper_log_mel(audio, 20, lengths=torch.tensor([1600, 1600], dtype=torch.int32))
    cut = lm.whisper_log_mel(audio, 20, lengths=torch.tensor([1600, 400], dtype=torch.int32))
    assert torch.equal(full[0], cut[0]) and not torch.equal(full[1], cut[1])


@pytest.mark.kernels_ci
def test_fake_tensor_mode(lm):
    """Fake tensors take the registered op's fake implementation: shapes and dtypes, no kernel."""
    with FakeTensorMode():
        audio = torch.empty(3, 1000)
        out = lm.whisper_log_mel(audio, 80, lengths=torch.tensor([1000, 500, 0]), out_dtype=torch.bfloat16)
        spec = lm.log_mel_spectrogram(torch.empty(3, 7, 33, dtype=torch.complex64), torch.empty(12, 33))
    assert out.shape == (3, 80, 6) and out.dtype == torch.bfloat16
    assert spec.shape == (3, 7, 12) and spec.dtype == torch.float32


def test_whisper_log_mel_under_torch_compile_fullgraph(lm):
    audio = bench.whisper_batch(2, 1600, "cpu").to(DEVICE)

    def front_end(audio):
        return lm.whisper_log_mel(audio, 20, out_dtype=torch.float32) * 2.0

    torch._dynamo.reset()
    compiled = torch.compile(front_end, fullgraph=True)
    assert torch.equal(compiled(audio), front_end(audio))


@needs_cuda
@pytest.mark.parametrize("case", ["1 clip", "16 clips", "lengths", "spectrogram"])
def test_cuda_kept_direct_calls_give_the_entry_points_results(lm, case):
    """Back-to-back kept direct calls of one signature on changing inputs (their scratch reused between them), on the
    default stream and on a side stream, give what the entry point gives on each input."""
    dispatch = submodule(lm, "dispatch")
    if case == "spectrogram":
        w = lm.mel_filters(80).cuda()
        inputs = [torch.randn(2, 300, 201, dtype=torch.complex64, device="cuda") for _ in range(3)]

        def call(x):
            return lm.log_mel_spectrogram(x, w)

        def entry(x):
            return dispatch.log_mel_spectrogram_cuda(x, w)

        kept = dispatch.DIRECT_SPECTROGRAM
    else:
        B = 1 if case == "1 clip" else 16
        lengths = torch.tensor([16000 - 500 * i for i in range(B)], device="cuda") if case == "lengths" else None
        inputs = [bench.whisper_batch(B, 16000, "cuda", seed=seed) for seed in range(3)]

        def call(x):
            return lm.whisper_log_mel(x, 80, lengths=lengths)

        def entry(x):
            return dispatch.whisper_log_mel_cuda(x, lengths, 80, torch.float32)

        kept = dispatch.DIRECT_WHISPER
    kept.clear()
    expected = [entry(x) for x in inputs]
    call(inputs[0])
    assert len(kept) == 1
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    outs = [call(x) for x in inputs * 3]
    with torch.cuda.stream(side):
        side_outs = [call(x) for x in inputs * 3]
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    assert all(torch.equal(out, expected[i % 3]) for i, out in enumerate(outs))
    assert all(torch.equal(out, expected[i % 3]) for i, out in enumerate(side_outs))


@needs_cuda
@pytest.mark.parametrize("op", ["whisper_log_mel", "log_mel_spectrogram"])
def test_cuda_graph_capture_replays_the_direct_route(lm, op):
    """A warm call captured in a CUDA graph (no host synchronisation, no allocation outside the graph's pool)
    replays to the eager result on new inputs."""
    if op == "whisper_log_mel":
        x = bench.whisper_batch(4, 16000, "cuda")

        def call(x):
            return lm.whisper_log_mel(x, 80)
    else:
        x = torch.randn(4, 100, 201, dtype=torch.complex64, device="cuda")
        w = lm.mel_filters(80).cuda()

        def call(x):
            return lm.log_mel_spectrogram(x, w)
    call(x)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = call(x)
    x.copy_(x.flip(0))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, call(x))


@needs_cuda
def test_cuda_cached_launches_repeat_the_first(lm):
    """The second call of a shape runs the kernels through their kept launchers (`common.launch`): the same bits as
    the first (through the JIT), with lengths None or a tensor, on each main pass; audio off 16-byte alignment is a
    specialization of its own."""
    launches = submodule(lm, "common.launch")
    floor = submodule(lm, "portable.floor")
    mains = [submodule(lm, "portable.waveform")]
    if submodule(lm, "dispatch").FAST_PATHS.compiles_for("waveform-gluon", torch.device("cuda")):
        mains.append(submodule(lm, "hopper.waveform"))
    audio = bench.whisper_batch(3, 16000, "cuda")
    for main in mains:
        for lengths in (None, torch.tensor([16000, 8000, 0], device="cuda")):
            for out_dtype in (torch.float32, torch.bfloat16):
                def features():
                    out, stats, block_f = main.launch(audio, lengths, 80, out_dtype)
                    floor.launch(out, stats, block_f)
                    return out

                first = features()
                assert torch.equal(features(), first), (main.__name__, lengths, out_dtype)
    kept = {key[0].kernel for key in launches._compiled}
    assert floor._floor_kernel in kept
    assert all((getattr(m, "_waveform_kernel", None) or m._waveform_gluon_kernel) in kept for m in mains)
    shifted = torch.empty(audio.numel() + 1, device="cuda")[1:].view(audio.shape).copy_(audio)
    assert shifted.data_ptr() % 16 != 0
    for _ in range(2):
        assert torch.allclose(lm.whisper_log_mel(shifted, 80), lm.whisper_log_mel(audio, 80), rtol=0, atol=1e-5)
