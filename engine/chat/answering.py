"""Answering stored conversations on the batched engine: many at once, streamed, kept as written.

Sending a message stores it and an empty ``streaming`` answer first, then submits system prompt +
active branch + message to the engine; a thread per answer follows the engine's events, writes the
text so far (at most every :data:`FLUSH_SECONDS` or :data:`FLUSH_TOKENS` tokens, one UPDATE) and
the end state: ``complete`` (with stats), ``stopped`` (the user stopped it), ``failed`` (with the
sentence) or ``interrupted`` (the app closed mid-answer, or, found at start-up, the process writing
it died). A request the engine refuses (the model cannot load, the message does not fit the
context) leaves the store as it was.

Context limits are applied on the engine thread (:mod:`engine.chat.run`): the oldest turns are left
out when the history does not fit, and the answer's stats say how many. A conversation about a
transcript (:mod:`engine.chat.document`) puts it into the system prompt, cut to fit with a notice.
"""

from __future__ import annotations

import json
import queue
import threading
import time
from pathlib import Path
from typing import Iterator

from engine.api import ChatAnswer, ChatRequest, DocumentChatRequest, Failed, Finished, follow
from engine.chat.document import fitted_transcript, transcript_context, transcript_document
from engine.chat.store import (
    Conversation,
    ConversationStore,
    Message,
    activate,
    insert_message,
    message_of,
    title_of,
    check_message,
)
from engine.errors import CadenceError, RequestError, record_fault
from engine.models import DEFAULT_CHAT

FLUSH_SECONDS = 0.5  # a streaming answer's text is written at most this often ...
FLUSH_TOKENS = 128  # ... or after this many tokens
CLOSE_WAIT_S = 5.0


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
        self.result: ChatAnswer | None = None  # the engine's result
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
    def request_id(self) -> int:
        return self.handle.id if self.handle is not None else 0

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


# ---------------------------------------------------------------------------- answering
class Conversations(ConversationStore):
    """Stored conversations answered by ``engine`` (None: read and edit only, as the store)."""

    def __init__(self, engine=None, path: str | Path | None = None):
        self.engine = engine
        self._lock = threading.Lock()
        self._replies: dict[int, Reply] = {}  # answer message id -> its reply in flight
        self._busy: set[int] = set()  # conversations with an answer in flight
        super().__init__(path)

    def _stop_answers(self, which) -> None:
        for reply in self._replies_where(which):
            reply._cancel("stopped")

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

    def _check_model(self, model: str) -> None:
        """Answered by a server (engine.remote), a model is whatever name it serves: the server says if not."""
        if getattr(self.engine, "remote", False):
            if not isinstance(model, str) or not model.strip():
                raise RequestError("Name the model the server should answer with.")
            return
        super()._check_model(model)

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

        with self._lock:
            if conv.id in self._busy:
                raise RequestError("An answer is still being written in this conversation; stop it or wait for it.")
            self._busy.add(conv.id)
        try:
            now = time.time()
            with self._transaction() as db:
                if text is not None:
                    user_id = insert_message(db, conv.id, parent_id, "user", text, "complete", None, now)
                    prompt = text
                else:  # answer parent_id (the last of history) again
                    user_id, prompt, history = parent_id, history[-1].content, history[:-1]
                answer_id = insert_message(db, conv.id, user_id, "assistant", "", "streaming", self._mark, now)
                changes = activate(db, answer_id)  # the new rows and the branch to them become the active one
                title = conv.title or title_of(prompt)
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
                    reply.dropped_turns = event.fitting.dropped_turns
                    if event.fitting.document_parts is not None:
                        self._fitted_document(reply, event.fitting)
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
                    answer: ChatAnswer = event.answer
                    reply.result = answer
                    state = "complete" if answer.finish_reason != "cancelled" else (reply._cancel_state or "stopped")
                    stats = {**answer.stats, "finish_reason": answer.finish_reason,
                             "dropped_turns": answer.fitting.dropped_turns, "model": reply.model}
                    self._end(reply, state, content=answer.text, error=None, stats=stats)
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
                    reply.events.put(Failed(reply.request_id, message=sentence))
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
            reply.message = message_of(row) if row is not None else None
            if state == "failed":
                reply.error = error
            elif reply.message is None:
                reply.error = "The conversation was deleted while the answer was being written."
            reply.events.put(Failed(reply.request_id, message=reply.error) if reply.error
                             else Finished(reply.request_id, answer=reply.result))

    def _refuse(self, reply: Reply, undo: dict, event) -> None:
        with reply._lock:
            if reply._ended:
                return
            reply._ended = True
            self._undo(undo)
            reply.rejected = True
            reply.error = event.message
            reply.events.put(Failed(reply.request_id, message=event.message))

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

    def _fitted_document(self, reply: Reply, fitting) -> None:
        """The transcript was cut (or not) to fit: keep the system prompt used and the notice."""
        conv = self.get(reply.conversation_id)
        transcript = fitted_transcript((conv.context or {}).get("transcript") or {}, fitting.document_parts)
        reply.notice = transcript["notice"]
        self._db.execute("UPDATE conversations SET system = ?, context = ? WHERE id = ?",
                         (fitting.system, json.dumps((conv.context or {}) | {"transcript": transcript},
                                                     ensure_ascii=False), reply.conversation_id))

    # ------------------------------------------------------------------ transcripts
    def create_about_transcript(self, transcript, instruction: str | None = None, *, model: str = DEFAULT_CHAT,
                                params=None, title: str = "", job_id: int | None = None):
        """A conversation about a transcript: its text (a str, an engine.transcript.Transcript, its
        JSON dict, or the id of a finished transcription job) goes into the system prompt, cut to fit
        with a notice (``Reply.notice``, and the conversation's context). With an ``instruction``
        ("Summarize this.") the first answer starts at once. Returns (conversation id, Reply or None)."""
        doc = transcript_document(transcript, job_id, self.path)
        name = Path(doc["file"]).name if doc.get("file") else ""
        title = title or (f"About {name}" if name else "About a transcript")
        context = {"transcript": doc | {"fitted": False}}
        if not doc["text"].strip():
            raise RequestError("The transcript is empty.")
        if instruction is None:
            return self.create(model, None, params, title, context), None
        reply = self.start(instruction, model=model, params=params, title=title, context=context)
        return reply.conversation_id, reply
