"""Stored conversations on the batched engine: many at once, streamed, kept in the SQLite store.

A conversation has a model, an optional system prompt, its own sampling settings and a tree of
messages: regenerating an answer or editing a message adds a sibling, and the active branch
follows the active child at each level (earlier answers stay, to flip between). Sending a
message stores it and an empty ``streaming`` answer first, then submits system prompt + active
branch + message to the engine; a thread per answer follows the engine's events, writes the text
so far (at most every :data:`FLUSH_SECONDS` or :data:`FLUSH_TOKENS` tokens, one UPDATE) and the
end state: ``complete`` (with stats), ``stopped`` (the user stopped it), ``failed`` (with the
sentence) or ``interrupted`` (the app closed mid-answer, or, found at start-up, the process
writing it died). A request the engine refuses (the model cannot load, the message does not
fit the context) leaves the store as it was.

Context limits are applied on the engine thread (:mod:`engine.requests`): the oldest turns are
left out when the history does not fit, and the answer's stats say how many. A conversation
about a transcript keeps the transcript in its context and puts it into the system prompt, cut
between segments (or words) to fit, with a notice saying so.

Consumers that cannot keep up with hundreds of deltas per second read coalesced events
(:func:`drain` + :func:`coalesce`, or :func:`follow`): whatever is pending arrives as one delta.
"""

from __future__ import annotations

import dataclasses
import json
import os
import queue
import re
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator

from engine.errors import CadenceError, RequestError, record_fault
from engine.models import DEFAULT_CHAT
from engine.sampling import SamplingParams
from engine.store import connect, db_path

MAX_MESSAGE_CHARS = 100_000  # far beyond any context here; keeps megabytes away from the tokenizer
FLUSH_SECONDS = 0.5  # a streaming answer's text is written at most this often ...
FLUSH_TOKENS = 128  # ... or after this many tokens
TITLE_CHARS = 60
CLOSE_WAIT_S = 5.0
DOCUMENT_CHUNK_CHARS = 80  # a plain-text transcript is cut between chunks of about this many characters
STATES = ("complete", "streaming", "stopped", "interrupted", "failed")
TRANSCRIPT_SYSTEM = ("You answer questions about the transcript of a recording, given below. Answer from what the "
                     "transcript says; when it does not say, say so.\n\nTranscript{notice}:\n{text}")


# ---------------------------------------------------------------------------- records
@dataclass
class Message:
    id: int
    conversation_id: int
    parent_id: int | None
    role: str  # user | assistant
    content: str
    state: str  # see STATES
    active: bool
    error: str | None = None
    stats: dict = field(default_factory=dict)
    created: float = 0.0
    updated: float = 0.0
    sibling_index: int = 0  # its place among the messages that follow the same parent (0-based)
    siblings: int = 1

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


@dataclass
class Conversation:
    id: int
    title: str
    model: str
    system: str | None
    params: SamplingParams
    context: dict | None
    created: float
    updated: float
    messages: list[Message] = field(default_factory=list)  # the active branch, first to last

    def to_json(self) -> dict:
        return {"id": self.id, "title": self.title, "model": self.model, "system": self.system,
                "params": dataclasses.asdict(self.params), "context": self.context, "created": self.created,
                "updated": self.updated, "messages": [m.to_json() for m in self.messages]}


# ---------------------------------------------------------------------------- checks
def check_message(text) -> str:
    """A message a user may send: text, not blank, at most MAX_MESSAGE_CHARS characters."""
    if not isinstance(text, str) or not text.strip():
        raise RequestError("The message is empty.")
    if len(text) > MAX_MESSAGE_CHARS:
        raise RequestError(f"The message is {len(text):,} characters long; a message can have at most "
                           f"{MAX_MESSAGE_CHARS:,}.")
    return text


