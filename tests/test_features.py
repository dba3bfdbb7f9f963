"""The front end equals faster-whisper's feature extractor exactly."""

import numpy as np
from faster_whisper.feature_extractor import FeatureExtractor

from engine.audio import load_audio
from engine.whisper.features import WINDOW_FRAMES, log_mel, windows


def test_log_mel_matches_faster_whisper(speech):
    reference = FeatureExtractor(feature_size=80)
    for name in ("fox", "long"):
        samples = load_audio(speech[name])
        assert np.array_equal(log_mel(samples, 80), reference(samples))
    noise = np.random.default_rng(0).standard_normal(16000 * 3).astype(np.float32) * 0.1
    assert np.array_equal(log_mel(noise, 80), reference(noise))


def test_windows_cover_the_clip_once(speech):
    features = log_mel(load_audio(speech["long"]), 80)
    spans = [(seek, size) for seek, size, w in windows(features)]
    assert spans[0][0] == 0 and len(spans) == 2
    assert sum(size for _, size in spans) == features.shape[-1] - 1
    for _, size, w in windows(features):
        assert w.shape == (80, WINDOW_FRAMES)
        assert np.all(w[:, size:] == 0)  # padded after normalisation
