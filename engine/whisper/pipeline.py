"""Transcribe one file or clip: audio -> log-mel -> 30-second windows -> text segments.

The plan (language, prompt, windows) and the assembly of window results into a transcript are
shared by the reference path here and the batched engine (:class:`engine.whisper.run.TranscriptionRun`:
one sequence per window, all queued at once, so windows of one long file and of many files share
the slots), so both apply the same rules.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from engine.audio import SAMPLE_RATE, load_audio
from engine.errors import CadenceError, RequestError
from engine.transcript import Segment, Transcript, Word
from engine.whisper.alignment import WordTiming, align_words, alignment_prompt, fit_phrase, median_word
from engine.whisper.features import FRAMES_PER_SECOND, WINDOW_FRAMES, log_mel, pad_window, windows
from engine.transcript import WindowResult
from engine.whisper.reference import WhisperReference
from engine.whisper.timestamps import TIME_PRECISION, TimestampRules
from engine.whisper.tokens import WhisperTokenizer

WINDOWINGS = ("vad", "fixed")
LOOP_MIN_REPEATS = 4  # a tail repeating one unit this many times ...
LOOP_MIN_TOKENS = 16  # ... over at least this many tokens is a hallucination loop
LOOP_MAX_PERIOD = 16  # longest repeating unit looked for, in tokens
SILENCE_RMS = 10 ** (-60 / 20)  # a window quieter than -60 dBFS RMS is not decoded at all
NO_SPEECH_THRESHOLD = 0.6  # skip a window the model calls silent ...
LOGPROB_THRESHOLD = -1.0  # ... unless its words were confident anyway (faster-whisper's defaults)
FOLLOW_UP_MIN_S = 0.5  # with timestamps, the rest of a window the model left is decoded if at least this long
MAX_PARTS = 8  # ... in at most this many parts per window
MAX_PROMPT_TOKENS = 224  # an initial prompt keeps its last 223 tokens after <|startofprev|> (Whisper's half context)


@dataclass
class TranscriptionPlan:
    """What is decided before decoding: the language, the prompt and the 30-second windows."""

    name: str
    language: str
    prompt: list[int]
    duration: float
    spans: list[tuple[int, int, np.ndarray]]  # (first frame, frames of content, padded window)
    started: float
    silent: set[int] = field(default_factory=set)  # windows with no sound to speak of: not decoded
    task: str = "transcribe"
    detect_window: np.ndarray | None = None  # the first 30 s, for language detection when none was given
    timestamps: bool = False  # the model times each phrase (segments of a few seconds), not one per window
    words: bool = False  # each word timed from the alignment heads' cross-attention
    speakers: str | int = "off"  # "auto", a number of speakers, or "off" (engine.speakers)
    speech_probabilities: np.ndarray | None = None  # voice activity per 32 ms, where it was computed
    samples: np.ndarray | None = None  # the audio, kept only until the speakers are told apart
    speaker_turns: object | None = None  # a Future of engine.speakers.Turn list, while they are being told apart
    # A text given to steer every window (names, spelling, style), as tokens: placed after <|startofprev|>,
    # where Whisper reads the previous window's text, ahead of each window's own prompt.
    initial: list[int] = field(default_factory=list)

    def set_prompt(self, tok: WhisperTokenizer) -> None:
        """The decoder's prompt for the plan's language, task and timestamps (after the initial prompt, if any)."""
        previous = [tok.sot_prev] + self.initial if self.initial else []
        self.prompt = previous + tok.sot_sequence(self.language, self.task) + (
            [] if self.timestamps else [tok.no_timestamps])

    def start_of_transcript(self) -> list[int]:
        """The prompt from <|startoftranscript|> on: what word alignment reads (no initial prompt)."""
        return self.prompt[len(self.initial) + 1:] if self.initial else self.prompt

    def window_times(self) -> list[tuple[float, float]]:
        """(start, end) seconds of each window's audio."""
        return [(seek / FRAMES_PER_SECOND, min((seek + size) / FRAMES_PER_SECOND, self.duration))
                for seek, size, _ in self.spans]

    @property
    def has_speech(self) -> bool:
        """Whether any window has sound to decode (else there is no language to detect either)."""
        return len(self.silent) < len(self.spans)

    def silent_result(self) -> WindowResult:
        """What a silent window counts as: no tokens, certainly no speech."""
        return WindowResult([], 1.0, -10.0)


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


