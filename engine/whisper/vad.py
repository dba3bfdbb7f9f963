"""Voice activity: where a recording has speech, and 30-second windows cut at its pauses.

The speech detector is Silero VAD v6 (16 kHz), the ONNX export its ``silero-vad`` package ships
for whole sequences, run with onnxruntime on one thread. The package itself is never imported
(importing it sets PyTorch to one thread for the whole process); only its model file is read.
The model gives one probability per 512-sample chunk (32 ms), each chunk seen with the 64 samples
before it, read in blocks of about two minutes with the LSTM's state carried from one to the next.

Windows: speech regions (hysteresis on the probabilities, as Silero's own rules) are padded a
little, then joined into windows of at most 30 s that start and end in pauses; a region longer
than 30 s (speech with no pause the model calls one) is cut at its quietest chunk late in the
window, leaving at least a second after the cut. Decoding such windows rarely cuts a word (fixed
30-s windows cut through words and sentences), and long stretches of silence are not decoded.
"""

from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from engine.errors import CadenceError

SAMPLE_RATE = 16000
CHUNK = 512  # samples per probability (32 ms)
CONTEXT = 64  # samples of the previous chunk each chunk sees
FRAME = 160  # samples per Whisper feature frame (10 ms); window edges fall on frames
MODEL_FILE = "silero_vad_16k_sequence.onnx"
BLOCK = 4096  # chunks per call (about 2 minutes): memory stays small however long the recording


@dataclass(frozen=True)
class VadOptions:
    threshold: float = 0.5  # a chunk at or above this starts speech ...
    neg_threshold: float = 0.35  # ... and speech ends after chunks below this
    min_silence_ms: int = 100  # a pause shorter than this does not end a region
    min_speech_ms: int = 250  # shorter regions are dropped (clicks, breaths)
    pad_ms: int = 200  # each region widened this much on both sides (at most half the pause)
    max_window_s: float = 30.0  # Whisper's window
    cut_search_s: float = 10.0  # an over-long region is cut at its quietest chunk in its last this-many seconds
    min_piece_s: float = 1.0  # ... leaving at least this much of the region after the cut

    def __post_init__(self):
        if not 0 < self.min_piece_s < self.cut_search_s < self.max_window_s:
            raise ValueError("VadOptions needs 0 < min_piece_s < cut_search_s < max_window_s")


def model_path() -> Path:
    """The Silero model file inside the installed ``silero-vad`` package (found without importing it)."""
    spec = importlib.util.find_spec("silero_vad")
    if spec is None or not spec.submodule_search_locations:
        raise CadenceError("Voice activity detection needs the silero-vad package (run `make setup`).")
    path = Path(list(spec.submodule_search_locations)[0]) / "data" / MODEL_FILE
    if not path.is_file():
        raise CadenceError(f"The silero-vad package has no {MODEL_FILE}; reinstall it with `make setup`.")
    return path


