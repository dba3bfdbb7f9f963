"""Progress of ``cadence train-mtp`` on stderr, and a silent stand-in for tests and tools."""

from __future__ import annotations

import sys
import time


class Progress:
    """One status line on stderr (rewritten in place on a terminal, a line every few seconds otherwise)."""

    def __init__(self, stream=None, every: float = 5.0):
        self.stream = stream or sys.stderr
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.every = every
        self.last = 0.0
        self.t0 = time.perf_counter()

    def __call__(self, text: str, force: bool = False) -> None:
        now = time.perf_counter()
        if not force and now - self.last < (0.2 if self.tty else self.every):
            return
        self.last = now
        line = f"[{now - self.t0:7.1f} s] {text}"
        if self.tty:
            self.stream.write("\r\033[K" + line)
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def done(self, text: str) -> None:
        if self.tty:
            self.stream.write("\r\033[K")
        self.stream.write(f"[{time.perf_counter() - self.t0:7.1f} s] {text}\n")
        self.stream.flush()


def quiet(*args, **kwargs) -> None:
    pass


quiet.done = quiet  # type: ignore[attr-defined]