def check_windowing(windowing: str) -> str:
    if windowing not in WINDOWINGS:
        raise RequestError(f"Unknown windowing '{windowing}' (use {' or '.join(WINDOWINGS)}).")
    return windowing


def plan_windows(features: np.ndarray, samples: np.ndarray, windowing: str,
                 probabilities: np.ndarray | None = None) -> list[tuple[int, int, np.ndarray]]:
    """(first frame, frames of content, padded window) of each window to decode: cut in the pauses of
    speech found by voice activity ("vad": long silences are not decoded, words are rarely cut at a
    window edge), or every 30 s ("fixed", faster-whisper's sequential windows without timestamps)."""
    if windowing == "fixed":
        return list(windows(features))
    from engine.whisper.vad import speech_probabilities, vad_windows

    content = features.shape[-1] - 1  # the last frame comes from the padding tail
    spans = []
    if probabilities is None:
        probabilities = speech_probabilities(samples)
    for seek, size in vad_windows(probabilities, samples.size):
        size = min(size, content - seek)
        if size > 0:
            spans.append((seek, size, pad_window(features[:, seek : seek + size])))
    return spans


def plan_transcription(decoder: WhisperReference, samples: np.ndarray, language: str | None = None,
                       task: str = "transcribe", name: str = "audio", detect: bool = True,
                       windowing: str = "vad", timestamps: bool = False, words: bool = False,
                       initial_prompt: str | None = None) -> TranscriptionPlan:
    """Features, windows and silent windows of a clip. With ``detect`` False, an undetected language
    stays None (and the prompt empty) for :func:`detect_plan_language` to settle on the model's thread:
    everything else here is plain array work that any thread may do."""
    tok = decoder.tok
    language = check_language(tok, decoder.loaded.source.name, language, task)
    check_windowing(windowing)
    if samples.size < SAMPLE_RATE // 10:
        raise CadenceError(f"{Path(name).name} is too short to transcribe ({samples.size / SAMPLE_RATE:.2f} s).")
    started = time.perf_counter()
    features = log_mel(samples, decoder.model.config.num_mel_bins)
    probabilities = None
    if windowing == "vad":
        from engine.whisper.vad import speech_probabilities

        probabilities = speech_probabilities(samples)
    spans = plan_windows(features, samples, windowing, probabilities)
    hop = SAMPLE_RATE // FRAMES_PER_SECOND
    silent = {i for i, (seek, size, _) in enumerate(spans)
              if _rms(samples[seek * hop : (seek + size) * hop]) < SILENCE_RMS}
    plan = TranscriptionPlan(name, language, [], samples.size / SAMPLE_RATE, spans, started, silent, task,
                             timestamps=timestamps, words=words)
    plan.initial = initial_prompt_tokens(tok, initial_prompt)
    plan.speech_probabilities = probabilities
    if language is not None:
        plan.set_prompt(tok)
        return plan
    if not plan.has_speech:  # nothing will be decoded: no language is reported rather than one guessed from silence
        return plan
    first = spans[0][0] if spans else 0  # the first speech, where voice activity found some
    plan.detect_window = pad_window(features[:, first : first + WINDOW_FRAMES])
    if detect:
        detect_plan_language(decoder, plan)
    return plan


def initial_prompt_tokens(tok: WhisperTokenizer, text: str | None) -> list[int]:
    """An initial prompt's tokens as Whisper reads them (a leading space, surrounding blanks dropped; the
    last 223 tokens of a longer one, as Whisper keeps of the previous text)."""
    if text is not None and not isinstance(text, str):
        raise RequestError("The initial prompt must be text.")
    if text is None or not text.strip():
        return []
    return tok.encode(" " + text.strip())[-(MAX_PROMPT_TOKENS - 1):]


