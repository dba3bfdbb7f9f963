"""The front end equals faster-whisper's feature extractor exactly."""

import tracemalloc

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


def test_a_long_recording_is_computed_in_blocks_equal_to_one_product_and_in_little_memory():
    """Ten minutes of noise: equal to faster-whisper's single whole-clip computation to the last bit
    (block edges line up with the matrix product's tiles), while the memory the features take beyond
    the padded clip and the features is a few blocks' worth (all at once, the spectrum took eight times the clip)."""
    noise = np.random.default_rng(1).standard_normal(16000 * 600 + 7).astype(np.float32) * 0.1
    assert np.array_equal(log_mel(noise, 80), FeatureExtractor(feature_size=80)(noise))
    tracemalloc.start()
    try:
        features = log_mel(noise, 80)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < noise.nbytes + features.nbytes + 128 * 2**20, peak  # blocks: about 100 MB however long
