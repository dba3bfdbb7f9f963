"""How responsive the window is: a timer on the window's thread whose longest gap between ticks is the
longest time the event loop was blocked (plus the interval). Used by the UI latency benchmark and by
a test that only a real freeze fails."""

from __future__ import annotations

import time

from PySide6.QtCore import QTimer


class Heartbeat:
    """A QTimer ticking every ``interval_ms`` on the window's thread; the longest gap between ticks is
    how long the event loop was blocked (plus the interval)."""

    def __init__(self, interval_ms: int = 10):
        self.timer = QTimer()
        self.timer.setInterval(interval_ms)
        self.timer.timeout.connect(self._tick)
        self.last: float | None = None
        self.longest = 0.0
        self.ticks = 0

    def _tick(self) -> None:
        now = time.perf_counter()
        if self.last is not None:
            self.longest = max(self.longest, now - self.last)
        self.last = now
        self.ticks += 1

    def start(self) -> None:
        self.last, self.longest, self.ticks = None, 0.0, 0
        self.timer.start()

    def stop(self) -> None:
        self.timer.stop()