def detect_plan_language(decoder: WhisperReference, plan: TranscriptionPlan) -> None:
    """Detect the language from the first window and build the prompt (runs the model)."""
    plan.language, _ = decoder.detect_language(decoder.encode(plan.detect_window))
    plan.detect_window = None
    plan.set_prompt(decoder.tok)


def read_plan(ref: WhisperReference, req) -> TranscriptionPlan:
    """Read a request's audio and plan its windows, without the model: runs on the engine's reader thread,
    so decoding and resampling a file never holds up the slots decoding others."""
    name = str(req.audio) if not isinstance(req.audio, np.ndarray) else (req.name or "audio")
    samples = req.audio if isinstance(req.audio, np.ndarray) else load_audio(req.audio)
    plan = plan_transcription(ref, samples, req.language, req.task, req.name or name, detect=False,
                              windowing=req.windowing, timestamps=req.timestamps, words=req.words,
                              initial_prompt=req.initial_prompt)
    from engine.speakers import parse_speakers

    plan.speakers = parse_speakers(req.speakers)
    if plan.speakers != "off":
        plan.samples = samples
    return plan


def window_key(plan: TranscriptionPlan, index: int) -> tuple:
    """What decides a window's result: its span, its features (their digest), the prompt and word timing."""
    seek, size, window = plan.spans[index]
    digest = hashlib.sha1(np.ascontiguousarray(window).tobytes()).hexdigest()
    return seek, size, digest, tuple(plan.prompt), plan.words


def steps_to_frames(steps: int) -> int:
    """Time-token steps (20 ms) as log-mel frames (10 ms)."""
    return round(steps * TIME_PRECISION * FRAMES_PER_SECOND)


def follow_up(plan: TranscriptionPlan, rules: TimestampRules | None, index: int, tokens: list[int], part: list[int],
              parts: int) -> tuple[int, np.ndarray] | None:
    """Where the decoding of window ``index`` goes on, and the features to decode there, or None.

    With timestamps the model often stops at a phrase boundary before the window's end, leaving the
    rest for the next window (faster-whisper's sequential run seeks back to that time). Cadence's
    windows are decoded side by side, so the rest of the window is decoded as a follow-up part instead
    and joined on (``tokens``: the window's tokens so far; ``part``: the last part's). Returns (time steps
    from the window's start, padded features of the rest) while at least FOLLOW_UP_MIN_S of the window
    is left, for up to MAX_PARTS parts."""
    if rules is None or parts >= MAX_PARTS or rules.resume_point(part) is None:
        return None
    steps = rules.resume_point(tokens)  # the joined tokens end on the same pair, on the window's clock
    _, size, window = plan.spans[index]
    frames = steps_to_frames(steps)
    if (size - frames) / FRAMES_PER_SECOND < FOLLOW_UP_MIN_S:
        return None
    return steps, pad_window(window[:, frames:size])


@dataclass
class WindowDecoding:
    """One window's decoding so far: its first part's result and, with timestamps, the parts joined on
    after it (see :func:`follow_up`). The reference decoder and the engine both keep one per window."""

    head: WindowResult  # the first part (its no-speech probability and mean log-probability stand for the window)
    tokens: list[int]  # every part's tokens joined, on the window's clock
    parts: int = 1
    steps: int = 0  # where the last part started, in time steps from the window's start
    words: list[WordTiming] | None = None  # with word timestamps: every part's words, on the window's clock

    def add_words(self, words: list[WordTiming]) -> None:
        """A part's words (seconds from where that part starts), moved onto the window's clock."""
        self.words = (self.words or []) + [w.moved(self.steps * TIME_PRECISION) for w in words]

    def rest(self, plan: TranscriptionPlan, rules: TimestampRules | None, index: int,
             last_part: list[int]) -> np.ndarray | None:
        """The padded features of the rest of the window to decode as the next part, or None: done."""
        follow = follow_up(plan, rules, index, self.tokens, last_part, self.parts)
        if follow is None:
            return None
        self.steps, features = follow
        return features

    def join(self, rules: TimestampRules, part: list[int]) -> None:
        """The part decoded from ``rest``'s features, joined on."""
        self.tokens, self.parts = rules.join(self.tokens, part, self.steps), self.parts + 1

    def result(self) -> WindowResult:
        return WindowResult(self.tokens, self.head.no_speech_prob, self.head.avg_logprob, words=self.words)


