"""One process at a time for work that fills the cache (a model conversion, a calibration, a kernel
choice): the app and the command line, or two windows started together, would otherwise both do it,
and one could replace a folder the other is reading. The lock is advisory and released when its
process ends, however it ends."""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path

try:  # POSIX
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None
    import msvcrt


@contextmanager
def held(path: Path):
    """Hold the lock named after ``path`` (a ``.lock`` file beside it) for the ``with`` block; a second
    process asking for it waits until the first has finished."""
    lock = Path(path).with_name(Path(path).name + ".lock")
    lock.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        if fcntl is not None:
            fcntl.flock(fd, fcntl.LOCK_EX)
        else:  # pragma: no cover - Windows: retries each second until it gets the first byte
            msvcrt.locking(fd, msvcrt.LK_LOCK, 1)
        yield
    finally:
        if fcntl is not None:
            fcntl.flock(fd, fcntl.LOCK_UN)
        else:  # pragma: no cover
            os.lseek(fd, 0, os.SEEK_SET)
            msvcrt.locking(fd, msvcrt.LK_UNLCK, 1)
        os.close(fd)
