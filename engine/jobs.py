"""Transcription jobs that survive a crash: one row per file, one row per finished window.

A job is recorded (``queued``) before any decoding. When the engine has planned the file, the job
becomes ``running`` with its language and window count; each window is written the moment it
finishes, on the engine thread. A killed process leaves ``queued``/``running`` jobs behind:
:func:`submit_job` on such a job decodes only the windows that are not stored yet, so a resumed
transcript is the same as an uninterrupted one. Finished jobs keep their transcript (JSON).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

from engine.errors import CadenceError
from engine.store import connect, db_path
from engine.transcript import WindowResult
from engine.whisper.alignment import WordTiming

UNFINISHED = ("queued", "running")


@dataclass
class Job:
    id: int
    path: str
    model: str
    options: dict = field(default_factory=dict)
    state: str = "queued"
    error: str | None = None
    windows_total: int | None = None
    windows_done: int = 0
    language: str | None = None
    duration: float | None = None
    result: dict | None = None
    created: float = 0.0
    updated: float = 0.0


class JobStore:
    """The jobs in the Cadence store. Safe to use from several threads (one connection each)."""

    def __init__(self, path: Path | None = None):
        self.path = Path(path or db_path())
        connect(self.path)  # create or upgrade the store now, on the caller's thread

    @property
    def _db(self):
        return connect(self.path)

    def create(self, path: str | Path, model: str, options: dict | None = None) -> int:
        now = time.time()
        cur = self._db.execute(
            "INSERT INTO jobs (path, model, options, state, created, updated) VALUES (?, ?, ?, 'queued', ?, ?)",
            (str(path), model, json.dumps(options or {}), now, now))
        return int(cur.lastrowid)

    def get(self, job_id: int) -> Job:
        row = self._db.execute(
            "SELECT j.*, (SELECT COUNT(*) FROM job_windows w WHERE w.job_id = j.id) AS windows_done "
            "FROM jobs j WHERE j.id = ?", (job_id,)).fetchone()
        if row is None:
            raise CadenceError(f"There is no transcription job {job_id}.")
        return _job(row)

    def list(self, states: tuple[str, ...] | None = None) -> list[Job]:
        query = ("SELECT j.*, (SELECT COUNT(*) FROM job_windows w WHERE w.job_id = j.id) AS windows_done "
                 "FROM jobs j")
        args: tuple = ()
        if states:
            query += f" WHERE j.state IN ({', '.join('?' * len(states))})"
            args = tuple(states)
        return [_job(r) for r in self._db.execute(query + " ORDER BY j.id", args)]

    def unfinished(self) -> list[Job]:
        return self.list(UNFINISHED)

    def started(self, job_id: int, windows_total: int, language: str, duration: float,
                spans: list | None = None) -> bool:
        """The job's plan is made. ``spans``: its windows as [first frame, frames]. Returns False when
        its stored windows were decoded in other windows (the voice-activity model or its settings
        changed between a crash and the resume; for a job from before spans were kept, its window
        count changed): those stored windows are then dropped, to be decoded again."""
        values = {"state": "running", "windows_total": windows_total, "language": language, "duration": duration}
        try:
            job = self.get(job_id)
        except CadenceError:  # deleted under a running job: recording its first window will say so
            return True
        before = job.options.get("spans")
        moved = (spans is not None and before not in (None, spans)) or \
            (before is None and job.windows_total is not None and job.windows_total != windows_total)
        if moved:
            self._db.execute("DELETE FROM job_windows WHERE job_id = ?", (job_id,))
        if spans is not None:
            values["options"] = json.dumps({**job.options, "spans": spans})
        self._set(job_id, **values)
        return not moved

    def add_window(self, job_id: int, index: int, window: WindowResult) -> None:
        data = {"tokens": list(window.tokens), "no_speech_prob": window.no_speech_prob,
                "avg_logprob": window.avg_logprob}
        if window.words is not None:
            data["words"] = [w.to_list() for w in window.words]
        self._db.execute("INSERT OR REPLACE INTO job_windows (job_id, idx, data) VALUES (?, ?, ?)",
                         (job_id, index, json.dumps(data)))

    def windows(self, job_id: int) -> dict[int, WindowResult]:
        rows = self._db.execute("SELECT idx, data FROM job_windows WHERE job_id = ?", (job_id,))
        out = {}
        for row in rows:
            data = json.loads(row["data"])
            words = [WordTiming.from_list(w) for w in data["words"]] if "words" in data else None
            out[int(row["idx"])] = WindowResult(data["tokens"], data["no_speech_prob"], data["avg_logprob"], words=words)
        return out

    def finished(self, job_id: int, result: dict) -> None:
        self._set(job_id, state="done", result=json.dumps(result, ensure_ascii=False), error=None)

    def failed(self, job_id: int, error: str) -> None:
        self._set(job_id, state="failed", error=error)

    def cancelled(self, job_id: int) -> None:
        self._set(job_id, state="cancelled", error="Cancelled.")

    def requeue(self, job_id: int) -> None:
        """Retry a failed or cancelled job (its stored windows are kept)."""
        self._set(job_id, state="queued", error=None)

    def remove(self, job_id: int) -> None:
        self._db.execute("DELETE FROM jobs WHERE id = ?", (job_id,))

    def _set(self, job_id: int, **values) -> None:
        values["updated"] = time.time()
        names = ", ".join(f"{k} = ?" for k in values)
        self._db.execute(f"UPDATE jobs SET {names} WHERE id = ?", (*values.values(), job_id))


def _job(row) -> Job:
    return Job(
        id=row["id"], path=row["path"], model=row["model"], options=json.loads(row["options"] or "{}"),
        state=row["state"], error=row["error"], windows_total=row["windows_total"],
        windows_done=row["windows_done"], language=row["language"], duration=row["duration"],
        result=json.loads(row["result"]) if row["result"] else None, created=row["created"], updated=row["updated"])


def submit_job(engine, jobs: JobStore, job_id: int, known_windows: dict | None = None):
    """Submit a stored job to the engine, skipping its stored windows (and ``known_windows``: windows
    decoded before, e.g. by a live recording, reused where identical); its progress is recorded as it
    happens. Returns the engine handle; call :func:`settle_job` with its outcome."""
    from engine.api import TranscribeRequest

    job = jobs.get(job_id)
    if not Path(job.path).exists():
        message = f"{Path(job.path).name} does not exist (or was moved or deleted)."
        jobs.failed(job_id, message)
        raise CadenceError(message)
    store_path = jobs.path

    def on_plan(plan):  # engine thread; False: the stored windows were decoded in other windows
        return JobStore(store_path).started(job_id, len(plan.spans), plan.language, plan.duration,
                                            [[seek, size] for seek, size, _ in plan.spans])

    def on_window(index, window):  # engine thread: written before the window is reported
        JobStore(store_path).add_window(job_id, index, window)

    options = job.options
    request = TranscribeRequest(
        audio=job.path, model=job.model, language=job.language or options.get("language"),
        task=options.get("task", "transcribe"), name=job.path, done_windows=jobs.windows(job_id),
        windowing=options.get("windowing", "vad"), timestamps=bool(options.get("timestamps", False)),
        words=bool(options.get("words", False)), speakers=options.get("speakers", "off"),
        initial_prompt=options.get("prompt"), known_windows=known_windows, on_plan=on_plan, on_window=on_window)
    jobs._set(job_id, state="running")
    return engine.submit(request)


def settle_job(jobs: JobStore, job_id: int, handle, model_name: str | None = None):
    """Wait for a submitted job's handle and record how it ended. Returns the Transcript, or raises
    CadenceError with the failure's sentence (recorded as the job's error)."""
    try:
        transcript = handle.result()
    except CadenceError as exc:
        if handle.cancelled:
            jobs.cancelled(job_id)
        else:
            jobs.failed(job_id, str(exc))
        raise
    entry = transcript.to_json() | {"model": model_name or jobs.get(job_id).model}
    jobs.finished(job_id, entry)
    return transcript