def part_text(rules: TimestampRules | None, part: list[int], probs: list[float] | None) -> tuple[list[int], list[float]]:
    """The text tokens of a decoded part (what its words are aligned from) and their probabilities."""
    probs = list(probs or [])
    if rules is None:
        return list(part), probs
    kept = [i for i, t in enumerate(part) if t < rules.begin]
    return [part[i] for i in kept], [probs[i] for i in kept if i < len(probs)]


def part_frames(plan: TranscriptionPlan, index: int, steps: int) -> int:
    """Mel frames of audio in the part of window ``index`` that starts ``steps`` time steps in."""
    return max(1, plan.spans[index][1] - steps_to_frames(steps))


def part_words(tok: WhisperTokenizer, plan: TranscriptionPlan, text: list[int], scores: np.ndarray, index: int,
               steps: int, probabilities: list[float]) -> list[WordTiming]:
    """A part's words from its alignment scores (see engine.whisper.alignment)."""
    sot_length = len(plan.start_of_transcript()) - (0 if plan.timestamps else 1)  # without <|notimestamps|>
    return align_words(tok, text, scores, part_frames(plan, index, steps), sot_length, probabilities, plan.language)


def part_alignment_prompt(tok: WhisperTokenizer, plan: TranscriptionPlan, text: list[int]) -> list[int]:
    sot = plan.start_of_transcript()
    sot = sot if plan.timestamps else sot[:-1]
    return alignment_prompt(sot, tok.no_timestamps, text, tok.eot)


def _rms(x: np.ndarray) -> float:
    return float(np.sqrt(np.mean(np.square(x, dtype=np.float64)))) if x.size else 0.0


def repetition_start(tokens: list[int]) -> int | None:
    """Where a looping tail's repetitions begin (the index just after its first unit), or None.

    Whisper sometimes repeats a word or line until the window ends. A tail made of one unit of 1 to
    LOOP_MAX_PERIOD tokens repeated at least LOOP_MIN_REPEATS times over at least LOOP_MIN_TOKENS
    tokens counts as such a loop ("no, no, no, no" does not).
    """
    n = len(tokens)
    for period in range(1, LOOP_MAX_PERIOD + 1):
        need = max(LOOP_MIN_REPEATS * period, LOOP_MIN_TOKENS)
        if n < need:
            continue
        if all(tokens[n - 1 - i] == tokens[n - 1 - i - period] for i in range(need - period)):
            start = n - need
            while start > 0 and tokens[start - 1] == tokens[start - 1 + period]:
                start -= 1
            return start + period
    return None


def cut_repetition(tokens: list[int], rules: TimestampRules | None = None) -> list[int]:
    """The tokens with a looping tail cut after its first unit. With time tokens (``rules``), the loop is
    looked for in the text alone (a repeated line gets new times each time) and the cut keeps the times
    before it."""
    if rules is None:
        cut = repetition_start(tokens)
        return tokens if cut is None else tokens[:cut]
    text_at = [i for i, t in enumerate(tokens) if t < rules.begin]
    cut = repetition_start([tokens[i] for i in text_at])
    return tokens if cut is None else tokens[: text_at[cut]]


