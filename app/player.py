"""Plays a recording from a given second on the default output device (sounddevice).

Where the machine has no output device, :meth:`Player.play` says so in a sentence instead.
Audio is decoded by the engine's reader (any format it reads) on a thread of its own.
"""

from __future__ import annotations

import threading

from engine.audio import SAMPLE_RATE, load_audio
from engine.errors import CadenceError


def output_device_problem() -> str | None:
    """None when sound can be played here, else a sentence saying why not."""
    try:
        import sounddevice as sd
    except (ImportError, OSError):
        return "Playback needs the sounddevice package and PortAudio (libportaudio2), which are not installed."
    try:
        devices = sd.query_devices()
    except Exception as exc:  # PortAudio could not list devices
        return f"The sound system could not be read ({exc})."
    if not any(d.get("max_output_channels", 0) > 0 for d in devices):
        return "This computer has no audio output device, so the recording cannot be played here."
    return None


class Player:
    def __init__(self):
        self.position: float | None = None  # the second playback was last asked to start from
        self.path: str | None = None
        self._lock = threading.Lock()

    def play(self, path: str, start: float, on_error=None) -> str | None:
        """Start playing ``path`` from ``start`` seconds; returns a sentence when it cannot."""
        self.path, self.position = path, start
        problem = output_device_problem()
        if problem:
            return problem
        threading.Thread(target=self._play, args=(path, start, on_error), daemon=True).start()
        return None

    def _play(self, path: str, start: float, on_error) -> None:
        try:
            import sounddevice as sd

            samples = load_audio(path)
            with self._lock:
                sd.stop()
                sd.play(samples[int(start * SAMPLE_RATE):], SAMPLE_RATE)
        except CadenceError as exc:
            if on_error:
                on_error(str(exc))
        except Exception as exc:
            if on_error:
                on_error(f"The recording could not be played ({exc}).")

    def stop(self) -> None:
        try:
            import sounddevice as sd

            sd.stop()
        except Exception:
            pass
