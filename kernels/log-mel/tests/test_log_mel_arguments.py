"""whisper_log_mel's and mel_filters' arguments as users pass them: `lengths` as a tensor, a list or a numpy array
of ints, on any device with values; numpy integers for the sizes; every refusal names the argument and the
function."""

import numpy as np
import pytest
import torch

from testkit import load


@pytest.fixture(scope="module")
def lm():
    return load("log-mel")


def audio(B=2, N=1600):
    return torch.randn(B, N, generator=torch.Generator().manual_seed(0))


@pytest.mark.kernels_ci
@pytest.mark.parametrize("lengths", [[1600, 700], (1600, 700), np.array([1600, 700]), [np.int64(1600), np.int16(700)],
                                     torch.tensor([1600, 700], dtype=torch.int32)])
def test_lengths_as_users_pass_them(lm, lengths):
    x = audio()
    expected = lm.whisper_log_mel(x, 80, lengths=torch.tensor([1600, 700]))
    assert torch.equal(lm.whisper_log_mel(x, 80, lengths=lengths), expected)


@pytest.mark.kernels_ci
@pytest.mark.parametrize("lengths,match", [
    ("ab", "lengths must be a tensor or a sequence of ints, got str"),
    (1600, "lengths must be a tensor or a sequence of ints, got int"),
    ([1600, None], "lengths must hold ints, got NoneType"),
    ([1600.0, 700.0], "lengths must hold ints, got float"),
    ([True, 700], "lengths must hold ints, got bool"),
    (np.array([1.5, 2.0]), "lengths must hold ints, got float64"),
])
def test_lengths_that_are_not_ints_are_named(lm, lengths, match):
    with pytest.raises(TypeError, match=match):
        lm.whisper_log_mel(audio(), 80, lengths=lengths)


@pytest.mark.kernels_ci
def test_lengths_without_values_are_named(lm):
    with pytest.raises(ValueError, match="lengths must hold values"):
        lm.whisper_log_mel(audio(), 80, lengths=torch.empty(2, dtype=torch.int64, device="meta"))


@pytest.mark.kernels_ci
def test_numpy_sizes_give_the_int_result(lm):
    x = audio()
    assert torch.equal(lm.whisper_log_mel(x, np.int64(80)), lm.whisper_log_mel(x, 80))
    assert torch.equal(lm.mel_filters(np.int32(80), np.int64(400), np.int64(16000)), lm.mel_filters(80))


@pytest.mark.kernels_ci
def test_audio_that_requires_grad_names_whisper_log_mel(lm):
    with pytest.raises(ValueError, match="audio requires grad, but whisper_log_mel is not differentiable"):
        lm.whisper_log_mel(audio().requires_grad_(), 80)


@pytest.mark.kernels_ci
def test_stft_that_requires_grad_names_log_mel_spectrogram(lm):
    stft = torch.zeros(1, 3, 201, dtype=torch.complex64, requires_grad=True)
    with pytest.raises(ValueError, match="stft requires grad, but log_mel_spectrogram is not differentiable"):
        lm.log_mel_spectrogram(stft, lm.mel_filters(80))
