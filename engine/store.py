"""The one SQLite file that keeps the user's work: transcription jobs and conversations.

Lives in the user data folder (``cadence.sqlite3``; ``CADENCE_DATA_DIR`` moves it). WAL mode and
a commit per finished unit of work (a window, a message) mean a crash, a kill or a closed window
loses at most the unit in flight. Each thread opens its own connection (:func:`connect`); the
schema is created or upgraded on first use, by its version number.
"""

from __future__ import annotations

import sqlite3
import threading
from pathlib import Path

from engine.errors import CadenceError
from engine.paths import data_dir

SCHEMA_VERSION = 1
DB_NAME = "cadence.sqlite3"

# Each entry upgrades the schema from version i to i + 1.
MIGRATIONS: list[str] = [
    """
    -- Transcription jobs (engine/jobs.py): one row per input file, one row per finished window.
    CREATE TABLE jobs (
        id INTEGER PRIMARY KEY,
        path TEXT NOT NULL,
        model TEXT NOT NULL,
        options TEXT NOT NULL DEFAULT '{}',      -- JSON: language, task, formats, output folder
        state TEXT NOT NULL,                     -- queued | running | done | failed | cancelled
        error TEXT,
        windows_total INTEGER,
        language TEXT,
        duration REAL,
        result TEXT,                             -- JSON transcript once done
        created REAL NOT NULL,
        updated REAL NOT NULL
    );
    CREATE INDEX jobs_state ON jobs(state);
    CREATE TABLE job_windows (
        job_id INTEGER NOT NULL REFERENCES jobs(id) ON DELETE CASCADE,
        idx INTEGER NOT NULL,
        data TEXT NOT NULL,                      -- JSON: tokens, text, segments, quality figures
        PRIMARY KEY (job_id, idx)
    );

    -- Conversations (engine/chat/). Messages form a tree: regenerating an answer or
    -- editing a message adds a sibling; the active branch follows the active child at each level.
    CREATE TABLE conversations (
        id INTEGER PRIMARY KEY,
        title TEXT NOT NULL DEFAULT '',
        model TEXT NOT NULL,
        system TEXT,
        params TEXT NOT NULL DEFAULT '{}',       -- JSON: sampling settings (engine.sampling.SamplingParams)
        context TEXT,                            -- JSON: e.g. the transcript (and job id) it is about
        created REAL NOT NULL,
        updated REAL NOT NULL
    );
    CREATE INDEX conversations_updated ON conversations(updated);
    CREATE TABLE messages (
        id INTEGER PRIMARY KEY,
        conversation_id INTEGER NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
        parent_id INTEGER REFERENCES messages(id) ON DELETE CASCADE,  -- the message it follows
        role TEXT NOT NULL,                      -- user | assistant
        content TEXT NOT NULL,                   -- a streaming answer: the text so far
        state TEXT NOT NULL DEFAULT 'complete',  -- complete | streaming | stopped | interrupted | failed
        active INTEGER NOT NULL DEFAULT 1,       -- 1: the sibling on the active branch
        error TEXT,                              -- why it failed (one sentence)
        stats TEXT,                              -- JSON: tokens, timings, finish reason, dropped turns
        writer TEXT,                             -- the process writing a streaming answer (pid:start time)
        created REAL NOT NULL,
        updated REAL NOT NULL
    );
    CREATE INDEX messages_conversation ON messages(conversation_id);
    CREATE INDEX messages_parent ON messages(parent_id);
    CREATE INDEX messages_streaming ON messages(state) WHERE state = 'streaming';
    """,
]

_local = threading.local()


def db_path() -> Path:
    return data_dir() / DB_NAME


def connect(path: Path | None = None) -> sqlite3.Connection:
    """This thread's connection to the store (created and migrated on first use)."""
    path = Path(path or db_path())
    cache = getattr(_local, "connections", None)
    if cache is None:
        cache = _local.connections = {}
    conn = cache.get(path)
    if conn is None:
        try:
            conn = sqlite3.connect(path, timeout=10, isolation_level=None)  # autocommit; explicit transactions
            conn.row_factory = sqlite3.Row
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=NORMAL")
            conn.execute("PRAGMA foreign_keys=ON")
            _migrate(conn)
        except sqlite3.DatabaseError as exc:
            raise CadenceError(f"The Cadence store at {path} cannot be opened ({exc}).") from None
        cache[path] = conn
    return conn


def _migrate(conn: sqlite3.Connection) -> None:
    version = conn.execute("PRAGMA user_version").fetchone()[0]
    if version > SCHEMA_VERSION:
        raise CadenceError(f"The Cadence store was written by a newer version (schema {version}); "
                           "update Cadence to open it.")
    for target in range(version, SCHEMA_VERSION):
        conn.execute("BEGIN IMMEDIATE")
        try:
            for statement in _statements(MIGRATIONS[target]):
                conn.execute(statement)
            conn.execute(f"PRAGMA user_version={target + 1}")
            conn.execute("COMMIT")
        except Exception:
            conn.execute("ROLLBACK")
            raise


def _statements(script: str) -> list[str]:
    """Split a migration into statements (no semicolons inside our statements' text)."""
    lines = [line.split("--", 1)[0] for line in script.splitlines()]
    return [s.strip() for s in "\n".join(lines).split(";") if s.strip()]
