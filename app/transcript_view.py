"""One transcript: timed segments, search, play from a segment, copy, export, chat about it.

A file still being transcribed can be opened too: its finished windows appear one by one as
the engine reports them (each window's text, timed by the window), and the finished transcript
replaces them when the file is done.
"""

from __future__ import annotations

from pathlib import Path

from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QColor
from PySide6.QtWidgets import (
    QAbstractItemView,
    QApplication,
    QFileDialog,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QLineEdit,
    QPushButton,
    QTableWidget,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
)

from engine.errors import CadenceError

from app.bridge import EngineBridge
from app.player import Player
from app.transcripts import clock, export_transcript

WINDOW_SECONDS = 30  # the longest window: where a window's times are not known yet, the fixed grid
EXPORT_FILTERS = "Plain text (*.txt);;SubRip subtitles (*.srt);;WebVTT subtitles (*.vtt);;JSON (*.json)"


class TranscriptView(QWidget):
    chat_about = Signal(int)  # job id
    _play_failed = Signal(str)  # from the player's thread

    def __init__(self, bridge: EngineBridge, parent: QWidget | None = None):
        super().__init__(parent)
        self.bridge = bridge
        self.job_id: int | None = None
        self.result: dict | None = None
        self.live_job: int | None = None  # a job in flight shown as its windows finish (no final result yet)
        self.live_texts: dict[int, str] = {}  # its windows' text so far, by window index
        self.live_times: list = []  # (start, end) seconds of its windows, from the engine's plan
        self.live_phrases: dict[int, list] = {}  # its windows' timed phrases, where it decodes with timestamps
        self.live_progress = (0, 0)  # its windows done, of all
        self.player = Player()

        self.title = QLabel("Double-click a finished file in the queue to read its transcript here.")
        self.title.setWordWrap(True)
        self.search = QLineEdit()
        self.search.setPlaceholderText("Search the transcript")
        self.search.setClearButtonEnabled(True)
        self.search.textChanged.connect(self._apply_search)
        self.matches = QLabel()
        self.table = QTableWidget(0, 3)
        self.table.setHorizontalHeaderLabels(["Start", "End", "Text"])
        self.table.verticalHeader().setVisible(False)
        self.table.setEditTriggers(QAbstractItemView.NoEditTriggers)
        self.table.setSelectionBehavior(QAbstractItemView.SelectRows)
        self.table.setWordWrap(True)
        self.table.horizontalHeader().setSectionResizeMode(2, QHeaderView.Stretch)
        self.table.setColumnWidth(0, 60)
        self.table.setColumnWidth(1, 60)
        self.table.cellClicked.connect(self.play_segment)
        self.copy_button = QPushButton("Copy text")
        self.export_button = QPushButton("Export…")
        self.chat_button = QPushButton("Chat about this transcript")
        self.copy_button.clicked.connect(self.copy_text)
        self.export_button.clicked.connect(self._choose_export)
        self.chat_button.clicked.connect(lambda: self.job_id is not None and self.chat_about.emit(self.job_id))
        self.note = QLabel()
        self.note.setWordWrap(True)
        self._play_failed.connect(self.note.setText)

        top = QHBoxLayout()
        top.addWidget(self.search, 1)
        top.addWidget(self.matches)
        buttons = QHBoxLayout()
        for b in (self.copy_button, self.export_button, self.chat_button):
            buttons.addWidget(b)
        buttons.addStretch(1)
        layout = QVBoxLayout(self)
        layout.addWidget(self.title)
        layout.addLayout(top)
        layout.addWidget(self.table, 1)
        layout.addLayout(buttons)
        layout.addWidget(self.note)
        self._enable(False)
        bridge.job_phrases.connect(self._on_window_phrases)
        bridge.job_text.connect(self._on_window_text)
        bridge.job_progress.connect(self._on_progress)
        bridge.job_changed.connect(self._on_job_changed)

    def _enable(self, on: bool) -> None:
        for w in (self.search, self.copy_button, self.export_button, self.chat_button):
            w.setEnabled(on)

    def show_job(self, job_id: int) -> bool:
        """Show a job's transcript; False (with the reason shown) when it has none yet."""
        try:
            job = self.bridge.jobs.get(job_id)
        except CadenceError as exc:
            self.note.setText(str(exc))
            return False
        if job.state != "done" or not job.result:
            if job_id in self.bridge.live_jobs:
                self._show_partial(job_id)
                return True
            self.note.setText(f"{Path(job.path).name} has no transcript yet ({job.state}"
                              + (f": {job.error}" if job.error else "") + ").")
            return False
        self.live_job = None
        self.job_id, self.result = job_id, job.result
        r = job.result
        language = f"language {r['language']}" if r.get("language") else "no speech found"
        self.title.setText(f"<b>{Path(job.path).name}</b> — {clock(r.get('duration'))}, {language}, {job.model}")
        segments = r.get("segments") or []
        self.table.setRowCount(len(segments))
        for i, s in enumerate(segments):
            for j, value in enumerate((clock(s["start"]), clock(s["end"]), s["text"].strip())):
                item = QTableWidgetItem(value)
                item.setData(Qt.UserRole, float(s["start"]))
                self.table.setItem(i, j, item)
        self.table.resizeRowsToContents()
        self.note.setText("Click a line to play the recording from there.")
        self.search.clear()
        self._enable(True)
        return True

    # ------------------------------------------------------------------ a file still being transcribed
    def _show_partial(self, job_id: int) -> None:
        """The windows of a job in flight finished so far: each one's timed phrases (with timestamps), else
        the window's text timed by the window."""
        live = self.bridge.live_jobs.get(job_id)
        first = self.live_job != job_id
        if first:
            if live is None:
                return
            self.live_texts = dict(live.texts)
            self.live_progress = (live.done, live.total)
            self.live_name, self.live_duration = live.name, live.duration
            self.live_times = list(live.window_times)
            self.live_phrases = dict(live.phrases)
            self.search.clear()
            self.note.setText("Click a line to play the recording from there.")
        elif live is not None:
            self.live_duration = live.duration if live.duration is not None else self.live_duration
            self.live_times = list(live.window_times) or self.live_times
        self.live_job, self.job_id, self.result = job_id, job_id, None
        duration = self.live_duration
        done, total = self.live_progress
        progress = f"{done} of {total} windows" if total else "waiting for the engine"
        self.title.setText(f"<b>{self.live_name}</b> — transcribing ({progress}"
                           + (f", {clock(duration)}" if duration else "") + "); the text fills in as each window"
                           " is decoded.")
        rows = []  # (start, end, text): a finished window's timed phrases, else the window itself
        for index, text in sorted(self.live_texts.items()):
            if not text:
                continue
            if self.live_phrases.get(index):
                rows += self.live_phrases[index]
                continue
            if index < len(self.live_times):
                start, end = self.live_times[index]
            else:
                start = index * WINDOW_SECONDS
                end = start + WINDOW_SECONDS if duration is None else min(start + WINDOW_SECONDS, duration)
            rows.append((start, end, text))
        self.table.setRowCount(len(rows))
        for r, (start, end, text) in enumerate(rows):
            for j, value in enumerate((clock(start), clock(end), text)):
                item = QTableWidgetItem(value)
                item.setData(Qt.UserRole, float(start))
                self.table.setItem(r, j, item)
        self.table.resizeRowsToContents()
        self._apply_search(self.search.text())
        self._enable(False)
        self.search.setEnabled(True)

    def _on_window_phrases(self, job_id: int, index: int, phrases: list) -> None:
        if job_id == self.live_job:
            self.live_phrases[index] = list(phrases)

    def _on_window_text(self, job_id: int, index: int, text: str) -> None:
        if job_id == self.live_job:
            self.live_texts[index] = text
            self._show_partial(job_id)

    def _on_progress(self, job_id: int, done: int, total: int) -> None:
        if job_id == self.live_job:
            self.live_progress = (done, total)
            self._show_partial(job_id)

    def _on_job_changed(self, job_id: int) -> None:
        """The file shown live has ended: its finished transcript (or why there is none) replaces the windows."""
        if job_id != self.live_job or job_id in self.bridge.live_jobs:
            return
        self.live_job = None
        if not self.show_job(job_id):
            self.job_id = None
            self.title.setText("Double-click a finished file in the queue to read its transcript here.")
            self.table.setRowCount(0)
            self._enable(False)

    @property
    def partial(self) -> bool:
        """Showing a file still being transcribed."""
        return self.live_job is not None

    # ------------------------------------------------------------------ search
    def _apply_search(self, text: str) -> None:
        needle = text.strip().lower()
        found = 0
        for row in range(self.table.rowCount()):
            hit = bool(needle) and needle in self.table.item(row, 2).text().lower()
            found += hit
            for column in range(3):
                self.table.item(row, column).setBackground(QColor("#fff2a8") if hit else QColor(0, 0, 0, 0))
            self.table.setRowHidden(row, bool(needle) and not hit)
        self.matches.setText(f"{found} match{'es' if found != 1 else ''}" if needle else "")

    def visible_rows(self) -> list[int]:
        return [r for r in range(self.table.rowCount()) if not self.table.isRowHidden(r)]

    # ------------------------------------------------------------------ actions
    def play_segment(self, row: int, column: int = 0) -> None:
        if self.job_id is None or row < 0:
            return
        start = self.table.item(row, 0).data(Qt.UserRole)
        path = self.bridge.jobs.get(self.job_id).path
        problem = self.player.play(path, start, on_error=self._play_failed.emit)
        self.note.setText(problem or f"Playing from {clock(start)}.")

    def copy_text(self) -> None:
        if self.result:
            QApplication.clipboard().setText(self.result.get("text", ""))
            self.note.setText("The transcript is on the clipboard.")

    def export_to(self, path: str | Path) -> Path | None:
        try:
            written = export_transcript(self.result or {}, path)
        except CadenceError as exc:
            self.note.setText(str(exc))
            return None
        except OSError as exc:
            self.note.setText(f"The transcript could not be written to {path} ({exc.strerror or exc}).")
            return None
        self.note.setText(f"Saved {written}.")
        return written

    def _choose_export(self) -> None:
        if not self.result:
            return
        stem = Path(self.result.get("file") or "transcript").stem
        path, chosen = QFileDialog.getSaveFileName(self, "Export transcript", f"{stem}.txt", EXPORT_FILTERS)
        if path:
            if not Path(path).suffix:
                path += "." + chosen.split("*.")[-1].rstrip(")")
            self.export_to(path)
