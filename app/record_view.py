"""The Record tab: pick a microphone, watch the level, record / pause / stop; Stop queues the file.

While recording, the transcript appears window by window (live captions): every block the file gets
is also fed to the engine (engine.api.LiveHandle), which decodes each window of speech a pause
closes, ahead of queued files. Stop queues the saved file as any file is queued; the windows
decoded live are reused where they are exactly the file's, so its transcript is what transcribing
the file gives, and nothing recorded is lost.
"""

from __future__ import annotations

from pathlib import Path

from PySide6.QtCore import QTimer, Signal
from PySide6.QtGui import QPalette, QTextCharFormat
from PySide6.QtWidgets import (
    QComboBox,
    QFormLayout,
    QPlainTextEdit,
    QHBoxLayout,
    QLabel,
    QProgressBar,
    QPushButton,
    QVBoxLayout,
    QWidget,
)

from engine.api import drain
from engine.errors import CadenceError

from app.recorder import Recorder, input_devices
from app.transcripts import clock


REMOTE_NOTE = "Recording needs the engine on this computer: choose \"This computer\" under Settings, Engine."


class RecordView(QWidget):
    recorded = Signal(str)  # the saved file, already queued

    def __init__(self, bridge, recorder: Recorder | None = None, parent: QWidget | None = None):
        super().__init__(parent)
        self.bridge = bridge
        self.recorder = recorder or Recorder()
        self.device = QComboBox()
        self.refresh_button = QPushButton("Look again")
        self.refresh_button.clicked.connect(self.find_devices)
        self.level = QProgressBar()
        self.level.setRange(0, 100)
        self.level.setTextVisible(False)
        self.time = QLabel("0:00")
        self.record_button = QPushButton("Record")
        self.pause_button = QPushButton("Pause")
        self.stop_button = QPushButton("Stop and transcribe")
        self.record_button.clicked.connect(self.record)
        self.pause_button.clicked.connect(self.toggle_pause)
        self.stop_button.clicked.connect(self.stop)
        self.message = QLabel()
        self.message.setWordWrap(True)
        self.captions = QPlainTextEdit()
        self.captions.setReadOnly(True)
        self.captions.setPlaceholderText("While you record, what is said appears here, a few seconds behind. "
                                         "Lines in grey italics may still change as you go on speaking.")
        self.live = None  # the recording's live transcription (engine.api.LiveHandle)
        # window -> (provisional, its (start, text) lines); provisional: the window's newest speech was
        # joined onto its earlier caption, and the whole window is read again (after Stop at the latest)
        self.live_lines: dict[int, tuple[bool, list[tuple[float, str]]]] = {}
        form = QFormLayout()
        device_row = QHBoxLayout()
        device_row.addWidget(self.device, 1)
        device_row.addWidget(self.refresh_button)
        form.addRow("Microphone", device_row)
        form.addRow("Level", self.level)
        form.addRow("Recorded", self.time)
        buttons = QHBoxLayout()
        for b in (self.record_button, self.pause_button, self.stop_button):
            buttons.addWidget(b)
        buttons.addStretch(1)
        layout = QVBoxLayout(self)
        intro = QLabel("Recordings are saved as FLAC in your data folder as they are made and queued for "
                       "transcription when you stop. Closing Cadence while recording keeps what was recorded.")
        intro.setWordWrap(True)
        layout.addWidget(intro)
        layout.addLayout(form)
        layout.addLayout(buttons)
        layout.addWidget(self.message)
        layout.addWidget(QLabel("Live captions"))
        layout.addWidget(self.captions, 1)
        self.timer = QTimer(self)
        self.timer.timeout.connect(self._tick)
        self.timer.start(50)
        self.find_devices()
        bridge.engine_rebuilt.connect(lambda _sentence: self._update_buttons())  # this computer's or a server's

    def find_devices(self) -> None:
        devices, problem = input_devices()
        self.device.clear()
        for d in devices:
            self.device.addItem(f"{d['name']} ({d['rate']} Hz)", d["index"])
        chosen = self.bridge.settings.input_device
        for i in range(self.device.count()):
            if self.device.itemText(i).startswith(chosen) and chosen:
                self.device.setCurrentIndex(i)
        self.message.setText(problem or "")
        self.message.setStyleSheet("background: #fff4ce; padding: 8px; border: 1px solid #e0c060; font-weight: bold"
                                   if problem else "")
        self.has_input = problem is None
        if not devices:
            self.device.addItem("(no input device found)", None)
        self._update_buttons()

    def _update_buttons(self) -> None:
        state = self.recorder.state
        self.record_button.setEnabled(state == "idle" and self.has_input and not self.bridge.remote)
        if self.bridge.remote and state == "idle" and self.has_input:  # (the live captions are this computer's)
            self.message.setText(REMOTE_NOTE)
        elif self.message.text() == REMOTE_NOTE:
            self.message.clear()
        self.pause_button.setEnabled(state != "idle")
        self.pause_button.setText("Resume" if state == "paused" else "Pause")
        self.stop_button.setEnabled(state != "idle")
        self.device.setEnabled(state == "idle" and self.has_input)

    def record(self, **recorder_options) -> None:
        """Start recording (``recorder_options`` go to Recorder.start: tests feed blocks themselves)."""
        if self.bridge.remote:
            self.message.setText(REMOTE_NOTE)
            return
        try:
            self.recorder.start(device=self.device.currentData(), **recorder_options)
        except CadenceError as exc:
            self.message.setText(str(exc))
            return
        self._start_live()
        self.bridge.settings.input_device = self.device.currentText().rsplit(" (", 1)[0]
        self.message.setText(f"Recording to {self.recorder.path.name}.")
        self._update_buttons()

    def toggle_pause(self) -> None:
        if self.recorder.state == "paused":
            self.recorder.resume()
        else:
            self.recorder.pause()
        self._update_buttons()

    def _start_live(self) -> None:
        """Captions for the recording just started: its blocks go to the engine as the file gets them."""
        self.live_lines.clear()
        self.captions.clear()
        try:
            self.live = self.bridge.start_live()
        except CadenceError as exc:  # no captions, but the recording goes on
            self.live = None
            self.message.setText(f"Recording without live captions: {exc}")
            return
        self.recorder.on_block = self.live.feed

    def _show_captions(self) -> None:
        """The live transcription's new windows (a window decoded again as it grew replaces its lines)."""
        if self.live is None:
            return
        changed = False
        for event in drain(self.live.events, block=False):
            if event.kind == "progress":
                self.live_lines[event.index] = (event.provisional, [(s.start, s.text) for s in event.segments])
                changed = True
            elif event.kind == "failed":
                self.message.setText(f"Live captions stopped: {event.message}")
            if event.terminal:
                self.live = None
                break
        if changed:
            self.show_lines()

    def show_lines(self) -> None:
        """Every window's caption lines in time order; a provisional window's in grey italics."""
        provisional = QTextCharFormat()
        provisional.setFontItalic(True)
        provisional.setForeground(self.palette().color(QPalette.ColorRole.PlaceholderText))
        self.captions.clear()
        cursor = self.captions.textCursor()
        first = True
        for index in sorted(self.live_lines):
            tentative, lines = self.live_lines[index]
            for start, text in lines:
                if not first:
                    cursor.insertBlock()
                cursor.insertText(f"{clock(start)}  {text}", provisional if tentative else QTextCharFormat())
                first = False
        self.captions.verticalScrollBar().setValue(self.captions.verticalScrollBar().maximum())

    def provisional_lines(self) -> list[str]:
        """The caption lines now shown as provisional (grey italics), as they read."""
        block, shown = self.captions.document().firstBlock(), []
        while block.isValid():
            fragments = block.begin()
            if not fragments.atEnd() and fragments.fragment().charFormat().fontItalic():
                shown.append(block.text())
            block = block.next()
        return shown

    @property
    def caption_text(self) -> str:
        return self.captions.toPlainText()

    def stop(self) -> Path | None:
        """Save the recording and queue it; returns the file (None when nothing was recorded)."""
        path = self.recorder.stop()  # every block written, and so fed to the live transcription
        self.recorder.on_block = None
        live = self.live
        if live is not None:
            live.stop()  # its last windows are still shown as they come
        self._update_buttons()
        if path is None:
            if self.recorder.error:
                self.message.setText(self.recorder.error)
            return None
        self.bridge.add_paths([path], known_windows=live.known if live is not None else None)
        self.message.setText(f"Saved {path.name} ({clock(self.recorder.seconds)}) and queued it for transcription.")
        self.recorded.emit(str(path))
        return path

    def _tick(self) -> None:
        self._show_captions()
        if self.recorder.state == "idle":
            if self.level.value():
                self.level.setValue(0)
            return
        self.level.setValue(min(100, int(self.recorder.level * 300)))
        self.time.setText(clock(self.recorder.seconds))
        if self.recorder.error:
            self.message.setText(self.recorder.error)
