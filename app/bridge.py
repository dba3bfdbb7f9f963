"""The thin layer between the window and the engine (this computer's, or a server's as Settings say:
engine.remote.RemoteEngine): engine events in, Qt signals out. The engine decodes on its own thread. One
*pump* thread here follows every handle the app has in flight (transcription jobs and chat answers):
several times a second it takes the events waiting, merges pending text deltas into one, records how jobs
end (and writes their output files), and emits Qt signals, which Qt delivers on the window's thread. It
also samples ``Engine.status()`` for the live panel (a server's slots and metrics: app.remote_status).
So the window never waits on the engine, and hundreds of tokens a second reach the UI as a few updates.
Everything the app asks of the engine goes through :class:`EngineBridge`: add and control jobs, start
and stop answers, rebuild the engine when its settings change."""

from __future__ import annotations

import inspect
import threading
from collections import deque
import time
from dataclasses import dataclass, field
from pathlib import Path

from PySide6.QtCore import QObject, Signal

from engine import Engine
from engine.api import coalesce, drain
from engine.audio import audio_files
from engine.chat.answering import Conversations, Reply
from engine.errors import CadenceError, record_fault
from engine.jobs import JobStore, settle_job, submit_job
from engine.remote import RemoteEngine

from app.settings import EngineChoice, Settings
from app.transcripts import write_outputs

PUMP_INTERVAL_S = 0.05  # events reach the window at most 20 times a second per job or answer
STATUS_INTERVAL_S = 0.25  # the live panel gets a status snapshot 4 times a second
ADD_AT_ONCE = 32  # a batch larger than this is queued on a thread, this many jobs at a time
MAX_JOBS_IN_ENGINE = 16  # files handed to the engine at once (enough to fill its slots); the rest wait here


def _named(name: str, sentence: str, full_path: str | None) -> str:
    """'NAME: sentence', naming the file once (engine sentences may start with its full path)."""
    for prefix in (full_path, name):
        if prefix and sentence.startswith(f"{prefix}: "):
            sentence = sentence[len(prefix) + 2:]
            break
    return f"{name}: {sentence}"


def unexpected(exc: BaseException, doing: str) -> str:
    """One sentence for an error nobody planned for; the traceback goes to the fault log."""
    return f"Something went wrong while {doing} ({exc.__class__.__name__}: {exc}); details are in {record_fault(exc)}."


def make_engine(choice: EngineChoice) -> Engine:
    """An engine built from the settings (a server's where ``choice.server`` names one); keyword arguments the
    running engine does not know are left out rather than refused."""
    if choice.server:
        return RemoteEngine(choice.server, choice.api_key or None)
    accepted = inspect.signature(Engine).parameters
    kwargs: dict = {"backend": choice.backend, "batch": choice.batch}
    if "drafter" in accepted:
        kwargs["drafter"] = choice.drafter
    if choice.draft_depth and "draft_depth" in accepted:
        kwargs["draft_depth"] = choice.draft_depth
    if "precision" in accepted and choice.precision != "auto":
        kwargs["precision"] = choice.precision  # 'auto' is left to the engine, so CADENCE_PRECISION still applies
    if "context" in accepted and choice.context != "auto":
        kwargs["context"] = choice.context  # as precision: 'auto' leaves CADENCE_CONTEXT to the engine
    return Engine(**kwargs)


@dataclass
class LiveJob:
    """A job the engine is working on now, as far as the window needs to know."""

    job_id: int
    handle: object
    model: str
    name: str
    path: str = ""
    submitted: float = field(default_factory=time.monotonic)
    started: float | None = None  # when the engine had planned it (model loaded, audio decoded)
    done: int = 0
    total: int = 0
    remove_when_ended: bool = False
    texts: dict[int, str] = field(default_factory=dict)  # window index -> its text, as each window finishes
    # window index -> its timed phrases (start s, end s, text), when the job decodes with timestamps
    phrases: dict[int, list[tuple[float, float, str]]] = field(default_factory=dict)
    timestamps: bool = False
    window_times: list = field(default_factory=list)  # (start, end) seconds of each window, once planned
    duration: float | None = None  # seconds of audio, once the engine has read the file


