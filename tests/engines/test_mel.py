"""Log-mel front end equals transformers' WhisperFeatureExtractor (80 and 128 mels)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch

from realtime.engines.mel import LogMel, MelConfig, mel_filters, pad_or_trim

ARCTIC = Path(__file__).resolve().parents[1] / "assets" / "arctic_a0009.wav"


@pytest.mark.parametrize("n_mels", [80, 128])
def test_filterbank_equals_transformers(n_mels):
    from transformers.audio_utils import mel_filter_bank

    ref = mel_filter_bank(num_frequency_bins=201, num_mel_filters=n_mels, min_frequency=0.0,
                          max_frequency=8000.0, sampling_rate=16000, norm="slaney", mel_scale="slaney")
    ours = mel_filters(n_mels, 400, 16000, 0.0, 8000.0).numpy().T
    np.testing.assert_allclose(ours, ref, atol=1e-9, rtol=1e-7)


@pytest.mark.parametrize("n_mels", [80, 128])
def test_log_mel_equals_whisper_feature_extractor(n_mels):
    from transformers import WhisperFeatureExtractor

    speech, sr = sf.read(ARCTIC, dtype="float32")
    g = np.random.default_rng(0)
    noise = (0.1 * g.standard_normal(16000 * 5)).astype(np.float32)
    fe = WhisperFeatureExtractor(feature_size=n_mels)
    ref = fe([speech, noise], sampling_rate=16000, return_tensors="np").input_features
    mel = LogMel(MelConfig(n_mels=n_mels))
    batch = torch.zeros(2, 16000 * 30)
    batch[0, : len(speech)] = torch.from_numpy(speech)
    batch[1, : len(noise)] = torch.from_numpy(noise)
    ours = mel(pad_or_trim(batch, mel.cfg.n_samples)).numpy()
    assert ours.shape == ref.shape == (2, n_mels, 3000)
    np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=0)


def test_pad_or_trim():
    x = torch.ones(2, 10)
    assert pad_or_trim(x, 4).shape == (2, 4)
    y = pad_or_trim(x, 12)
    assert y.shape == (2, 12) and y[:, 10:].abs().sum() == 0
