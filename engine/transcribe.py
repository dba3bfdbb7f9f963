"""Transcribe one file or clip: audio -> log-mel -> 30-second windows -> text segments.

The plan (language, prompt, windows) and the assembly of window results into a transcript are
shared by the reference path and the batched engine (:func:`start_transcription`: one sequence
per 30-second window, all queued at once, so windows of one long file and of many files share
the slots), so both apply the same rules.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from engine.audio import SAMPLE_RATE, load_audio
from engine.errors import CadenceError, RequestError
from engine.models import WHISPER
from engine.scheduler import Sequence
from engine.transcript import Segment, Transcript
from engine.whisper_features import FRAMES_PER_SECOND, WINDOW_FRAMES, log_mel, pad_window, windows
from engine.whisper_reference import WhisperReference, WindowResult
from engine.whisper_tokens import WhisperTokenizer

NO_SPEECH_THRESHOLD = 0.6  # skip a window the model calls silent ...
LOGPROB_THRESHOLD = -1.0  # ... unless its words were confident anyway (faster-whisper's defaults)


@dataclass
class TranscriptionPlan:
    """What is decided before decoding: the language, the prompt and the 30-second windows."""

    name: str
    language: str
    prompt: list[int]
    duration: float
    spans: list[tuple[int, int, np.ndarray]]  # (first frame, frames of content, padded window)
    started: float


def check_language(tok: WhisperTokenizer, model_name: str, language: str | None, task: str) -> str | None:
    """The language to decode in (None: detect it), or RequestError for an impossible request."""
    if task not in ("transcribe", "translate"):
        raise RequestError(f"Unknown task '{task}' (use transcribe or translate).")
    if not tok.multilingual:
        if language not in (None, "en"):
            raise RequestError(f"{model_name} is English-only; it cannot transcribe '{language}'.")
        if task == "translate":
            raise RequestError(f"{model_name} is English-only; it cannot translate.")
        return "en"
    if language is not None and language not in tok.languages:
        raise RequestError(f"Unknown language code '{language}'.")
    return language


def plan_transcription(decoder: WhisperReference, samples: np.ndarray, language: str | None = None,
                       task: str = "transcribe", name: str = "audio") -> TranscriptionPlan:
    tok = decoder.tok
    language = check_language(tok, decoder.loaded.source.name, language, task)
    if samples.size < SAMPLE_RATE // 10:
        raise CadenceError(f"{Path(name).name} is too short to transcribe ({samples.size / SAMPLE_RATE:.2f} s).")
    started = time.perf_counter()
    features = log_mel(samples, decoder.model.config.num_mel_bins)
    if language is None:
        language, _ = decoder.detect_language(decoder.encode(pad_window(features[:, :WINDOW_FRAMES])))
    prompt = tok.sot_sequence(language, task) + [tok.no_timestamps]
    return TranscriptionPlan(name, language, prompt, samples.size / SAMPLE_RATE, list(windows(features)), started)


def assemble_transcript(plan: TranscriptionPlan, tok: WhisperTokenizer, results: list[WindowResult]) -> Transcript:
    """Window results, in window order, into segments; silent windows are skipped."""
    segments: list[Segment] = []
    for (seek, size, _), result in zip(plan.spans, results):
        if result.no_speech_prob > NO_SPEECH_THRESHOLD and result.avg_logprob <= LOGPROB_THRESHOLD:
            continue
        text = tok.decode(result.tokens).strip()
        if text:
            end = min((seek + size) / FRAMES_PER_SECOND, plan.duration)
            segments.append(Segment(seek / FRAMES_PER_SECOND, end, text, list(result.tokens)))
    n_tokens = sum(len(r.tokens) for r in results)
    seconds = time.perf_counter() - plan.started
    return Transcript(
        file=plan.name,
        text=" ".join(s.text for s in segments),
        language=plan.language,
        duration=plan.duration,
        segments=segments,
        stats={
            "tokens": n_tokens,
            "seconds": round(seconds, 3),
            "tok_s": round(n_tokens / seconds, 1) if seconds > 0 else 0.0,
            "realtime_factor": round(plan.duration / seconds, 1) if seconds > 0 else 0.0,
        },
    )


def transcribe_samples(decoder: WhisperReference, samples: np.ndarray, language: str | None = None,
                       task: str = "transcribe", name: str = "audio") -> Transcript:
    """Greedy, no timestamps, each window decoded on its own (no previous-text conditioning)."""
    plan = plan_transcription(decoder, samples, language, task, name)
    results = [decoder.decode(decoder.encode(window), plan.prompt) for _, _, window in plan.spans]
    return assemble_transcript(plan, decoder.tok, results)


def transcribe_file(decoder: WhisperReference, path: str | Path, language=None, task="transcribe") -> Transcript:
    return transcribe_samples(decoder, load_audio(path), language, task, name=str(path))


def start_transcription(engine, handle) -> list[Sequence]:
    from engine.engine import Event

    req = handle.request
    lane = engine.lane(req.model, WHISPER)
    ref = engine.reference(req.model)
    decoder = lane.decoder
    name = str(req.audio) if not isinstance(req.audio, np.ndarray) else (req.name or "audio")
    samples = req.audio if isinstance(req.audio, np.ndarray) else load_audio(req.audio)
    plan = plan_transcription(ref, samples, req.language, req.task, req.name or name)
    results: dict[int, WindowResult] = {}
    handle._emit(Event("started", handle.id, total=len(plan.spans)))

    def prepare(seq, slot):  # on joining a slot: encode this window into the slot's cross-attention memory,
        # one encoder layer per step while other slots decode (a generator the lane advances)
        window = torch.from_numpy(plan.spans[seq.index][2])[None].to(decoder.device, decoder.cross_k.dtype)
        encoded = yield from decoder.encode_in_steps(window)
        decoder.set_memory(slot, encoded[0])

    def on_finish(seq):
        if handle._final is not None:  # the request already failed or was cancelled
            return
        if seq.finish_reason == "cancelled":
            handle._emit(Event("failed", handle.id, message=f"{plan.name}: transcription was cancelled."))
            return
        results[seq.index] = WindowResult(seq.tokens, ref.no_speech_probability(seq.probe_logits),
                                          seq.logprob_sum / (len(seq.tokens) + 1))
        handle._emit(Event("progress", handle.id, done=len(results), total=len(plan.spans),
                           text=ref.tok.decode(seq.tokens).strip()))
        if len(results) == len(plan.spans):
            ordered = [results[i] for i in range(len(plan.spans))]
            handle._emit(Event("finished", handle.id, result=assemble_transcript(plan, ref.tok, ordered)))

    seqs = []
    for index in range(len(plan.spans)):
        seq = Sequence(list(plan.prompt), decoder.max_len - len(plan.prompt), {ref.tok.eot},
                       suppress=ref.suppress, begin_suppress=ref.begin_suppress, prepare=prepare,
                       on_finish=on_finish, probe_row=plan.prompt.index(ref.tok.sot), track_logprob=True,
                       handle=handle, index=index)
        lane.add(seq)
        seqs.append(seq)
    return seqs
