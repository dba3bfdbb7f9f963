"""Whisper's log-mel front end, computed the way faster-whisper does it.

The mel spectrogram is computed over the whole clip and normalised by that clip's maximum; the
30-second windows are cut afterwards and padded with zeros in the normalised domain. (The
transformers feature extractor pads audio to 30 s first, which gives different text on some
clips.) The mel projection is summed in a fixed order per frame (see :func:`mel_power`), so a frame
is the same whether computed with the whole file or as a recording grows; the values equal
faster-whisper's within float32 rounding.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from engine.audio import SAMPLE_RATE

N_FFT = 400
HOP_LENGTH = 160
WINDOW_FRAMES = 3000  # 30 s at 100 frames per second
FRAMES_PER_SECOND = SAMPLE_RATE // HOP_LENGTH


@lru_cache(maxsize=4)
def mel_filters(n_mels: int, sr: int = SAMPLE_RATE, n_fft: int = N_FFT) -> np.ndarray:
    """Slaney-style mel filter bank (area-normalised triangles), shape (n_mels, n_fft // 2 + 1)."""
    fft_freqs = np.fft.rfftfreq(n=n_fft, d=1.0 / sr)
    mels = np.linspace(0.0, 45.245640471924965, n_mels + 2)  # 0 Hz .. 8 kHz on the Slaney scale
    f_sp = 200.0 / 3
    freqs = f_sp * mels
    min_log_hz = 1000.0
    min_log_mel = min_log_hz / f_sp
    logstep = np.log(6.4) / 27.0
    log_region = mels >= min_log_mel
    freqs[log_region] = min_log_hz * np.exp(logstep * (mels[log_region] - min_log_mel))
    fdiff = np.diff(freqs)
    ramps = freqs.reshape(-1, 1) - fft_freqs.reshape(1, -1)
    lower = -ramps[:-2] / fdiff[:-1, None]
    upper = ramps[2:] / fdiff[1:, None]
    weights = np.maximum(0.0, np.minimum(lower, upper))
    weights *= (2.0 / (freqs[2 : n_mels + 2] - freqs[:n_mels]))[:, None]
    return weights.astype(np.float32)


# Log-mel frames computed together (61 s): the spectrum of a two-hour recording at once would take gigabytes.
FRAMES_PER_BLOCK = 6144


def log_mel(samples: np.ndarray, n_mels: int = 80) -> np.ndarray:
    """Normalised log-mel features of a whole clip, shape (n_mels, frames)."""
    audio = _padded(np.asarray(samples, dtype=np.float32).reshape(-1))
    n_frames = 1 + (audio.size - N_FFT) // HOP_LENGTH - 1  # the last frame is left out, as Whisper does
    log_spec = np.empty((n_mels, n_frames), dtype=np.float32)
    starts = list(range(0, n_frames, FRAMES_PER_BLOCK))[: max(1, n_frames // FRAMES_PER_BLOCK)]
    for first, end in zip(starts, starts[1:] + [n_frames]):  # the last block takes the remainder
        log_spec[:, first:end] = log_mel_frames(audio, first, end - first, n_mels)
    return normalize(log_spec, float(log_spec.max()), in_place=True)


def _padded(samples: np.ndarray) -> np.ndarray:
    """The clip with faster-whisper's 160-sample tail of zeros, then reflected by N_FFT // 2 at both ends
    (as ``np.pad(..., mode="reflect")`` does), in one new array rather than two."""
    half = N_FFT // 2
    size = samples.size + HOP_LENGTH
    if size <= half:  # too short to reflect once: numpy's repeated reflection
        return np.pad(np.pad(samples, (0, HOP_LENGTH)), (half, half), mode="reflect")
    out = np.zeros(size + 2 * half, dtype=np.float32)
    out[half : half + samples.size] = samples
    out[:half] = out[2 * half : half : -1]  # the first half samples after the first, mirrored
    out[half + size :] = out[half + size - 2 : size - 2 : -1]  # the half samples before the last, mirrored
    return out


def log_mel_frames(padded: np.ndarray, first: int, count: int, n_mels: int) -> np.ndarray:
    """log10 mel power (n_mels, count) of frames ``first``.. of a signal already padded by N_FFT // 2 in
    front: frame i reads ``padded[i * HOP_LENGTH : i * HOP_LENGTH + N_FFT]``. Each frame's values depend
    on its own samples only, so a recording's frames can be computed as it grows (engine.whisper.live)."""
    base = padded[first * HOP_LENGTH:]
    frames = np.lib.stride_tricks.as_strided(base, (count, N_FFT), (HOP_LENGTH * base.strides[0], base.strides[0]))
    window = np.hanning(N_FFT + 1)[:-1].astype(np.float32)
    spectrum = np.fft.rfft(frames * window, n=N_FFT, axis=-1).astype(np.complex64).T
    power = np.abs(spectrum) ** 2
    return np.log10(np.clip(mel_power(power, n_mels), 1e-10, None))


@lru_cache(maxsize=4)
def _mel_bands(n_mels: int) -> tuple[np.ndarray, np.ndarray]:
    """Each mel band as bins [n_mels, widest] (its first bin + j) and weights [n_mels, widest] (zero past
    the band's end): the filter bank without the zeros a full matrix product multiplies through."""
    filters = mel_filters(n_mels)
    spans = [np.flatnonzero(row) for row in filters]
    first = np.array([nz[0] if nz.size else 0 for nz in spans])
    widest = max(nz[-1] - nz[0] + 1 if nz.size else 1 for nz in spans)
    wanted = first[:, None] + np.arange(widest)[None]
    bins = np.minimum(wanted, filters.shape[1] - 1)
    weights = np.where(wanted < filters.shape[1], np.take_along_axis(filters, bins, axis=1), 0)
    return bins, weights.astype(np.float32)


def mel_power(power: np.ndarray, n_mels: int) -> np.ndarray:
    """The mel filter bank applied to power spectra [bins, frames]: [n_mels, frames].

    Summed bin by bin in one fixed order with elementwise operations, so a frame's values are the same
    to the last bit whichever frames are computed with it (a BLAS matrix product's rounding depends on
    how many columns it is given): a recording's frames computed as it grows equal the saved file's.
    Equal to faster-whisper's whole-clip matrix product within float32 rounding."""
    bins, weights = _mel_bands(n_mels)
    out = np.zeros((n_mels, power.shape[1]), dtype=np.float32)
    for j in range(bins.shape[1]):
        out += weights[:, j, None] * power[bins[:, j]]
    return out


def normalize(log_spec: np.ndarray, top: float, in_place: bool = False) -> np.ndarray:
    """Whisper's scaling of log10 mel power: floored 8 (80 dB) below the clip's loudest value ``top``
    (in ``log_spec`` itself where ``in_place``, a float32 array)."""
    out = np.maximum(log_spec, np.float32(top - 8.0), out=log_spec if in_place else None).astype(np.float32, copy=False)
    out += np.float32(4.0)
    out /= np.float32(4.0)
    return out


def pad_window(features: np.ndarray, length: int = WINDOW_FRAMES) -> np.ndarray:
    if features.shape[-1] >= length:
        return features[:, :length]
    return np.pad(features, ((0, 0), (0, length - features.shape[-1])))


def windows(features: np.ndarray):
    """Yield (start_frame, n_frames, padded window) over the clip, 30 s at a time.

    The last frame is not content (it comes from the padding tail), as in faster-whisper.
    """
    content = features.shape[-1] - 1
    seek = 0
    while seek < content:
        size = min(WINDOW_FRAMES, content - seek)
        yield seek, size, pad_window(features[:, seek : seek + size])
        seek += size
