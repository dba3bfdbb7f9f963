"""The front end equals faster-whisper's feature extractor (within float32 rounding: the mel projection is
summed in a fixed order per frame), and a frame is the same to the last bit however frames are grouped."""

import tracemalloc

import numpy as np
from faster_whisper.feature_extractor import FeatureExtractor

from engine.audio import load_audio
from engine.whisper.features import WINDOW_FRAMES, _padded, log_mel, log_mel_frames, windows

ROUNDING = 2.5e-7  # two float32 steps at the features' largest values (about 1.5)


def _close(ours, theirs) -> bool:
    return ours.shape == theirs.shape and float(np.abs(ours - theirs).max()) <= ROUNDING


def test_log_mel_matches_faster_whisper(speech):
    reference = FeatureExtractor(feature_size=80)
    for name in ("fox", "long"):
        samples = load_audio(speech[name])
        assert _close(log_mel(samples, 80), reference(samples))
    noise = np.random.default_rng(0).standard_normal(16000 * 3).astype(np.float32) * 0.1
    assert _close(log_mel(noise, 80), reference(noise))


def test_windows_cover_the_clip_once(speech):
    features = log_mel(load_audio(speech["long"]), 80)
    spans = [(seek, size) for seek, size, w in windows(features)]
    assert spans[0][0] == 0 and len(spans) == 2
    assert sum(size for _, size in spans) == features.shape[-1] - 1
    for _, size, w in windows(features):
        assert w.shape == (80, WINDOW_FRAMES)
        assert np.all(w[:, size:] == 0)  # padded after normalisation


def test_a_long_recording_is_computed_in_blocks_equal_to_one_product_and_in_little_memory():
    """Ten minutes of noise: equal to faster-whisper's single whole-clip computation, while the memory the
    features take beyond the padded clip and the features is a few blocks' worth (all at once, the
    spectrum took eight times the clip)."""
    noise = np.random.default_rng(1).standard_normal(16000 * 600 + 7).astype(np.float32) * 0.1
    assert _close(log_mel(noise, 80), FeatureExtractor(feature_size=80)(noise))
    tracemalloc.start()
    try:
        features = log_mel(noise, 80)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < noise.nbytes + features.nbytes + 128 * 2**20, peak  # blocks: about 100 MB however long


def test_a_frame_is_the_same_however_the_frames_are_grouped(speech):
    """A recording's frames are computed a few at a time as it grows (engine.whisper.live) and the saved
    file's all together: each frame must come out the same to the last bit (a BLAS product's rounding
    depends on how many frames it is given, which broke this before)."""
    for n_mels in (80, 128):
        audio = _padded(load_audio(speech["fox"]))
        count = 1 + (audio.size - 400) // 160 - 1
        whole = log_mel_frames(audio, 0, count, n_mels)
        for group in (1, 7, 50, 64, 333):
            parts = [log_mel_frames(audio, first, min(group, count - first), n_mels) for first in range(0, count, group)]
            assert np.array_equal(np.concatenate(parts, axis=1), whole), (n_mels, group)
