"""Decode an audio (or video) file to 16 kHz mono float32 samples."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from engine.errors import AudioError

SAMPLE_RATE = 16000


def _to_mono_16k(samples: np.ndarray, rate: int) -> np.ndarray:
    if samples.ndim == 2:
        samples = samples.mean(axis=1)
    samples = np.ascontiguousarray(samples, dtype=np.float32)
    if rate != SAMPLE_RATE:
        import soxr

        samples = soxr.resample(samples, rate, SAMPLE_RATE, quality="HQ").astype(np.float32)
    return samples


def _read_with_soundfile(path: Path) -> np.ndarray | None:
    import soundfile

    try:
        data, rate = soundfile.read(str(path), dtype="float32", always_2d=True)
    except (soundfile.LibsndfileError, RuntimeError, TypeError, ValueError):
        return None
    return _to_mono_16k(data, rate)


def _read_with_pyav(path: Path) -> np.ndarray | None:
    try:
        import av
    except ImportError:
        return None
    try:
        with av.open(str(path)) as container:
            streams = [s for s in container.streams if s.type == "audio"]
            if not streams:
                raise AudioError(f"{path.name} has no audio track.")
            resampler = av.AudioResampler(format="flt", layout="mono", rate=SAMPLE_RATE)
            chunks = []
            for frame in container.decode(streams[0]):
                for out in resampler.resample(frame):
                    chunks.append(out.to_ndarray().reshape(-1))
            for out in resampler.resample(None):
                chunks.append(out.to_ndarray().reshape(-1))
    except AudioError:
        raise
    except Exception:
        return None
    return np.concatenate(chunks).astype(np.float32) if chunks else np.zeros(0, np.float32)


def load_audio(path: str | Path) -> np.ndarray:
    """Samples at 16 kHz mono in [-1, 1]; AudioError with one clear sentence when unusable."""
    path = Path(path)
    if not path.exists():
        raise AudioError(f"{path} does not exist.")
    if path.is_dir():
        raise AudioError(f"{path} is a folder, not an audio file.")
    try:
        size = path.stat().st_size
        with open(path, "rb"):
            pass
    except OSError as exc:
        raise AudioError(f"{path.name} cannot be opened: {exc.strerror or exc}.") from exc
    if size == 0:
        raise AudioError(f"{path.name} is empty (0 bytes).")
    samples = _read_with_soundfile(path)
    if samples is None:
        samples = _read_with_pyav(path)
    if samples is None:
        raise AudioError(f"{path.name} is not an audio or video file Cadence can read.")
    if samples.size == 0:
        raise AudioError(f"{path.name} holds no audio samples.")
    if not np.all(np.isfinite(samples)):
        raise AudioError(f"{path.name} holds invalid (non-finite) samples.")
    return samples