class SileroVad:
    """Speech probability per 32-ms chunk of 16-kHz mono audio."""

    def __init__(self, path: str | Path | None = None):
        try:
            import onnxruntime
        except ImportError:
            raise CadenceError("Voice activity detection needs onnxruntime (run `make setup`).") from None
        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads = 1  # the reader thread's share; PyTorch keeps the cores
        options.inter_op_num_threads = 1
        options.log_severity_level = 3
        self.session = onnxruntime.InferenceSession(str(path or model_path()), sess_options=options,
                                                    providers=["CPUExecutionProvider"])

    def __call__(self, samples: np.ndarray) -> np.ndarray:
        """Probabilities [ceil(len / CHUNK)] (the tail is padded with zeros to a whole chunk)."""
        audio = np.asarray(samples, dtype=np.float32).reshape(-1)
        n_chunks = -(-audio.size // CHUNK)
        if n_chunks == 0:
            return np.zeros(0, dtype=np.float32)
        state = self.initial_state()
        out = []
        for start in range(0, n_chunks, BLOCK):  # a block at a time, the LSTM state carried over; only
            piece = audio[start * CHUNK : (start + BLOCK) * CHUNK]  # the block is copied, not the recording
            chunks = np.pad(piece, (0, (-piece.size) % CHUNK)).reshape(-1, CHUNK)
            before = audio[start * CHUNK - CONTEXT : start * CHUNK] if start else np.zeros(CONTEXT, np.float32)
            context = np.concatenate([before[None], chunks[:-1, -CONTEXT:]])
            probs, state = self.block(chunks, context, state)
            out.append(probs)
        return np.concatenate(out)

    @staticmethod
    def initial_state() -> tuple[np.ndarray, np.ndarray]:
        return np.zeros((1, 1, 128), np.float32), np.zeros((1, 1, 128), np.float32)

    def block(self, chunks: np.ndarray, context: np.ndarray, state) -> tuple[np.ndarray, tuple]:
        """Probabilities of up to BLOCK chunks [n, CHUNK], each with the CONTEXT samples before it, from
        the LSTM ``state`` after the chunks before them; and the state after them."""
        probs, h, c = self.session.run(None, {"input": np.concatenate([context, chunks], 1), "h": state[0],
                                              "c": state[1]})
        return np.asarray(probs, dtype=np.float32).reshape(-1), (h, c)


_MODEL: SileroVad | None = None


def detector() -> SileroVad:
    global _MODEL
    if _MODEL is None:
        _MODEL = SileroVad()
    return _MODEL


def speech_probabilities(samples: np.ndarray) -> np.ndarray:
    return detector()(samples)


def speech_regions(probs: np.ndarray, n_samples: int, opts: VadOptions = VadOptions()) -> list[tuple[int, int]]:
    """[(start, end)] sample ranges of speech, padded, in order, not overlapping."""
    ms = CHUNK * 1000 / SAMPLE_RATE
    min_silence = max(1, math.ceil(opts.min_silence_ms / ms))  # a pause this long or longer ends speech
    regions, start, quiet_since = [], None, None
    for i, p in enumerate(probs):
        if start is None:
            if p >= opts.threshold:
                start, quiet_since = i, None
            continue
        if p >= opts.threshold:
            quiet_since = None
        elif p < opts.neg_threshold:
            quiet_since = i if quiet_since is None else quiet_since
            if i - quiet_since + 1 >= min_silence:
                regions.append((start, quiet_since))
                start, quiet_since = None, None
    if start is not None:
        regions.append((start, len(probs)))
    min_chunks = opts.min_speech_ms / ms
    regions = [(s * CHUNK, min(e * CHUNK, n_samples)) for s, e in regions if e - s >= min_chunks]
    pad = opts.pad_ms * SAMPLE_RATE // 1000
    padded = []
    for k, (s, e) in enumerate(regions):
        before = pad if k == 0 else min(pad, (s - regions[k - 1][1]) // 2)
        after = pad if k == len(regions) - 1 else min(pad, (regions[k + 1][0] - e) // 2)
        padded.append((max(0, s - before), min(n_samples, e + after)))
    return padded


def _cut(probs: np.ndarray, start: int, end: int, limit: int, search: int, min_piece: int) -> int:
    """Where to end a window that starts at sample ``start`` inside a region [start, end) longer than
    allowed: the quietest chunk (the latest of equals) among the last ``search`` samples before
    ``start + limit``, but not within ``min_piece`` of the region's end (its fading tail would be
    left as a window of its own)."""
    lo = (start + limit - search) // CHUNK + 1
    hi = min(start + limit, end - min_piece) // CHUNK
    if hi <= lo:
        return start + limit
    k = hi - 1 - int(np.argmin(probs[lo:hi][::-1]))
    return k * CHUNK


def vad_windows(probs: np.ndarray, n_samples: int, opts: VadOptions = VadOptions()) -> list[tuple[int, int]]:
    """[(first frame, frames)] of windows of at most ``max_window_s`` covering the speech, cut in pauses."""
    limit = int(opts.max_window_s * SAMPLE_RATE)
    search = int(opts.cut_search_s * SAMPLE_RATE)
    min_piece = int(opts.min_piece_s * SAMPLE_RATE)
    pieces = []  # speech regions, the over-long ones cut into pieces that fit a window
    pad = opts.pad_ms * SAMPLE_RATE // 1000
    for s, e in speech_regions(probs, n_samples, opts):
        if limit < e - s <= limit + 2 * pad:  # over only by its padding: pad less instead of cutting
            s += (e - s - limit) // 2
            e = s + limit
        while e - s > limit:
            cut = _cut(probs, s, e, limit, search, min_piece)
            pieces.append((s, cut))
            s = cut
        pieces.append((s, e))
    windows: list[list[int]] = []
    for s, e in pieces:
        if windows and e - windows[-1][0] <= limit:
            windows[-1][1] = e  # this piece fits in the open window, with the pause before it
        else:
            windows.append([s, e])
    out = []
    for s, e in windows:  # to feature frames, rounded alike, so a cut between two windows is one frame
        first, last = round(s / FRAME), round(e / FRAME)
        out.append((first, min(last, first + limit // FRAME) - first))
    return out
