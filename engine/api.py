"""What callers hand the engine and what they get back: requests, handles and events.

A leaf module: it imports nothing of the engine's machinery, so the request adapters, the
conversation store and the front ends can all speak this language without importing the engine
(or each other). Each event kind has fields of its own, named for what they hold:

- ``started``: a chat's :class:`ChatStarted` (how its prompt was fitted to the context), a
  transcription's :class:`TranscriptionStarted` (its language and where each window lies);
- ``delta``: :class:`Delta`, new text and the tokens that made it;
- ``progress``: :class:`Progress`, one transcription window finished, with its segments as the
  finished transcript will have them;
- ``finished``: :class:`Finished`, the chat's :class:`ChatAnswer` or the :class:`Transcript`;
- ``failed``: :class:`Failed`, one sentence.

Consumers that cannot keep up with hundreds of deltas a second read coalesced events
(:func:`drain` + :func:`coalesce`, or :func:`follow`): whatever is pending arrives as one delta.
"""

from __future__ import annotations

import dataclasses
import itertools
import queue
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, ClassVar, Iterable, Iterator

from engine.errors import CadenceError, RequestError
from engine.models import DEFAULT_CHAT, DEFAULT_WHISPER
from engine.sampling import SamplingParams

if TYPE_CHECKING:
    import numpy as np

    from engine.transcript import Segment, Transcript
    from engine.transcript import WindowResult


BATCH_ENV = "CADENCE_BATCH"  # off | N | auto: overrides the calibrated width when no batch is given


def auto_off_or_number(value, refusal: str) -> str | int:
    """'auto', 'off' or a whole number (the caller checks its range); else ``refusal`` (with the
    value in ``{value}``) as a RequestError."""
    text = str(value).strip().lower()
    if text in ("auto", "off"):
        return text
    try:
        return int(text)
    except ValueError:
        raise RequestError(refusal.format(value=value)) from None


def parse_batch(value) -> str | int:
    """'auto', 'off' or a width of at least 1; anything else gets a sentence."""
    n = auto_off_or_number(value, "Batch must be auto, off or a whole number of slots (got '{value}').")
    if isinstance(n, str):
        return n
    if n < 1:
        raise CadenceError(f"Batch width must be at least 1 (got {n}).")
    return n


PRECISION_ENV = "CADENCE_PRECISION"  # auto | float32 | bfloat16 | int8, when no precision is given
PRECISIONS = ("float32", "bfloat16", "int8")  # see engine.kernels; "auto" measures them (engine.precision)


def parse_precision(value) -> str:
    """'auto' or one of PRECISIONS; anything else gets a sentence."""
    text = str(value).strip().lower()
    if text == "auto" or text in PRECISIONS:
        return text
    raise RequestError(f"Precision must be auto, {', '.join(PRECISIONS)} (got '{value}').")



DRAFTER_ENV = "CADENCE_DRAFTER"
DRAFTER_CHOICES = ("auto", "mtp", "ngram", "draft:MODEL", "off")
MAX_DEPTH = 8  # draft tokens per slot and step, at most


def parse_drafter(value) -> str:
    """'auto', 'mtp', 'ngram', 'off' or 'draft:MODEL'; one clear sentence for anything else."""
    text = str(value or "auto").strip()
    low = text.lower()
    if low in ("auto", "mtp", "ngram", "off"):
        return low
    if low.startswith("draft:") and text[6:].strip():
        return "draft:" + text[6:].strip()
    raise RequestError(f"Unknown drafter {value!r}: use one of {', '.join(DRAFTER_CHOICES)}.")


def check_draft_limits(draft_depth, draft_min_p) -> None:
    """A fixed draft depth (None: chosen per slot) and the MTP drafts' least probability, or a sentence."""
    if draft_depth is not None and (not isinstance(draft_depth, int) or not 0 <= draft_depth <= MAX_DEPTH):
        raise CadenceError(f"Draft depth must be a whole number from 0 to {MAX_DEPTH} (got {draft_depth}).")
    if not isinstance(draft_min_p, (int, float)) or not 0 <= draft_min_p < 1:
        raise CadenceError(f"The draft min-p must be at least 0 and below 1 (got {draft_min_p}).")


CONTEXT_ENV = "CADENCE_CONTEXT"  # auto | N: positions per chat slot, when no context is given
MIN_CONTEXT = 64


def parse_context(value) -> str | int:
    """'auto' (the model's context, bounded by memory) or a number of positions per slot (at least 64)."""
    text = str(value).strip().lower()
    if text == "auto":
        return text
    try:
        n = int(text)
    except ValueError:
        raise CadenceError(f"Context must be auto or a whole number of tokens (got '{value}').") from None
    if n < MIN_CONTEXT:
        raise CadenceError(f"Context must be at least {MIN_CONTEXT} tokens (got {n}).")
    return n

# ---------------------------------------------------------------------------- requests
@dataclass
class ChatRequest:
    prompt: str = ""
    system: str | None = None
    history: list[dict] = field(default_factory=list)
    model: str = DEFAULT_CHAT
    params: SamplingParams = field(default_factory=SamplingParams)
    prompt_ids: list[int] | None = None  # bypasses the chat template when given
    keep_hidden: bool = False  # True: the answer carries the hidden state behind each token (draft-head data)