def sampling_params(value=None) -> SamplingParams:
    """SamplingParams from None (the defaults), SamplingParams or a dict of its fields, validated."""
    if value is None:
        params = SamplingParams()
    elif isinstance(value, SamplingParams):
        params = dataclasses.replace(value, stop=list(value.stop))
    elif isinstance(value, dict):
        known = {f.name for f in dataclasses.fields(SamplingParams)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise RequestError(f"Unknown sampling setting '{unknown[0]}'.")
        params = SamplingParams(**value)
        params.stop = list(params.stop) if isinstance(params.stop, (list, tuple)) else params.stop
    else:
        raise RequestError("Sampling settings must be given as SamplingParams or a dict of them.")
    if params.seed is not None and (not isinstance(params.seed, int) or isinstance(params.seed, bool)):
        raise RequestError(f"The seed must be a whole number (got {params.seed}).")
    return params.validate()


def _check_model(name: str) -> None:
    from engine.models import CHAT, resolve

    source = resolve(name)
    if source.family != CHAT:
        raise CadenceError(f"{source.name} is not a chat model.")


def _title_of(text: str) -> str:
    line = " ".join(text.split())
    return line if len(line) <= TITLE_CHARS else line[: TITLE_CHARS - 1].rstrip() + "…"


# ---------------------------------------------------------------------------- coalescing
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


def coalesce(events: Iterable) -> list:
    """Consecutive delta events of one request merged into one (texts and tokens joined in order);
    every other event kept as it is, in its place."""
    out: list = []
    run: list = []

    def close_run():
        if len(run) == 1:
            out.append(run[0])
        elif run:
            out.append(dataclasses.replace(run[0], text="".join(e.text for e in run),
                                           tokens=[t for e in run for t in e.tokens]))
        run.clear()

    for event in events:
        if event.kind == "delta" and (not run or run[0].request_id == event.request_id):
            run.append(event)
            continue
        close_run()
        if event.kind == "delta":
            run.append(event)
        else:
            out.append(event)
    close_run()
    return out


def follow(events: queue.Queue) -> Iterator:
    """A handle's (or a reply's) events as they come, pending deltas merged into one, up to and
    including the terminal event: a slow reader gets fewer, longer deltas, never less text."""
    while True:
        for event in coalesce(drain(events)):
            yield event
            if event.terminal:
                return


# ---------------------------------------------------------------------------- the process writing an answer
def _process_mark() -> str:
    """'pid:start time' of this process, so a later process can tell whether it is still alive."""
    try:
        import psutil

        return f"{os.getpid()}:{psutil.Process().create_time():.3f}"
    except Exception:  # pragma: no cover - psutil comes with accelerate
        return f"{os.getpid()}:"


def _process_alive(mark: str | None) -> bool:
    if not mark:
        return False
    pid_text, _, started = mark.partition(":")
    try:
        pid = int(pid_text)
    except ValueError:
        return False
    try:
        import psutil
    except ImportError:  # pragma: no cover
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except OSError:
            return True
        return True
    try:
        process = psutil.Process(pid)
        if process.status() == psutil.STATUS_ZOMBIE:
            return False
        return not started or abs(process.create_time() - float(started)) < 0.01  # else the pid was reused
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:
        return True


# ---------------------------------------------------------------------------- transcripts
def _clock(seconds: float) -> str:
    seconds = int(round(seconds))
    h, rest = divmod(seconds, 3600)
    return f"{h}:{rest // 60:02d}:{rest % 60:02d}" if h else f"{rest // 60}:{rest % 60:02d}"


def transcript_context(doc: dict):
    """(number of parts, system_for(n), notice(n)) for a transcript kept in a conversation's context."""
    segments = [s for s in doc.get("segments") or [] if str(s[2]).strip()]
    if segments:
        pieces = [str(s[2]).strip() for s in segments]
        ends = [float(s[1]) for s in segments]
        total = float(doc.get("duration") or ends[-1])
        text = " ".join(pieces)
        offsets = [0]
        for piece in pieces:
            offsets.append(offsets[-1] + len(piece) + 1)

        def notice(n):
            return None if n >= len(pieces) else f"the first {_clock(ends[n - 1] if n else 0)} of {_clock(total)}"
    else:
        text = doc["text"]
        offsets, size = [0], 0
        for match in re.finditer(r"\S+\s*", text):
            size += len(match.group())
            if size >= DOCUMENT_CHUNK_CHARS:
                offsets.append(match.end())
                size = 0
        if offsets[-1] < len(text):
            offsets.append(len(text))
        pieces = offsets[1:]

        def notice(n):
            if n >= len(pieces):
                return None
            return f"the first {len(text[: offsets[n]].rstrip()):,} of {len(text.rstrip()):,} characters"

    def system_for(n: int) -> str:
        cut = notice(n)
        return TRANSCRIPT_SYSTEM.format(notice=f" (cut to {cut} to fit)" if cut else "",
                                        text=text[: offsets[n]].rstrip())

    return len(pieces), system_for, notice


# ---------------------------------------------------------------------------- a reply in flight
class Reply:
    """An answer being written: iterate it for text deltas (pending ones merged), ``wait()`` for the
    stored answer (a :class:`Message`), ``stop()`` to end it early (kept as ``stopped``)."""

    def __init__(self, conversation_id: int, user_message_id: int, message_id: int, model: str = ""):
        self.conversation_id = conversation_id
        self.model = model
        self.user_message_id = user_message_id
        self.message_id = message_id
        self.events: queue.Queue = queue.Queue()  # engine events as the store has them; a terminal one last
        self.handle = None
        self.result: dict | None = None  # the engine's result (text, tokens, finish_reason, stats)
        self.message: Message | None = None  # the stored answer once it ended
        self.error: str | None = None
        self.rejected = False  # the engine refused it; nothing of it was kept
        self.dropped_turns = 0
        self.notice: str | None = None  # e.g. that a transcript was cut to fit
        self.started_at: float | None = None  # perf_counter when the engine started it (model loaded)
        self._text: list[str] = []
        self._cancel_state: str | None = None
        self._lock = threading.Lock()
        self._ended = False
        self._read_to_end = False
        self._done = threading.Event()

    @property
    def text(self) -> str:
        """The answer so far."""
        return "".join(self._text)

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def stream(self) -> Iterator:
        """Events (started, coalesced deltas, and the terminal finished/failed) as they come; once
        the terminal event was read, there is nothing more to read."""
        if self._read_to_end:
            return
        for event in follow(self.events):
            if event.terminal:
                self._read_to_end = True
            yield event

    def __iter__(self) -> Iterator[str]:
        for event in self.stream():
            if event.kind == "delta" and event.text:
                yield event.text

    def wait(self, timeout: float | None = None) -> Message:
        """The stored answer once it ended (``complete``, ``stopped`` or ``interrupted``); a failed or
        refused answer raises CadenceError with its sentence."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"The answer {self.message_id} did not end within {timeout} s.")
        if self.error is not None:
            raise CadenceError(self.error)
        return self.message

    def stop(self) -> None:
        self._cancel("stopped")

    def _cancel(self, state: str) -> None:
        if self._cancel_state is None:
            self._cancel_state = state
        if self.handle is not None:
            self.handle.cancel()


# ---------------------------------------------------------------------------- the store of conversations
class Conversations:
    """Conversations in the Cadence store, answered by ``engine`` (None: read and edit only).
    Safe to use from several threads (one store connection each). Opening it marks answers left
    ``streaming`` by a process that no longer runs as ``interrupted`` (their text kept)."""

    def __init__(self, engine=None, path: str | Path | None = None):
        self.engine = engine
        self.path = Path(path or db_path())
        self._mark = _process_mark()
        self._lock = threading.Lock()
        self._replies: dict[int, Reply] = {}  # answer message id -> its reply in flight
        self._busy: set[int] = set()  # conversations with an answer in flight
        connect(self.path)  # create or upgrade the store now, on the caller's thread
        self.recovered = self.recover()

    @property
    def _db(self):
        return connect(self.path)

    @contextmanager
    def _transaction(self):
        db = self._db
        db.execute("BEGIN IMMEDIATE")
        try:
            yield db
        except BaseException:
            db.execute("ROLLBACK")
            raise
        db.execute("COMMIT")

    # ------------------------------------------------------------------ start-up
    def recover(self) -> int:
        """Mark answers left ``streaming`` by processes that are gone as ``interrupted``; how many."""
        rows = self._db.execute("SELECT id, writer FROM messages WHERE state = 'streaming'").fetchall()
        dead = [row["id"] for row in rows if not _process_alive(row["writer"])]
        if dead:
            with self._transaction() as db:
                for message_id in dead:
                    db.execute("UPDATE messages SET state = 'interrupted', writer = NULL, updated = ? "
                               "WHERE id = ? AND state = 'streaming'", (time.time(), message_id))
        return len(dead)

    # ------------------------------------------------------------------ conversations
    def create(self, model: str = DEFAULT_CHAT, system: str | None = None, params=None, title: str = "",
               context: dict | None = None) -> int:
        """A new, empty conversation; its id. Settings are checked before anything is stored."""
        params = sampling_params(params)
        system = self._check_system(system)
        _check_model(model)
        now = time.time()
        cur = self._db.execute(
            "INSERT INTO conversations (title, model, system, params, context, created, updated) "
            "VALUES (?, ?, ?, ?, ?, ?, ?)",
            (title or "", model, system, json.dumps(dataclasses.asdict(params)),
             json.dumps(context, ensure_ascii=False) if context is not None else None, now, now))
        return int(cur.lastrowid)

    def update(self, conversation_id: int, *, title: str | None = None, model: str | None = None,
               system: str | None = None, params=None) -> Conversation:
        """Change a conversation's settings (for its next answers); ``system=''`` removes the system prompt."""
        conv = self.get(conversation_id)
        values: dict = {}
        if title is not None:
            values["title"] = title
        if system is not None:
            values["system"] = self._check_system(system)
        refit = False
        if params is not None:
            params = sampling_params(params)
            values["params"] = json.dumps(dataclasses.asdict(params))
            refit = params.max_tokens != conv.params.max_tokens  # the room for the prompt changes
        if model is not None and model != conv.model:
            _check_model(model)
            values["model"] = model
            refit = True
        transcript = (conv.context or {}).get("transcript")
        if transcript and refit:  # cut the transcript again, for the new model or room, on the next answer
            values["context"] = json.dumps(conv.context | {"transcript": transcript | {"fitted": False}},
                                           ensure_ascii=False)
        if values:
            values["updated"] = time.time()
            names = ", ".join(f"{k} = ?" for k in values)
            self._db.execute(f"UPDATE conversations SET {names} WHERE id = ?", (*values.values(), conversation_id))
        return self.get(conversation_id)

    @staticmethod
    def _check_system(system: str | None) -> str | None:
        if system is not None and not isinstance(system, str):
            raise RequestError("The system prompt must be text.")
        if system is None or not system.strip():
            return None
        if len(system) > MAX_MESSAGE_CHARS:
            raise RequestError(f"The system prompt is {len(system):,} characters long; it can have at most "
                               f"{MAX_MESSAGE_CHARS:,}.")
        return system

    def list(self) -> list[dict]:
        """Every conversation, most recently updated first: id, title, model, messages (all stored,
        earlier answers included), created, updated."""
        rows = self._db.execute(
            "SELECT c.id, c.title, c.model, c.created, c.updated, COUNT(m.id) AS messages FROM conversations c "
            "LEFT JOIN messages m ON m.conversation_id = c.id GROUP BY c.id ORDER BY c.updated DESC, c.id DESC")
        return [dict(row) for row in rows]

    def get(self, conversation_id: int) -> Conversation:
        """The conversation with its active branch of messages."""
        row = self._db.execute("SELECT * FROM conversations WHERE id = ?", (conversation_id,)).fetchone()
        if row is None:
            raise CadenceError(f"There is no conversation {conversation_id}.")
        return Conversation(
            id=row["id"], title=row["title"], model=row["model"], system=row["system"],
            params=SamplingParams(**json.loads(row["params"] or "{}")),
            context=json.loads(row["context"]) if row["context"] else None,
            created=row["created"], updated=row["updated"], messages=_branch(self._messages(conversation_id)))

    def delete(self, conversation_id: int) -> None:
        """Delete a conversation and all its messages (an answer in flight is stopped)."""
        self.get(conversation_id)
        for reply in self._replies_where(lambda r: r.conversation_id == conversation_id):
            reply._cancel("stopped")
        with self._transaction() as db:
            # Unlink first, so deleting a long chain is not one cascade per level.
            db.execute("UPDATE messages SET parent_id = NULL WHERE conversation_id = ?", (conversation_id,))
            db.execute("DELETE FROM messages WHERE conversation_id = ?", (conversation_id,))
            db.execute("DELETE FROM conversations WHERE id = ?", (conversation_id,))

    # ------------------------------------------------------------------ messages
    def message(self, message_id: int) -> Message:
        row = self._db.execute("SELECT * FROM messages WHERE id = ?", (message_id,)).fetchone()
        if row is None:
            raise CadenceError(f"There is no message {message_id}.")
        return _message(row)

    def _messages(self, conversation_id: int) -> list[Message]:
        rows = self._db.execute("SELECT * FROM messages WHERE conversation_id = ? ORDER BY id", (conversation_id,))
        return [_message(row) for row in rows]

    def _path_to(self, message_id: int | None) -> list[Message]:
        """The messages from the first to ``message_id`` (inclusive), following parents."""
        if message_id is None:
            return []
        by_id = {m.id: m for m in self._messages(self.message(message_id).conversation_id)}
        path, node = [], by_id.get(message_id)
        while node is not None:
            path.append(node)
            node = by_id.get(node.parent_id)
        return path[::-1]

    def siblings(self, message_id: int) -> list[Message]:
        """The message and the others that follow the same parent (earlier answers, edits), oldest first."""
        msg = self.message(message_id)
        rows = self._db.execute("SELECT * FROM messages WHERE conversation_id = ? AND parent_id IS ? ORDER BY id",
                                (msg.conversation_id, msg.parent_id)).fetchall()
        out = [_message(row) for row in rows]
        for i, m in enumerate(out):
            m.sibling_index, m.siblings = i, len(out)
        return out

    def choose(self, message_id: int) -> Conversation:
        """Make this message (and the branch through it) the active one."""
        msg = self.message(message_id)
        with self._transaction() as db:
            _activate(db, message_id)
        return self.get(msg.conversation_id)

    def delete_message(self, message_id: int) -> None:
        """Delete a message and everything that follows it (answers in flight there are stopped)."""
        msg = self.message(message_id)
        messages = self._messages(msg.conversation_id)
        doomed, frontier = {message_id}, [message_id]
        while frontier:
            parent = frontier.pop()
            for m in messages:
                if m.parent_id == parent and m.id not in doomed:
                    doomed.add(m.id)
                    frontier.append(m.id)
        for reply in self._replies_where(lambda r: r.message_id in doomed):
            reply._cancel("stopped")
        ids = sorted(doomed)
        with self._transaction() as db:
            for start in range(0, len(ids), 500):
                chunk = ids[start : start + 500]
                marks = ", ".join("?" * len(chunk))
                db.execute(f"UPDATE messages SET parent_id = NULL WHERE id IN ({marks})", chunk)
                db.execute(f"DELETE FROM messages WHERE id IN ({marks})", chunk)
            db.execute("UPDATE conversations SET updated = ? WHERE id = ?", (time.time(), msg.conversation_id))

    # ------------------------------------------------------------------ answering
    def start(self, text: str, model: str = DEFAULT_CHAT, system: str | None = None, params=None, title: str = "",
              context: dict | None = None) -> Reply:
        """A new conversation with its first message, answered: one step. If the engine refuses the
        request, the conversation is not kept either."""
        check_message(text)
        self._need_engine()
        conversation_id = self.create(model, system, params, title, context)
        try:
            return self._answer(self.get(conversation_id), text=text, parent_id=None, history=[], new_conversation=True)
        except BaseException:
            self._db.execute("DELETE FROM conversations WHERE id = ?", (conversation_id,))  # if still there
            raise

    def send(self, conversation_id: int, text: str) -> Reply:
        """Add a user message at the end of the active branch and stream the answer."""
        check_message(text)
        self._need_engine()
        conv = self.get(conversation_id)
        parent = conv.messages[-1].id if conv.messages else None
        return self._answer(conv, text=text, parent_id=parent, history=conv.messages)

    def regenerate(self, message_id: int) -> Reply:
        """A new answer beside an earlier one (which is kept: see :meth:`siblings`, :meth:`choose`)."""
        self._need_engine()
        msg = self.message(message_id)
        if msg.role != "assistant" or msg.parent_id is None:
            raise RequestError("Only an answer can be regenerated; edit a message of yours instead.")
        conv = self.get(msg.conversation_id)
        path = self._path_to(msg.parent_id)
        return self._answer(conv, text=None, parent_id=msg.parent_id, history=path)

    def edit(self, message_id: int, text: str) -> Reply:
        """A new version of one of the user's messages (beside the old one), answered from there."""
        check_message(text)
        self._need_engine()
        msg = self.message(message_id)
        if msg.role != "user":
            raise RequestError("Only your own messages can be edited; regenerate an answer instead.")
        conv = self.get(msg.conversation_id)
        return self._answer(conv, text=text, parent_id=msg.parent_id, history=self._path_to(msg.parent_id))

    def stop(self, message_id: int) -> bool:
        """Stop an answer being written by this process (kept as ``stopped``); False if none is."""
        with self._lock:
            reply = self._replies.get(message_id)
        if reply is None:
            return False
        reply.stop()
        return True

    def replies(self) -> list[Reply]:
        """Answers in flight in this process."""
        return self._replies_where(lambda r: True)

    def close(self, state: str = "interrupted", timeout: float = CLOSE_WAIT_S) -> None:
        """End every answer in flight (kept with its text so far as ``state``: ``interrupted`` when the
        app goes away, ``stopped`` when the user stopped it), waiting up to ``timeout`` s for each."""
        replies = self.replies()
        for reply in replies:
            reply._cancel(state)
        deadline = time.monotonic() + timeout
        for reply in replies:
            reply._done.wait(max(0.0, deadline - time.monotonic()))
        for reply in replies:
            if not reply.done:  # the engine did not answer in time (e.g. still loading the model)
                self._end(reply, state, content=reply.text, error=None, stats=None)
                with self._lock:
                    self._replies.pop(reply.message_id, None)
                    self._busy.discard(reply.conversation_id)

    def _need_engine(self) -> None:
        if self.engine is None:
            raise CadenceError("These conversations are open without an engine, so nothing can be answered.")

    def _replies_where(self, keep) -> list[Reply]:
        with self._lock:
            return [r for r in self._replies.values() if keep(r)]

    def _answer(self, conv: Conversation, text: str | None, parent_id: int | None, history: list[Message],
                new_conversation: bool = False) -> Reply:
        """Store the user's message (``text``, after ``parent_id``; None: answer ``parent_id`` again)
        and an empty streaming answer, make them the active branch, and submit the request."""
        from engine.engine import ChatRequest
        from engine.requests import DocumentChatRequest

        with self._lock:
            if conv.id in self._busy:
                raise RequestError("An answer is still being written in this conversation; stop it or wait for it.")
            self._busy.add(conv.id)
        try:
            now = time.time()
            with self._transaction() as db:
                if text is not None:
                    user_id = _insert(db, conv.id, parent_id, "user", text, "complete", None, now)
                    prompt = text
                else:  # answer parent_id (the last of history) again
                    user_id, prompt, history = parent_id, history[-1].content, history[:-1]
                answer_id = _insert(db, conv.id, user_id, "assistant", "", "streaming", self._mark, now)
                changes = _activate(db, answer_id)  # the new rows and the branch to them become the active one
                title = conv.title or _title_of(prompt)
                db.execute("UPDATE conversations SET title = ?, updated = ? WHERE id = ?", (title, now, conv.id))
            undo = {"conversation_id": conv.id, "new_conversation": new_conversation, "answer_id": answer_id,
                    "user_id": user_id if text is not None else None, "changes": changes, "title": conv.title,
                    "updated": conv.updated}
            turns = [{"role": m.role, "content": m.content} for m in history
                     if m.role == "user" or (m.state != "failed" and m.content.strip())]
            transcript = (conv.context or {}).get("transcript")
            if transcript and not transcript.get("fitted"):
                parts, system_for, _ = transcript_context(transcript)
                request = DocumentChatRequest(prompt=prompt, history=turns, model=conv.model, params=conv.params,
                                              parts=parts, system_for=system_for)
            else:
                request = ChatRequest(prompt=prompt, system=conv.system, history=turns, model=conv.model,
                                      params=conv.params)
            reply = Reply(conv.id, user_id, answer_id, conv.model)
            with self._lock:
                self._replies[answer_id] = reply
            try:
                reply.handle = self.engine.submit(request)
            except BaseException:
                self._undo(undo)
                with self._lock:
                    self._replies.pop(answer_id, None)
                raise
        except BaseException:
            with self._lock:
                self._busy.discard(conv.id)
            raise
        threading.Thread(target=self._pump, args=(reply, undo), name=f"cadence-answer-{answer_id}", daemon=True).start()
        return reply

    # ------------------------------------------------------------------ following an answer (its own thread)
    def _pump(self, reply: Reply, undo: dict) -> None:
        try:
            last_write, pending = time.monotonic(), 0
            for event in reply.handle:
                if event.kind == "started":
                    reply.started_at = time.perf_counter()
                    info = event.result or {}
                    reply.dropped_turns = int(info.get("dropped_turns") or 0)
                    if "system" in info:
                        self._fitted_document(reply, info)
                    reply.events.put(event)
                elif event.kind == "delta":
                    reply._text.append(event.text)
                    reply.events.put(event)
                    pending += len(event.tokens)
                    now = time.monotonic()
                    if event.text and (now - last_write >= FLUSH_SECONDS or pending >= FLUSH_TOKENS):
                        self._write_partial(reply)
                        last_write, pending = now, 0
                elif event.kind == "finished":
                    result = event.result
                    reply.result = result
                    state = "complete" if result["finish_reason"] != "cancelled" else (reply._cancel_state or "stopped")
                    stats = {**result.get("stats", {}), "finish_reason": result["finish_reason"],
                             "dropped_turns": result.get("dropped_turns", reply.dropped_turns), "model": reply.model}
                    self._end(reply, state, content=result["text"], error=None, stats=stats)
                elif event.kind == "failed":
                    if reply.started_at is None:  # refused: keep nothing of it
                        self._refuse(reply, undo, event)
                    elif reply._cancel_state == "interrupted":  # the app is closing
                        self._end(reply, "interrupted", content=reply.text, error=None, stats=None)
                    else:
                        self._end(reply, "failed", content=reply.text, error=event.message, stats=None)
        except Exception as exc:  # the store failed under us: say so rather than hang the reader
            sentence = f"The answer could not be stored ({exc.__class__.__name__}: {exc}); details are in {record_fault(exc)}."
            with reply._lock:
                if not reply._ended:
                    reply._ended = True
                    reply.error = sentence
                    reply.events.put(_terminal("failed", reply, message=sentence))
        finally:
            with self._lock:
                self._replies.pop(reply.message_id, None)
                self._busy.discard(reply.conversation_id)
            reply._done.set()

    def _write_partial(self, reply: Reply) -> None:
        with reply._lock:
            if not reply._ended:
                self._db.execute("UPDATE messages SET content = ?, updated = ? WHERE id = ? AND state = 'streaming'",
                                 (reply.text, time.time(), reply.message_id))

    def _end(self, reply: Reply, state: str, content: str, error: str | None, stats: dict | None) -> None:
        """Write how an answer ended, then tell its reader (once, whoever gets here first)."""
        with reply._lock:
            if reply._ended:
                return
            reply._ended = True
            now = time.time()
            with self._transaction() as db:
                db.execute("UPDATE messages SET content = ?, state = ?, error = ?, stats = ?, writer = NULL, updated = ? "
                           "WHERE id = ?", (content, state, error, json.dumps(stats) if stats is not None else None,
                                            now, reply.message_id))
                db.execute("UPDATE conversations SET updated = ? WHERE id = ?", (now, reply.conversation_id))
            row = self._db.execute("SELECT * FROM messages WHERE id = ?", (reply.message_id,)).fetchone()
            reply.message = _message(row) if row is not None else None
            if state == "failed":
                reply.error = error
            elif reply.message is None:
                reply.error = "The conversation was deleted while the answer was being written."
            reply.events.put(_terminal("failed" if reply.error else "finished", reply, message=reply.error or "",
                                       result=reply.message))

    def _refuse(self, reply: Reply, undo: dict, event) -> None:
        with reply._lock:
            if reply._ended:
                return
            reply._ended = True
            self._undo(undo)
            reply.rejected = True
            reply.error = event.message
            reply.events.put(_terminal("failed", reply, message=event.message))

    def _undo(self, undo: dict) -> None:
        """Put the store back as it was before an answer the engine refused."""
        with self._transaction() as db:
            db.execute("DELETE FROM messages WHERE id = ?", (undo["answer_id"],))
            if undo["user_id"] is not None:
                db.execute("DELETE FROM messages WHERE id = ?", (undo["user_id"],))
            for message_id, active in undo["changes"]:
                db.execute("UPDATE messages SET active = ? WHERE id = ?", (active, message_id))
            if undo["new_conversation"]:
                db.execute("DELETE FROM conversations WHERE id = ?", (undo["conversation_id"],))
            else:
                db.execute("UPDATE conversations SET title = ?, updated = ? WHERE id = ?",
                           (undo["title"], undo["updated"], undo["conversation_id"]))

    def _fitted_document(self, reply: Reply, info: dict) -> None:
        """The transcript was cut (or not) to fit: keep the system prompt used and the notice."""
        conv = self.get(reply.conversation_id)
        transcript = dict((conv.context or {}).get("transcript") or {})
        parts, _, notice = transcript_context(transcript)
        used = int(info.get("document_parts") or 0)
        cut = notice(used)
        reply.notice = f"The transcript was cut to {cut} to fit this model's context." if cut else None
        transcript.update(fitted=True, parts_used=used, parts=parts, notice=reply.notice)
        self._db.execute("UPDATE conversations SET system = ?, context = ? WHERE id = ?",
                         (info["system"], json.dumps((conv.context or {}) | {"transcript": transcript},
                                                     ensure_ascii=False), reply.conversation_id))

    # ------------------------------------------------------------------ transcripts
    def create_about_transcript(self, transcript, instruction: str | None = None, *, model: str = DEFAULT_CHAT,
                                params=None, title: str = "", job_id: int | None = None):
        """A conversation about a transcript: its text (a str, an engine.transcript.Transcript, its
        JSON dict, or the id of a finished transcription job) goes into the system prompt, cut to fit
        with a notice (``Reply.notice``, and the conversation's context). With an ``instruction``
        ("Summarize this.") the first answer starts at once. Returns (conversation id, Reply or None)."""
        doc = self._transcript(transcript, job_id)
        name = Path(doc["file"]).name if doc.get("file") else ""
        title = title or (f"About {name}" if name else "About a transcript")
        context = {"transcript": doc | {"fitted": False}}
        if not doc["text"].strip():
            raise RequestError("The transcript is empty.")
        if instruction is None:
            return self.create(model, None, params, title, context), None
        reply = self.start(instruction, model=model, params=params, title=title, context=context)
        return reply.conversation_id, reply

    def _transcript(self, transcript, job_id: int | None) -> dict:
        if isinstance(transcript, int) and not isinstance(transcript, bool):
            from engine.jobs import JobStore

            job = JobStore(self.path).get(transcript)
            if job.state != "done" or not job.result:
                raise CadenceError(f"Transcription job {transcript} has not finished, so there is no transcript yet.")
            job_id, transcript = transcript, job.result
        if isinstance(transcript, str):
            return {"job_id": job_id, "file": None, "text": transcript, "segments": None, "duration": None}
        data = transcript.to_json() if hasattr(transcript, "to_json") else transcript
        if not isinstance(data, dict) or not isinstance(data.get("text"), str):
            raise RequestError("A transcript must be text, a transcript or a transcription job id.")
        segments = [[float(s["start"]), float(s["end"]), str(s["text"])] for s in data.get("segments") or []]
        return {"job_id": job_id, "file": data.get("file"), "text": data["text"], "segments": segments or None,
                "duration": data.get("duration")}

    # ------------------------------------------------------------------ export
    def export(self, conversation_id: int, fmt: str = "md") -> str:
        """The conversation as Markdown (the active branch, readable) or JSON (everything: the active
        branch in ``messages``, earlier answers and edits in ``other_messages``)."""
        if fmt not in ("md", "json"):
            raise RequestError(f"Conversations export to md or json (not '{fmt}').")
        conv = self.get(conversation_id)
        if fmt == "json":
            on_branch = {m.id for m in conv.messages}
            data = conv.to_json()
            data["other_messages"] = [m.to_json() for m in self._messages(conversation_id) if m.id not in on_branch]
            return json.dumps(data, ensure_ascii=False, indent=2)
        return _markdown(conv)


# ---------------------------------------------------------------------------- helpers
def _message(row) -> Message:
    return Message(id=row["id"], conversation_id=row["conversation_id"], parent_id=row["parent_id"], role=row["role"],
                   content=row["content"], state=row["state"], active=bool(row["active"]), error=row["error"],
                   stats=json.loads(row["stats"]) if row["stats"] else {}, created=row["created"],
                   updated=row["updated"])


def _branch(messages: list[Message]) -> list[Message]:
    """The active branch: from the first message, the active child at each level (else the newest)."""
    children: dict[int | None, list[Message]] = {}
    for m in messages:
        children.setdefault(m.parent_id, []).append(m)
    path, parent = [], None
    while children.get(parent):
        kids = children[parent]
        chosen = next((k for k in reversed(kids) if k.active), kids[-1])
        chosen.sibling_index, chosen.siblings = kids.index(chosen), len(kids)
        path.append(chosen)
        parent = chosen.id
    return path


def _insert(db, conversation_id, parent_id, role, content, state, writer, now) -> int:
    cur = db.execute("INSERT INTO messages (conversation_id, parent_id, role, content, state, active, writer, created, "
                     "updated) VALUES (?, ?, ?, ?, ?, 1, ?, ?, ?)",
                     (conversation_id, parent_id, role, content, state, writer, now, now))
    return int(cur.lastrowid)


def _activate(db, message_id: int) -> list[tuple[int, int]]:
    """Make the message the active child at its level, and so up to the first message; return the
    (id, previous active) of every row changed."""
    changes = []
    node = db.execute("SELECT id, parent_id, conversation_id FROM messages WHERE id = ?", (message_id,)).fetchone()
    while node is not None:
        for sibling in db.execute("SELECT id, active FROM messages WHERE conversation_id = ? AND parent_id IS ?",
                                  (node["conversation_id"], node["parent_id"])).fetchall():
            want = 1 if sibling["id"] == node["id"] else 0
            if sibling["active"] != want:
                changes.append((sibling["id"], sibling["active"]))
                db.execute("UPDATE messages SET active = ? WHERE id = ?", (want, sibling["id"]))
        if node["parent_id"] is None:
            break
        node = db.execute("SELECT id, parent_id, conversation_id FROM messages WHERE id = ?",
                          (node["parent_id"],)).fetchone()
    return changes


def _terminal(kind: str, reply: Reply, message: str = "", result=None):
    from engine.engine import Event

    return Event(kind, reply.handle.id if reply.handle is not None else 0, message=message, result=result)


def _when(stamp: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(stamp))


def _markdown(conv: Conversation) -> str:
    defaults = dataclasses.asdict(SamplingParams())
    changed = {k: v for k, v in dataclasses.asdict(conv.params).items() if v != defaults[k]}
    lines = [f"# {conv.title or f'Conversation {conv.id}'}", "",
             f"- Model: {conv.model}", f"- Created: {_when(conv.created)}; updated: {_when(conv.updated)}",
             "- Sampling: " + (", ".join(f"{k.replace('_', ' ')} {v}" for k, v in changed.items()) or "defaults (greedy)")]
    transcript = (conv.context or {}).get("transcript")
    if transcript:
        about = transcript.get("file") or (f"transcription job {transcript['job_id']}" if transcript.get("job_id")
                                           else "a transcript")
        lines.append(f"- About: {about}" + (f" ({transcript['notice']})" if transcript.get("notice") else ""))
    if conv.system:
        lines += ["", "## System", "", conv.system]
    for m in conv.messages:
        heading = "You" if m.role == "user" else "Assistant"
        if m.siblings > 1:
            heading += f" (version {m.sibling_index + 1} of {m.siblings})"
        lines += ["", f"## {heading}", "", m.content]
        if m.state == "failed":
            lines += ["", f"*(failed: {m.error})*"]
        elif m.state in ("stopped", "interrupted", "streaming"):
            lines += ["", {"stopped": "*(stopped)*", "interrupted": "*(interrupted: the answer was cut off)*",
                           "streaming": "*(still being written)*"}[m.state]]
        if m.role == "assistant" and m.stats.get("dropped_turns"):
            lines += ["", f"*({m.stats['dropped_turns']} earlier turns were left out to fit the context)*"]
    return "\n".join(lines) + "\n"


__all__ = ["Conversations", "Conversation", "Message", "Reply", "check_message", "sampling_params", "drain",
           "coalesce", "follow", "MAX_MESSAGE_CHARS", "STATES"]
