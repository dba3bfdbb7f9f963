"""Transcribe one file or clip: audio -> log-mel -> 30-second windows -> text segments."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from engine.audio import SAMPLE_RATE, load_audio
from engine.errors import CadenceError, RequestError
from engine.loading import LoadedModel
from engine.whisper_features import FRAMES_PER_SECOND, WINDOW_FRAMES, log_mel, pad_window, windows
from engine.transcript import Segment, Transcript
from engine.whisper_reference import WhisperReference

NO_SPEECH_THRESHOLD = 0.6  # skip a window the model calls silent ...
LOGPROB_THRESHOLD = -1.0  # ... unless its words were confident anyway (faster-whisper's defaults)


def transcribe_samples(
    decoder: WhisperReference,
    samples: np.ndarray,
    language: str | None = None,
    task: str = "transcribe",
    name: str = "",
) -> Transcript:
    """Greedy, no timestamps, each window decoded on its own (no previous-text conditioning)."""
    tok = decoder.tok
    if task not in ("transcribe", "translate"):
        raise RequestError(f"Unknown task '{task}' (use transcribe or translate).")
    if not tok.multilingual:
        if language not in (None, "en"):
            raise RequestError(f"{decoder.loaded.source.name} is English-only; it cannot transcribe '{language}'.")
        if task == "translate":
            raise RequestError(f"{decoder.loaded.source.name} is English-only; it cannot translate.")
        language = "en"
    elif language is not None and language not in tok.languages:
        raise RequestError(f"Unknown language code '{language}'.")

    t0 = time.perf_counter()
    n_mels = decoder.model.config.num_mel_bins
    features = log_mel(samples, n_mels)
    duration = samples.size / SAMPLE_RATE
    if language is None:
        language, _ = decoder.detect_language(decoder.encode(pad_window(features[:, :WINDOW_FRAMES])))
    prompt = tok.sot_sequence(language, task) + [tok.no_timestamps]

    segments: list[Segment] = []
    n_tokens = 0
    for seek, size, window in windows(features):
        result = decoder.decode(decoder.encode(window), prompt)
        n_tokens += len(result.tokens)
        if result.no_speech_prob > NO_SPEECH_THRESHOLD and result.avg_logprob <= LOGPROB_THRESHOLD:
            continue
        text = tok.decode(result.tokens).strip()
        if not text:
            continue
        start = seek / FRAMES_PER_SECOND
        end = min((seek + size) / FRAMES_PER_SECOND, duration)
        segments.append(Segment(start, end, text, result.tokens))
    seconds = time.perf_counter() - t0
    return Transcript(
        file=name,
        text=" ".join(s.text for s in segments),
        language=language,
        duration=duration,
        segments=segments,
        stats={
            "tokens": n_tokens,
            "seconds": round(seconds, 3),
            "tok_s": round(n_tokens / seconds, 1) if seconds > 0 else 0.0,
            "realtime_factor": round(duration / seconds, 1) if seconds > 0 else 0.0,
        },
    )


def transcribe_file(decoder: WhisperReference, path: str | Path, language=None, task="transcribe") -> Transcript:
    samples = load_audio(path)
    if samples.size < SAMPLE_RATE // 10:
        raise CadenceError(f"{Path(path).name} is too short to transcribe ({samples.size / SAMPLE_RATE:.2f} s).")
    return transcribe_samples(decoder, samples, language, task, name=str(path))
