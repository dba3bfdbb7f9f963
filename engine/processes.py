"""Telling whether the process that left something behind (a half-written answer, a server's queued job) still
runs: a mark of its id and start time, so a later process that got the same id (ids are reused; a restarted
container's server is process 1 every time) is not taken for it."""

from __future__ import annotations

import os


def process_mark() -> str:
    """'pid:start time' of this process."""
    try:
        import psutil

        return f"{os.getpid()}:{psutil.Process().create_time():.3f}"
    except Exception:  # pragma: no cover - psutil comes with accelerate
        return f"{os.getpid()}:"


def process_alive(mark: str | None) -> bool:
    """Whether the process a :func:`process_mark` names still runs (the same id and start time). A mark with no
    start time (written without psutil, or a bare process id) is alive while any process has that id."""
    if not mark:
        return False
    pid_text, _, started = str(mark).partition(":")
    try:
        pid = int(pid_text)
    except ValueError:
        return False
    if pid <= 0:
        return False
    try:
        import psutil
    except ImportError:  # pragma: no cover
        return _pid_exists(pid)
    try:
        process = psutil.Process(pid)
        if process.status() == psutil.STATUS_ZOMBIE:
            return False
        return not started or abs(process.create_time() - float(started)) < 0.01  # else the id was reused
    except psutil.NoSuchProcess:
        return False
    except (psutil.AccessDenied, ValueError):
        return True


def _pid_exists(pid: int) -> bool:  # pragma: no cover - only without psutil
    if os.name == "nt":  # signal 0 would end the process there: assume it runs
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process
        return True
    return True