def window_segments(tok: WhisperTokenizer, rules: TimestampRules | None, tokens: list[int], start: float,
                    end: float, words: list[WordTiming] | None = None) -> list[Segment]:
    """One window's segments (``start``..``end`` s of the file), loops cut: its timed phrases with
    ``rules`` (timestamps), else the window as one segment; with ``words`` (on the window's clock),
    each phrase gets its words and takes their times (faster-whisper's rules at its edges)."""
    tokens = cut_repetition(tokens, rules)
    phrases = rules.segments(tokens, start, end) if rules else [(start, end, tokens)]
    segments = []
    queue = [Word(start + w.start, start + w.end, w.text, w.probability) for w in words or []]
    counts = [w.tokens for w in words or []]
    median, last_speech = median_word(words or []), start
    for phrase_start, phrase_end, phrase in phrases:
        text = tok.decode(phrase).strip()
        taken: list[Word] = []
        held = 0
        while queue and held < len(phrase):
            held += counts.pop(0)
            word = queue.pop(0)
            if word.text:
                taken.append(word)
        if not text:
            continue
        segment = Segment(phrase_start, phrase_end, text, list(phrase))
        if words is not None:
            segment.words = taken
            segment.start, segment.end = fit_phrase(taken, phrase_start, phrase_end, last_speech, median)
            last_speech = segment.end if taken else last_speech
        segments.append(segment)
    return segments


def left_out(result: WindowResult) -> bool:
    """A window the transcript leaves out: the model calls it silence and its words were unsure anyway."""
    return result.no_speech_prob > NO_SPEECH_THRESHOLD and result.avg_logprob <= LOGPROB_THRESHOLD


def result_segments(plan: TranscriptionPlan, tok: WhisperTokenizer, index: int, result: WindowResult) -> list[Segment]:
    """Window ``index``'s segments exactly as the finished transcript has them (none when it is left out)."""
    if left_out(result):
        return []
    start, end = plan.window_times()[index]
    return window_segments(tok, TimestampRules.of(tok) if plan.timestamps else None, result.tokens, start, end,
                           result.words if plan.words else None)


def assemble_transcript(plan: TranscriptionPlan, tok: WhisperTokenizer, results: list[WindowResult]) -> Transcript:
    """Window results, in window order, into segments; silent windows are skipped, loops cut."""
    segments: list[Segment] = []
    for index, result in enumerate(results):
        segments += result_segments(plan, tok, index, result)
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
                       task: str = "transcribe", name: str = "audio", windowing: str = "vad",
                       timestamps: bool = False, words: bool = False, initial_prompt: str | None = None) -> Transcript:
    """Greedy, each window decoded on its own (no previous-text conditioning; the initial prompt, if
    given, ahead of every window)."""
    plan = plan_transcription(decoder, samples, language, task, name, windowing=windowing, timestamps=timestamps,
                              words=words, initial_prompt=initial_prompt)
    rules = TimestampRules.of(decoder.tok) if plan.timestamps else None
    heads = None
    if words:
        from engine.whisper.alignment import require_heads

        heads = require_heads(decoder.loaded)
    results = []
    for i, (_, _, window) in enumerate(plan.spans):
        if i in plan.silent:
            results.append(plan.silent_result())
            continue
        encoded = decoder.encode(window)
        head = decoder.decode(encoded, plan.prompt)
        decoding, part, probs = WindowDecoding(head, head.tokens), head.tokens, head.token_probs
        while True:
            if heads is not None:
                text, text_probs = part_text(rules, part, probs)
                scores = decoder.alignment_scores(encoded, part_alignment_prompt(decoder.tok, plan, text), heads)
                decoding.add_words(part_words(decoder.tok, plan, text, scores, i, decoding.steps, text_probs))
            features = decoding.rest(plan, rules, i, part)
            if features is None:
                break
            encoded = decoder.encode(features)
            result = decoder.decode(encoded, plan.prompt)
            part, probs = result.tokens, result.token_probs
            decoding.join(rules, part)
        results.append(decoding.result())
    return assemble_transcript(plan, decoder.tok, results)


def transcribe_file(decoder: WhisperReference, path: str | Path, language=None, task="transcribe",
                    windowing: str = "vad", timestamps: bool = False, words: bool = False,
                    initial_prompt: str | None = None) -> Transcript:
    return transcribe_samples(decoder, load_audio(path), language, task, name=str(path), windowing=windowing,
                              timestamps=timestamps, words=words, initial_prompt=initial_prompt)
