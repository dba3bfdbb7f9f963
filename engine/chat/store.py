"""The store of conversations: records, checks and edits, in the Cadence SQLite store.

A conversation has a model, an optional system prompt, its own sampling settings and a tree of
messages: regenerating an answer or editing a message adds a sibling, and the active branch
follows the active child at each level (earlier answers stay, to flip between). This module reads
and edits that tree; answering (:mod:`engine.chat.answering`) adds the engine. Opening the store
marks answers left ``streaming`` by a process that no longer runs as ``interrupted``.
"""

from __future__ import annotations

import dataclasses
import json
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from engine.errors import CadenceError, RequestError
from engine.models import DEFAULT_CHAT
from engine.processes import process_alive, process_mark
from engine.sampling import SamplingParams
from engine.store import connect, db_path

MAX_MESSAGE_CHARS = 100_000  # far beyond any context here; keeps megabytes away from the tokenizer
TITLE_CHARS = 60
STATES = ("complete", "streaming", "stopped", "interrupted", "failed")


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


def check_chat_model(name: str) -> None:
    from engine.models import CHAT, resolve

    source = resolve(name)
    if source.family != CHAT:
        raise CadenceError(f"{source.name} is not a chat model.")


def title_of(text: str) -> str:
    line = " ".join(text.split())
    return line if len(line) <= TITLE_CHARS else line[: TITLE_CHARS - 1].rstrip() + "…"


# ---------------------------------------------------------------------------- the store
class ConversationStore:
    """Conversations in the Cadence store, read and edited (answering them: :class:`Conversations`).
    Safe to use from several threads (one store connection each). Opening it marks answers left
    ``streaming`` by a process that no longer runs as ``interrupted`` (their text kept)."""

    def __init__(self, path: str | Path | None = None):
        self.path = Path(path or db_path())
        self._mark = process_mark()
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

    def _stop_answers(self, which) -> None:
        """Stop the answers in flight that ``which`` selects (a store without an engine has none)."""

    def _check_model(self, model: str) -> None:
        """A model this computer has, and a chat model (a store answered by a server checks less: see Conversations)."""
        check_chat_model(model)

    # ------------------------------------------------------------------ start-up
    def recover(self) -> int:
        """Mark answers left ``streaming`` by processes that are gone as ``interrupted``; how many."""
        rows = self._db.execute("SELECT id, writer FROM messages WHERE state = 'streaming'").fetchall()
        dead = [row["id"] for row in rows if not process_alive(row["writer"])]
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
        self._check_model(model)
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
            self._check_model(model)
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
            created=row["created"], updated=row["updated"], messages=_branch(self.messages(conversation_id)))

    def delete(self, conversation_id: int) -> None:
        """Delete a conversation and all its messages (an answer in flight is stopped)."""
        self.get(conversation_id)
        self._stop_answers(lambda r: r.conversation_id == conversation_id)
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
        return message_of(row)

    def messages(self, conversation_id: int) -> list[Message]:
        rows = self._db.execute("SELECT * FROM messages WHERE conversation_id = ? ORDER BY id", (conversation_id,))
        return [message_of(row) for row in rows]

    def _path_to(self, message_id: int | None) -> list[Message]:
        """The messages from the first to ``message_id`` (inclusive), following parents."""
        if message_id is None:
            return []
        by_id = {m.id: m for m in self.messages(self.message(message_id).conversation_id)}
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
        out = [message_of(row) for row in rows]
        for i, m in enumerate(out):
            m.sibling_index, m.siblings = i, len(out)
        return out

    def choose(self, message_id: int) -> Conversation:
        """Make this message (and the branch through it) the active one."""
        msg = self.message(message_id)
        with self._transaction() as db:
            activate(db, message_id)
        return self.get(msg.conversation_id)

    def delete_message(self, message_id: int) -> None:
        """Delete a message and everything that follows it (answers in flight there are stopped)."""
        msg = self.message(message_id)
        messages = self.messages(msg.conversation_id)
        doomed, frontier = {message_id}, [message_id]
        while frontier:
            parent = frontier.pop()
            for m in messages:
                if m.parent_id == parent and m.id not in doomed:
                    doomed.add(m.id)
                    frontier.append(m.id)
        self._stop_answers(lambda r: r.message_id in doomed)
        ids = sorted(doomed)
        with self._transaction() as db:
            for start in range(0, len(ids), 500):
                chunk = ids[start : start + 500]
                marks = ", ".join("?" * len(chunk))
                db.execute(f"UPDATE messages SET parent_id = NULL WHERE id IN ({marks})", chunk)
                db.execute(f"DELETE FROM messages WHERE id IN ({marks})", chunk)
            db.execute("UPDATE conversations SET updated = ? WHERE id = ?", (time.time(), msg.conversation_id))

    # ------------------------------------------------------------------ export
    def export(self, conversation_id: int, fmt: str = "md") -> str:
        """The conversation as Markdown (the active branch, readable) or JSON (everything: the active
        branch in ``messages``, earlier answers and edits in ``other_messages``)."""
        from engine.chat.export import export_conversation

        return export_conversation(self, conversation_id, fmt)


# ---------------------------------------------------------------------------- helpers
def message_of(row) -> Message:
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


def insert_message(db, conversation_id, parent_id, role, content, state, writer, now) -> int:
    cur = db.execute("INSERT INTO messages (conversation_id, parent_id, role, content, state, active, writer, created, "
                     "updated) VALUES (?, ?, ?, ?, ?, 1, ?, ?, ?)",
                     (conversation_id, parent_id, role, content, state, writer, now, now))
    return int(cur.lastrowid)


def activate(db, message_id: int) -> list[tuple[int, int]]:
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
