"""How long a recording is, read from its header (no decoding), for rows still waiting their turn.

The engine learns a file's duration only when it decodes it (``JobStore.started``); a queue of
hundreds of files would show blank durations until then. :func:`probe_duration` asks soundfile
(WAV, FLAC, OGG, ...) and then PyAV (the container's or audio stream's declared length) without
reading the audio. :class:`DurationProbe` does it on a thread of its own and reports each answer
with a Qt signal, so a slow disk or a large folder never holds up the window.
"""

from __future__ import annotations

import queue
import threading
from pathlib import Path

from PySide6.QtCore import QObject, Signal


def probe_duration(path: str | Path) -> float | None:
    """Seconds of audio the file's header declares, or None when it cannot tell (not audio, gone, ...)."""
    path = Path(path)
    if not path.is_file():
        return None
    try:
        import soundfile

        info = soundfile.info(str(path))
        if info.samplerate > 0 and 0 < info.frames < 1 << 40:
            return info.frames / info.samplerate
    except Exception:  # noqa: BLE001 - not a format libsndfile reads: ask FFmpeg
        pass
    try:
        import av

        with av.open(str(path), metadata_errors="ignore") as container:
            streams = container.streams.audio
            if not streams:
                return None
            stream = streams[0]
            if stream.duration and stream.time_base:
                seconds = float(stream.duration * stream.time_base)
                if 0 < seconds < 1e6:
                    return seconds
            if container.duration and 0 < container.duration < 1e12:
                return container.duration / 1_000_000
    except Exception:  # noqa: BLE001 - unreadable: the engine will say why when it gets there
        return None
    return None


class DurationProbe(QObject):
    """Probes files on one background thread; ``known(job_id, seconds)`` for each one it could read."""

    known = Signal(int, float)

    def __init__(self, parent: QObject | None = None):
        super().__init__(parent)
        self._todo: queue.Queue = queue.Queue()
        self._asked: set[int] = set()
        self._thread: threading.Thread | None = None
        self._stopped = False

    def ask(self, job_id: int, path: str) -> None:
        """Probe a job's file once (asking again for the same job does nothing)."""
        if job_id in self._asked or self._stopped:
            return
        self._asked.add(job_id)
        self._todo.put((job_id, path))
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="cadence-app-probe", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while True:
            item = self._todo.get()
            if item is None:
                return
            job_id, path = item
            seconds = probe_duration(path)
            if seconds is not None and not self._stopped:
                try:
                    self.known.emit(job_id, seconds)
                except RuntimeError:  # the window is gone (closed meanwhile)
                    return

    def stop(self) -> None:
        self._stopped = True
        self._todo.put(None)
