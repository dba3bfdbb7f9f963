"""Whisper's log-mel features of 10 minutes of speech: Cadence's (engine/whisper/features.py, each
frame summed in a fixed order so it is bit-equal however frames are grouped) against faster-whisper's
FeatureExtractor, on the same samples, in one run; and the largest difference between the two.

    .venv/bin/python bench/features.py [MINUTES]

Threads: PyTorch's default (the machine's cores). Best of 3 for each.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import speech_samples  # noqa: E402
from bench.cpu import cpu_model  # noqa: E402


def best_of(fn, runs: int = 3) -> tuple[float, np.ndarray]:
    times, out = [], None
    for _ in range(runs):
        start = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - start)
    return min(times), out


def main() -> None:
    import torch
    from faster_whisper.feature_extractor import FeatureExtractor

    from engine.whisper.features import log_mel

    minutes = float(sys.argv[1]) if len(sys.argv) > 1 else 10.0
    print(f"# CPU: {cpu_model()}; torch {torch.__version__}, {torch.get_num_threads()} threads", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        one = np.concatenate(speech_samples(Path(tmp), 4))
    samples = np.tile(one, int(np.ceil(minutes * 60 * 16000 / one.size)))[: int(minutes * 60 * 16000)]
    ours_s, ours = best_of(lambda: log_mel(samples))
    theirs_s, theirs = best_of(lambda: FeatureExtractor()(samples))
    frames = min(ours.shape[1], theirs.shape[1])
    gap = float(np.abs(ours[:, :frames] - theirs[:, :frames]).max())
    print(f"{minutes:g} min of speech, {frames} frames: Cadence {ours_s:.2f} s, faster-whisper {theirs_s:.2f} s "
          f"({theirs_s / ours_s:.2f}x); largest difference {gap:.1e}")


if __name__ == "__main__":
    main()