@dataclass
class LiveReply:
    """A chat answer being written, with its own speed from its own deltas."""

    reply: Reply
    label: str
    first_delta: float | None = None
    last_delta: float | None = None
    tokens: int = 0

    @property
    def tok_s(self) -> float:
        if self.first_delta is None or self.last_delta is None or self.last_delta <= self.first_delta or self.tokens < 2:
            return 0.0  # (a server's deltas carry no token ids: no live speed, but its own at the end)
        return (self.tokens - 1) / (self.last_delta - self.first_delta)


class EngineBridge(QObject):
    job_changed = Signal(int)  # a job's stored row changed (started, ended, removed)
    jobs_added = Signal(list)  # the Jobs just queued
    job_progress = Signal(int, int, int)  # job id, windows done, windows in all
    job_text = Signal(int, int, str)  # job id, window index, that window's text (as each one finishes)
    job_phrases = Signal(int, int, object)  # job id, window index, its timed phrases (before its job_text)
    reply_update = Signal(int, int, str, float)  # conversation id, answer id, text so far, tokens/s
    reply_ended = Signal(int, int, str)  # conversation id, answer id, error sentence ('' when it ended well)
    status_changed = Signal(dict)  # Engine.status() plus "labels": request id -> what it is
    problem = Signal(str)  # a sentence for the status bar
    engine_rebuilt = Signal(str)  # a sentence: the engine now runs with the new settings

    def __init__(self, settings: Settings, parent: QObject | None = None):
        super().__init__(parent)
        self.settings = settings
        self.jobs = JobStore()
        self.engine: Engine | None = None
        self.conversations: Conversations | None = None
        self.engine_note = ""  # why the engine runs with other settings than chosen, if it does
        self.live_jobs: dict[int, LiveJob] = {}
        self.live_replies: dict[int, LiveReply] = {}  # answer message id -> its reply
        self.last_status: dict = {}
        self._lock = threading.Lock()
        self._engine_lock = threading.RLock()
        self._pending: deque[int] = deque()  # queued jobs not yet given to the engine
        self._known: dict[str, dict] = {}  # file -> windows its live recording decoded (for its job to reuse)
        self._feed_lock = threading.RLock()  # held while submitting, and while the engine is replaced
        self._stop = threading.Event()
        self._rebuild_pending = False
        self._closed = False
        self._thread = threading.Thread(target=self._pump, name="cadence-app-pump", daemon=True)

    # ------------------------------------------------------------------ life cycle
    def start(self, resume: bool = True) -> None:
        """Build the engine, start following it, and resume the jobs an earlier session left."""
        self.engine = self._build_engine()
        self.conversations = Conversations(self.engine)
        self._thread.start()
        if resume:
            self._enqueue([job.id for job in self.jobs.unfinished()])

    def _build_engine(self) -> Engine:
        choice = self.settings.engine_choice()
        try:
            engine = make_engine(choice)
            self.engine_note = ""
        except CadenceError as exc:  # e.g. the chosen backend or precision is not on this machine, a bad address
            self.engine_note = f"{exc} Cadence uses the automatic choice on this computer instead."
            self.problem.emit(self.engine_note)
            choice.backend, choice.precision, choice.server = "auto", "auto", ""
            engine = make_engine(choice)
        return engine

    def close(self) -> None:
        """End answers in flight (kept as ``interrupted``), stop following, shut the engine down.
        Jobs in flight stay ``running`` in the store and resume on the next start."""
        if self._closed:
            return
        self._closed = True
        if self.conversations is not None:
            self.conversations.close("interrupted", timeout=5)
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5)
        if self.engine is not None:
            self.engine.shutdown(timeout=10)

    @property
    def remote(self) -> bool:  # the engine is a server's: no recording, no speakers, no lanes here
        return isinstance(self.engine, RemoteEngine)

    @property
    def busy(self) -> bool:
        """Something is in the engine now (queued files waiting here do not count)."""
        return bool(self.live_jobs or self.live_replies)

    @property
    def transcribing(self) -> bool:
        """Some file is being transcribed or waits its turn."""
        return bool(self.live_jobs or self._pending)

    def apply_engine_settings(self) -> str:
        """Rebuild the engine for changed backend / batching / drafter settings: now when nothing is
        in flight, else as soon as the current work ends. Returns a sentence saying which."""
        if self.busy:
            self._rebuild_pending = True
            return "The new engine settings apply as soon as the current work finishes."
        self._rebuild()
        return "The new engine settings are in use." if not self.engine_note else self.engine_note

    def _rebuild(self) -> None:
        with self._engine_lock:
            if self.busy:  # something was submitted meanwhile: wait for it to end
                self._rebuild_pending = True
                return
            self._replace_engine()

    def _replace_engine(self) -> None:
        self._rebuild_pending = False
        old = self.engine
        self.engine = self._build_engine()
        if self.conversations is not None:
            self.conversations.engine = self.engine
        if old is not None:
            old.shutdown(timeout=10)
        self.engine_rebuilt.emit("The engine now runs with the new settings; models load again on first use.")

    # ------------------------------------------------------------------ transcription jobs
    def start_live(self):
        """A live transcription for a recording starting now (engine.api.LiveHandle): feed it the blocks."""
        from engine.api import LiveTranscribeRequest

        s = self.settings
        with self._engine_lock:
            return self.engine.submit(LiveTranscribeRequest(model=s.transcription_model, language=s.language or None,
                                                            timestamps=True, words=s.word_timestamps))

    def add_paths(self, paths, known_windows: dict | None = None) -> list[int]:
        """Queue files and folders (searched recursively for audio and video). A few files are queued at
        once and their job ids returned; a large batch is queued on a thread of its own, in chunks
        (``jobs_added``), so the window stays responsive, and [] is returned. A path that is neither a
        folder nor a file still gets a job, which fails with its sentence. ``known_windows``: windows a
        live recording of the (one) file decoded already, reused where identical."""
        files: list[Path] = []
        for item in paths:
            p = Path(item).expanduser()
            if p.is_dir():
                files += audio_files(p)
            else:
                files.append(p)
        options = {"formats": self.settings.output_formats, "out": self.settings.output_folder or None,
                   "language": self.settings.language or None, "task": "transcribe",
                   "windowing": self.settings.windowing, "timestamps": True, **self.settings.transcript_options()}
        options["speakers"] = "off" if self.remote else options["speakers"]  # (a server tells none apart)
        if known_windows is not None and len(files) == 1:
            self._known[str(files[0].absolute())] = known_windows
        model = self.settings.transcription_model
        if len(files) <= ADD_AT_ONCE:
            return self._queue(files, model, options)
        threading.Thread(target=self._queue_in_chunks, args=(files, model, options), name="cadence-app-add",
                         daemon=True).start()
        return []

    def _queue(self, files: list[Path], model: str, options: dict) -> list[int]:
        ids = [self.jobs.create(f.absolute(), model, options) for f in files]
        self.jobs_added.emit([self.jobs.get(job_id) for job_id in ids])  # read here, not on the window's thread
        self._enqueue(ids)
        return ids

    def _enqueue(self, job_ids) -> None:
        """Jobs wait here (``queued`` in the store) and go to the engine a few at a time, so a batch of
        hundreds of files does not load all their audio at once, and closing the app is quick."""
        with self._feed_lock:
            for job_id in job_ids:
                if job_id not in self._pending and job_id not in self.live_jobs:
                    self._pending.append(job_id)
        self._feed()

    def _feed(self) -> None:
        with self._feed_lock:
            while self._pending and len(self.live_jobs) < MAX_JOBS_IN_ENGINE and not self._stop.is_set():
                self._submit(self._pending.popleft())

    @property
    def pending_jobs(self) -> list[int]:
        """Jobs queued here, not yet handed to the engine, first first."""
        with self._feed_lock:
            return list(self._pending)

    def _queue_in_chunks(self, files: list[Path], model: str, options: dict) -> None:
        try:
            for start in range(0, len(files), ADD_AT_ONCE):
                if self._stop.is_set():
                    return
                self._queue(files[start : start + ADD_AT_ONCE], model, options)
        except Exception as exc:
            self.problem.emit(unexpected(exc, "adding files to the queue"))

    def _submit(self, job_id: int) -> None:
        try:
            job = self.jobs.get(job_id)
        except CadenceError:  # removed meanwhile
            return
        try:
            with self._engine_lock:
                handle = submit_job(self.engine, self.jobs, job_id, self._known.pop(job.path, None))
                with self._lock:
                    self.live_jobs[job_id] = LiveJob(job_id, handle, job.model, Path(job.path).name, job.path,
                                                     timestamps=bool(job.options.get("timestamps")))
        except CadenceError as exc:  # e.g. the file is gone: recorded as the job's error
            if self.jobs.get(job_id).state != "failed":
                self.jobs.failed(job_id, str(exc))
        self.job_changed.emit(job_id)

    def _unqueue(self, job_id: int) -> bool:
        with self._feed_lock:
            if job_id in self._pending:
                self._pending.remove(job_id)
                return True
        return False

    def cancel_job(self, job_id: int) -> None:
        self._unqueue(job_id)
        live = self.live_jobs.get(job_id)
        if live is not None:
            live.handle.cancel()  # the pump records it as cancelled when the engine confirms
        elif self.jobs.get(job_id).state in ("queued", "running"):
            self.jobs.cancelled(job_id)
            self.job_changed.emit(job_id)

    def retry_job(self, job_id: int) -> None:
        """Queue a failed or cancelled job again (windows already decoded are kept)."""
        if job_id in self.live_jobs or job_id in self.pending_jobs:
            return
        self.jobs.requeue(job_id)
        self.job_changed.emit(job_id)
        self._enqueue([job_id])

    def remove_job(self, job_id: int) -> None:
        """Forget a job (its output files stay). A job in flight is cancelled first and removed once
        the engine lets go of it, so no window is written for a job that is gone."""
        self._unqueue(job_id)
        live = self.live_jobs.get(job_id)
        if live is not None:
            live.remove_when_ended = True
            live.handle.cancel()
            return
        self.jobs.remove(job_id)
        self.job_changed.emit(job_id)

    def slots_of(self, handle_id: int) -> list[str]:
        """'model:slot' for each slot the request sits in, from the latest status snapshot."""
        where = []
        for model, lane in (self.last_status.get("lanes") or {}).items():
            for i, slot in enumerate(lane.get("slots") or []):
                if slot and slot.get("request") == handle_id:
                    where.append(str(i))
        return where

    # ------------------------------------------------------------------ chats
    def track(self, reply: Reply, label: str) -> Reply:
        with self._lock:
            self.live_replies[reply.message_id] = LiveReply(reply, label)
        return reply

    def _answer(self, start) -> Reply:
        """Start an answer (``start`` calls Conversations) and follow it; never while the engine is replaced."""
        with self._engine_lock:
            reply = start()
            return self.track(reply, self.conversations.get(reply.conversation_id).title)

    def start_chat(self, text: str, **settings) -> Reply:
        return self._answer(lambda: self.conversations.start(text, **settings))

    def send(self, conversation_id: int, text: str) -> Reply:
        return self._answer(lambda: self.conversations.send(conversation_id, text))

    def regenerate(self, message_id: int) -> Reply:
        return self._answer(lambda: self.conversations.regenerate(message_id))

    def edit(self, message_id: int, text: str) -> Reply:
        return self._answer(lambda: self.conversations.edit(message_id, text))

    def stop_answer(self, message_id: int) -> bool:
        return self.conversations.stop(message_id)

    def answering(self, conversation_id: int) -> LiveReply | None:
        for live in list(self.live_replies.values()):
            if live.reply.conversation_id == conversation_id:
                return live
        return None

    # ------------------------------------------------------------------ the pump thread
    def _pump(self) -> None:
        next_status = 0.0
        while not self._stop.wait(PUMP_INTERVAL_S):
            try:
                self._pump_jobs()
                self._pump_replies()
                now = time.monotonic()
                if now >= next_status:
                    next_status = now + STATUS_INTERVAL_S
                    self._sample_status()
                if self._rebuild_pending and not self.busy and not self._stop.is_set():
                    self._rebuild()
            except Exception as exc:  # never let the pump die: say what happened and go on
                self.problem.emit(unexpected(exc, "following the engine"))

    def _pump_jobs(self) -> None:
        """Each window's progress and text as it comes (a window takes seconds: a few signals at most), then,
        once the engine is done with the file, how it ended. The signals carry what the window needs, as the
        job may have left ``live_jobs`` by the time Qt delivers them."""
        for live in list(self.live_jobs.values()):
            for event in drain(live.handle.events, block=False):
                if event.kind == "started":
                    if live.started is None:
                        live.started = time.monotonic()
                    live.done, live.total = event.done, event.total
                    live.window_times = list(event.window_times)
                    live.duration = self._duration(live)
                    self.job_progress.emit(live.job_id, live.done, live.total)
                elif event.kind == "progress":  # a window finished (or, resuming, was decoded earlier)
                    live.done, live.total = event.done, event.total
                    self.job_progress.emit(live.job_id, live.done, live.total)
                    live.texts[event.index] = event.text
                    if live.timestamps and event.text:  # carried by the signal: the job may have ended by then
                        live.phrases[event.index] = [(s.start, s.end, s.text) for s in event.segments]
                        self.job_phrases.emit(live.job_id, event.index, live.phrases[event.index])
                    self.job_text.emit(live.job_id, event.index, event.text)
                elif event.terminal:
                    self._settle(live)
                    break

    def _duration(self, live: LiveJob) -> float | None:
        """The file's duration, which the engine recorded in the job as it read the file."""
        try:
            return self.jobs.get(live.job_id).duration
        except CadenceError:
            return None

    def _settle(self, live: LiveJob) -> None:
        """Record how a job ended and write its output files; the row changes once."""
        job_id = live.job_id
        try:
            if self._stop.is_set():
                return  # closing: the job stays unfinished in the store and resumes next time
            try:
                transcript = settle_job(self.jobs, job_id, live.handle, live.model)
            except CadenceError as exc:  # failed or cancelled, with its sentence recorded in its row
                try:
                    self.jobs.get(job_id)
                except CadenceError:  # its row is gone (removed meanwhile): say it where people look
                    if not live.remove_when_ended:
                        self.problem.emit(_named(live.name, str(exc), live.path))
                return
            job = self.jobs.get(job_id)
            try:
                outputs = write_outputs(job, transcript)
            except OSError as exc:
                self.jobs.failed(job_id, f"The transcript of {live.name} could not be written ({exc.strerror or exc}).")
                return
            self.jobs.finished(job_id, transcript.to_json() | {"model": live.model, "outputs": [str(p) for p in outputs]})
        finally:
            with self._lock:
                self.live_jobs.pop(job_id, None)
            if live.remove_when_ended:
                self.jobs.remove(job_id)
            self.job_changed.emit(job_id)
            self._feed()  # the next queued file takes its place

    def _pump_replies(self) -> None:
        for message_id, live in list(self.live_replies.items()):
            reply = live.reply
            events = coalesce(drain(reply.events, block=False))
            text_moved = False
            for event in events:
                if event.kind == "delta":
                    now = time.monotonic()
                    if live.first_delta is None:
                        live.first_delta = now
                    live.last_delta = now
                    live.tokens += len(event.tokens)
                    text_moved = True
                elif event.terminal:
                    with self._lock:
                        self.live_replies.pop(message_id, None)
                    self.reply_ended.emit(reply.conversation_id, message_id, reply.error or "")
                    text_moved = False
                    break
            if text_moved:
                self.reply_update.emit(reply.conversation_id, message_id, reply.text, live.tok_s)

    def _sample_status(self) -> None:
        engine = self.engine
        if engine is None or self.remote:  # a server's slots and metrics come from app.remote_status's poller
            self.last_status = {}  # (no slot of this computer's engine is shown for a server's request)
            return
        try:
            status = engine.status()
        except RuntimeError:  # a lane changed while it was read; the next sample will do
            return
        labels = {}
        for live in list(self.live_jobs.values()):
            labels[live.handle.id] = live.name
        for live in list(self.live_replies.values()):
            if live.reply.handle is not None:
                labels[live.reply.handle.id] = f"chat: {live.label}"
        status["labels"] = labels
        status["sampled_at"] = time.monotonic()
        self.last_status = status
        self.status_changed.emit(status)