@dataclass
class DocumentChatRequest(ChatRequest):
    """A chat request whose system prompt holds a long document, cut to fit: ``system_for(n)`` is the
    system prompt with the first ``n`` of the document's ``parts`` (so ``system_for(parts)`` is
    uncut). The largest ``n`` whose prompt fits its share of the context is used, leaving room for
    the turns that follow; :class:`PromptFitting` reports the system prompt chosen and ``n``."""

    parts: int = 0
    system_for: Callable[[int], str] | None = None


@dataclass
class TranscribeRequest:
    audio: str | Path | np.ndarray  # a path, or 16 kHz mono samples
    model: str = DEFAULT_WHISPER
    language: str | None = None
    task: str = "transcribe"
    name: str = ""
    windowing: str = "vad"  # "vad": windows cut in the pauses of speech; "fixed": every 30 s
    timestamps: bool = False  # True: the model times each phrase (segments of a few seconds), else one per window
    words: bool = False  # True: each word timed too (the model's alignment heads); segments carry ``words``
    speakers: str | int = "off"  # "auto", a number of speakers, or "off": segments carry a ``speaker``
    # Text that steers every window (names, spelling, style), read by the model as if it came before
    initial_prompt: str | None = None
    # Resuming: windows finished in an earlier run (index -> WindowResult) are not decoded again.
    done_windows: dict | None = None
    # Windows decoded outside this request (a live recording's), by engine.whisper.pipeline.window_key: reused
    # where this file's window has the same span, prompt and features, so the result is what decoding gives.
    known_windows: dict | None = None
    # Called on the engine thread as soon as the plan is made (with the TranscriptionPlan) and as each
    # window finishes (index, WindowResult), so a job store records them before anything else happens.
    # on_plan returns False when the earlier run's windows lay elsewhere: done_windows are then unused.
    on_plan: Callable | None = None
    on_window: Callable | None = None


@dataclass
class LiveTranscribeRequest:
    """A recording transcribed while it is made: submitting it returns a :class:`LiveHandle` to feed the
    recorder's blocks to; each window of speech closed by a pause comes back as a ``progress`` event,
    decoded ahead of queued files."""

    model: str = DEFAULT_WHISPER
    language: str | None = None
    task: str = "transcribe"
    name: str = "recording"
    timestamps: bool = True
    words: bool = False
    on_window: Callable | None = None  # as TranscribeRequest's: (index, WindowResult) on the engine thread


# ---------------------------------------------------------------------------- results
@dataclass
class PromptFitting:
    """How a chat prompt was fitted to the slot: its length, the oldest turns left out, and (a document
    chat) the system prompt used with how many of the document's parts it holds."""

    prompt_tokens: int = 0
    dropped_turns: int = 0
    system: str | None = None
    document_parts: int | None = None


@dataclass
class ChatAnswer:
    """A chat request's result. A cancelled answer is still one: the tokens produced so far, with
    ``finish_reason`` "cancelled"."""

    text: str
    tokens: list[int]
    finish_reason: str  # "stop", "length" or "cancelled"
    stats: dict  # prompt_tokens, dropped_turns, timings (queue_wait, time_to_first_token, ...), drafting
    fitting: PromptFitting = field(default_factory=PromptFitting)
    # keep_hidden: the model's final-norm hidden state at the row that chose each token, [n, d] (a torch
    # tensor), and, where the answer ended on a stop token, at the row that chose that last
    hidden: object | None = field(default=None, repr=False)

    def to_json(self) -> dict:
        out = dataclasses.asdict(dataclasses.replace(self, hidden=None))
        del out["hidden"]  # (training data, not part of an answer's record)
        return out


# ---------------------------------------------------------------------------- events
@dataclass
class Event:
    """Something that happened to one request; ``kind`` says what, and each kind has its own fields."""

    request_id: int
    kind: ClassVar[str] = ""

    @property
    def terminal(self) -> bool:
        return self.kind in ("finished", "failed")


@dataclass
class ChatStarted(Event):
    kind: ClassVar[str] = "started"
    fitting: PromptFitting = field(default_factory=PromptFitting)


@dataclass
class TranscriptionStarted(Event):
    kind: ClassVar[str] = "started"
    language: str | None = None  # None: no speech, so no language to detect
    window_times: list[tuple[float, float]] = field(default_factory=list)  # (start, end) seconds of each window
    done: int = 0  # windows already done (silent, or decoded in an earlier run)
    total: int = 0


@dataclass
class Delta(Event):
    kind: ClassVar[str] = "delta"
    text: str = ""
    tokens: list[int] = field(default_factory=list)


@dataclass
class Progress(Event):
    """One transcription window is done: its tokens, and its text and segments exactly as the finished
    transcript will have them (none for a window it leaves out as silence)."""

    kind: ClassVar[str] = "progress"
    index: int = -1
    done: int = 0
    total: int = 0
    window: WindowResult | None = None
    text: str = ""
    segments: list[Segment] = field(default_factory=list)
    earlier: bool = False  # decoded in an earlier run (a resumed job), reported again as it starts
    # A live caption of a grown window's new speech joined onto its earlier caption: shown meanwhile, the
    # window is decoded whole after Stop (see engine.whisper.live.LiveRun)
    provisional: bool = False


