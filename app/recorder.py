"""Recording from a microphone into a FLAC file, losing nothing on Stop or when the app closes.

:class:`Recorder` has no Qt in it. PortAudio (through sounddevice) calls :meth:`Recorder.callback`
with each block of samples on its own thread; the callback only copies the block into a queue. A
writer thread appends the blocks to ``recording-….partial.flac`` in the recordings folder as they
come. :meth:`Recorder.stop` first stops the stream (no more blocks), then lets the writer write
every block still queued, closes the file and renames it to ``recording-….flac``; the caller
queues it for transcription. A ``.partial.flac`` left by a crash is finished and queued the next
time the app starts (:func:`recover_recordings`).
"""

from __future__ import annotations

import queue
import threading
import time
from pathlib import Path

import numpy as np

from engine.errors import CadenceError
from engine.paths import data_dir

PARTIAL = ".partial.flac"
NO_INPUT = "This computer has no microphone or other audio input device, so nothing can be recorded here."


def recordings_dir() -> Path:
    folder = data_dir() / "recordings"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def input_devices() -> tuple[list[dict], str | None]:
    """(input devices as {"index", "name", "rate", "channels"}, None) or ([], a sentence saying why none)."""
    try:
        import sounddevice as sd
    except (ImportError, OSError):
        return [], ("Recording needs PortAudio (the libportaudio2 system package) and the sounddevice package; "
                    "install them to record.")
    try:
        devices = sd.query_devices()
    except Exception as exc:
        return [], f"The sound system could not be read ({exc}), so nothing can be recorded."
    found = [{"index": i, "name": d["name"], "rate": int(d.get("default_samplerate") or 16000),
              "channels": int(d["max_input_channels"])}
             for i, d in enumerate(devices) if d.get("max_input_channels", 0) > 0]
    return found, (None if found else NO_INPUT)


def recover_recordings() -> list[Path]:
    """Recordings a crash left unfinished: renamed to their final name; the caller queues them."""
    recovered = []
    for partial in sorted(recordings_dir().glob(f"*{PARTIAL}")):
        final = partial.with_name(partial.name[: -len(PARTIAL)] + ".flac")
        if partial.stat().st_size == 0:
            partial.unlink()
            continue
        partial.rename(final)
        recovered.append(final)
    return recovered


class Recorder:
    """One recording at a time. ``state``: idle | recording | paused."""

    def __init__(self, folder: Path | None = None):
        self.folder = Path(folder) if folder else recordings_dir()
        self.state = "idle"
        self.level = 0.0  # RMS of the latest block, 0..1 (for the level meter)
        self.frames = 0  # frames written to the file so far (set by the writer thread)
        self.rate = 0
        self.channels = 1
        self.path: Path | None = None  # the file being written
        self.error: str | None = None
        self._blocks: queue.Queue = queue.Queue()
        self._writer: threading.Thread | None = None
        self._stream = None
        self._file = None
        # Called on the writer thread with each block just written, and the rate: live captions follow
        # the file exactly (engine.api.LiveHandle.feed).
        self.on_block = None

    @property
    def seconds(self) -> float:
        return self.frames / self.rate if self.rate else 0.0

    def start(self, device: int | None = None, rate: int | None = None, channels: int = 1,
              open_stream: bool = True) -> Path:
        """Open the file and (unless ``open_stream`` is False, as in tests that feed :meth:`callback`
        themselves) the input stream. Raises CadenceError with a sentence when it cannot."""
        if self.state != "idle":
            raise CadenceError("A recording is already running; stop it first.")
        import soundfile as sf

        if open_stream:
            devices, problem = input_devices()
            if problem:
                raise CadenceError(problem)
            chosen = next((d for d in devices if d["index"] == device), devices[0])
            device, rate = chosen["index"], rate or chosen["rate"]
            channels = min(channels, chosen["channels"])
        self.rate, self.channels = int(rate or 16000), channels
        stamp = time.strftime("%Y%m%d-%H%M%S")
        self.path = self.folder / f"recording-{stamp}{PARTIAL}"
        n = 2
        while self.path.exists() or self.path.with_name(self.path.name[: -len(PARTIAL)] + ".flac").exists():
            self.path = self.folder / f"recording-{stamp}-{n}{PARTIAL}"
            n += 1
        try:
            self._file = sf.SoundFile(self.path, "w", samplerate=self.rate, channels=channels, format="FLAC",
                                      subtype="PCM_16")
        except (OSError, RuntimeError) as exc:
            raise CadenceError(f"The recording file {self.path} cannot be created ({exc}).") from None
        self.frames, self.error = 0, None
        self._blocks = queue.Queue()
        self._writer = threading.Thread(target=self._write, name="cadence-recorder", daemon=True)
        self._writer.start()
        self.state = "recording"
        if open_stream:
            try:
                import sounddevice as sd

                self._stream = sd.InputStream(device=device, samplerate=self.rate, channels=channels, dtype="float32",
                                              callback=self.callback)
                self._stream.start()
            except Exception as exc:
                self._stream = None
                self.stop()
                raise CadenceError(f"The microphone could not be opened ({exc}).") from None
        return self.path

    def callback(self, indata, frames, time_info, status) -> None:
        """PortAudio's thread: keep a copy of the block (unless paused) and note its level."""
        block = np.array(indata, dtype=np.float32, copy=True).reshape(len(indata), -1)
        self.level = float(np.sqrt(np.mean(np.square(block)))) if block.size else 0.0
        if self.state == "recording":
            self._blocks.put(block)

    def pause(self) -> None:
        if self.state == "recording":
            self.state = "paused"

    def resume(self) -> None:
        if self.state == "paused":
            self.state = "recording"

    def stop(self) -> Path | None:
        """Stop, write everything received, close and name the file; returns it (None when nothing was
        recorded: the empty file is removed)."""
        if self.state == "idle":
            return None
        if self._stream is not None:
            try:
                self._stream.stop()
                self._stream.close()
            except Exception:
                pass
            self._stream = None
        self.state = "idle"
        self._blocks.put(None)  # after every block the callback queued
        if self._writer is not None:
            self._writer.join()
        self._file.close()
        self._file = None
        self.level = 0.0
        if self.frames == 0:
            self.path.unlink(missing_ok=True)
            return None
        final = self.path.with_name(self.path.name[: -len(PARTIAL)] + ".flac")
        self.path.rename(final)
        self.path = final
        return final

    def _write(self) -> None:
        while True:
            block = self._blocks.get()
            if block is None:
                return
            try:
                self._file.write(block[:, : self.channels])
                self.frames += len(block)
                if self.on_block is not None:
                    self.on_block(block[:, : self.channels], self.rate)
            except Exception as exc:  # disk full, file gone: say so, keep draining
                self.error = f"The recording could not be written ({exc})."