@dataclass
class Finished(Event):
    kind: ClassVar[str] = "finished"
    answer: ChatAnswer | None = None  # a chat's
    transcript: Transcript | None = None  # a transcription's

    @property
    def result(self):
        return self.answer if self.answer is not None else self.transcript


@dataclass
class Failed(Event):
    kind: ClassVar[str] = "failed"
    message: str = ""  # one sentence


# ---------------------------------------------------------------------------- handles
class Handle:
    """What ``Engine.submit`` returns: iterate it for events, or wait for ``result()``. The engine
    gives it ``on_end`` (called once with its terminal event) and ``on_cancel``."""

    _ids = itertools.count(1)

    def __init__(self, request, on_cancel: Callable[["Handle"], None] | None = None,
                 on_end: Callable[["Handle"], None] | None = None):
        self.id = next(self._ids)
        self.request = request
        self.events: queue.Queue[Event] = queue.Queue()
        self.final: Event | None = None  # the terminal event, once emitted
        self.cancelled = False
        self._on_cancel = on_cancel
        self._on_end = on_end

    @property
    def ended(self) -> bool:
        return self.final is not None

    def emit(self, event: Event) -> None:
        if event.terminal:
            self.final = event
            if self._on_end is not None:
                self._on_end(self)
        self.events.put(event)

    def fail(self, message: str) -> None:
        """End the request with one sentence, unless it has ended already."""
        if self.final is None:
            self.emit(Failed(self.id, message=message))

    def __iter__(self) -> Iterator[Event]:
        while True:
            event = self.events.get()
            yield event
            if event.terminal:
                return

    def result(self, timeout: float | None = None):
        """Block until finished; return the :class:`ChatAnswer` or :class:`Transcript`, or raise
        CadenceError with the failure's sentence."""
        deadline = None if timeout is None else time.monotonic() + timeout
        final = None
        while final is None:
            if self.final is not None and self.events.empty():  # its events were read elsewhere
                final = self.final
                break
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                event = self.events.get(timeout=remaining)
            except queue.Empty:
                raise TimeoutError(f"request {self.id} did not finish in {timeout} s") from None
            if event.terminal:
                final = event
        if isinstance(final, Failed):
            raise CadenceError(final.message)
        return final.result

    def cancel(self) -> None:
        self.cancelled = True
        if self._on_cancel is not None:
            self._on_cancel(self)


class LiveHandle(Handle):
    """A live recording's handle: ``feed`` each block as the file gets it (any thread), ``stop`` at the
    end. ``known`` holds the windows decoded so far, for the saved file's transcription to reuse
    (``TranscribeRequest.known_windows``); it is filled on the engine thread and read there."""

    def __init__(self, request, on_cancel=None, on_end=None, on_feed=None, on_stop=None):
        super().__init__(request, on_cancel=on_cancel, on_end=on_end)
        self._on_feed, self._on_stop = on_feed, on_stop
        self.known: dict = {}
        self.stopped = False

    def feed(self, block, rate: int) -> None:
        """A block of samples [frames, channels] (float, as the recorder got it) at ``rate`` Hz."""
        if not self.stopped and not self.ended:
            self._on_feed(self, block, rate)

    def stop(self) -> None:
        """No more audio: the last windows are decoded and the handle finishes."""
        if not self.stopped:
            self.stopped = True
            self._on_stop(self)


# ---------------------------------------------------------------------------- reading events
def drain(events: queue.Queue, block: bool = True, timeout: float | None = None) -> list:
    """Everything waiting in ``events`` now; with ``block``, first wait for at least one item."""
    items = []
    try:
        items.append(events.get(block=block, timeout=timeout))
    except queue.Empty:
        return items
    while True:
        try:
            items.append(events.get_nowait())
        except queue.Empty:
            return items


def coalesce(events: Iterable[Event]) -> list[Event]:
    """Consecutive delta events of one request merged into one (texts and tokens joined in order);
    every other event kept as it is, in its place."""
    out: list[Event] = []
    run: list[Delta] = []

    def close_run():
        if len(run) == 1:
            out.append(run[0])
        elif run:
            out.append(Delta(run[0].request_id, text="".join(e.text for e in run),
                             tokens=[t for e in run for t in e.tokens]))
        run.clear()

    for event in events:
        if isinstance(event, Delta) and (not run or run[0].request_id == event.request_id):
            run.append(event)
            continue
        close_run()
        if isinstance(event, Delta):
            run.append(event)
        else:
            out.append(event)
    close_run()
    return out


def follow(events: queue.Queue) -> Iterator[Event]:
    """A handle's (or a reply's) events as they come, pending deltas merged into one, up to and
    including the terminal event: a slow reader gets fewer, longer deltas, never less text."""
    while True:
        for event in coalesce(drain(events)):
            yield event
            if event.terminal:
                return
