"""One transcript: timed segments, search, play from a segment, copy, export, chat about it.

Where speakers were told apart, each line shows its speaker; *Rename speaker…* names one, and every
line of that speaker follows (the name is kept with the transcript and used in its exports). With
word timestamps, *Follow the words* highlights the word being played.

A file still being transcribed can be opened too: its finished windows appear one by one as
the engine reports them (each window's text, timed by the window), and the finished transcript
replaces them when the file is done.
"""

from __future__ import annotations

from pathlib import Path

import html
import time

from PySide6.QtCore import Qt, QTimer, Signal
from PySide6.QtGui import QColor
from PySide6.QtWidgets import (
    QAbstractItemView,
    QApplication,
    QCheckBox,
    QFileDialog,
    QInputDialog,
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
from engine.transcript import default_speaker_name

SPEAKER = 3  # the speaker column (after the text, which stays column 2)

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
        self.table = QTableWidget(0, 4)
        self.table.setHorizontalHeaderLabels(["Start", "End", "Text", "Speaker"])
        self.table.setColumnHidden(SPEAKER, True)
        self.table.verticalHeader().setVisible(False)
        self.table.setEditTriggers(QAbstractItemView.NoEditTriggers)
        self.table.setSelectionBehavior(QAbstractItemView.SelectRows)
        self.table.setWordWrap(True)
        self.table.horizontalHeader().setSectionResizeMode(2, QHeaderView.Stretch)
        self.table.setColumnWidth(0, 60)
        self.table.setColumnWidth(1, 60)
        self.table.cellClicked.connect(self.play_segment)
        self.rename_button = QPushButton("Rename speaker…")
        self.rename_button.clicked.connect(self._choose_speaker_name)
        self.follow_words = QCheckBox("Follow the words")
        self.follow_words.setToolTip("While playing, highlight the word being said (needs word timestamps)")
        self.now_playing = QLabel()
        self.now_playing.setWordWrap(True)
        self.now_playing.setTextFormat(Qt.RichText)
        self.play_started: float | None = None  # when playback started (monotonic), from self.player.position
        self.follow_timer = QTimer(self)
        self.follow_timer.timeout.connect(self._follow)
        self.follow_timer.start(100)
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
        for b in (self.copy_button, self.export_button, self.chat_button, self.rename_button):
            buttons.addWidget(b)
        buttons.addWidget(self.follow_words)
        buttons.addStretch(1)
        layout = QVBoxLayout(self)
        layout.addWidget(self.title)
        layout.addLayout(top)
        layout.addWidget(self.table, 1)
        layout.addWidget(self.now_playing)
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
        segments = (self.result or {}).get("segments") or []
        self.rename_button.setEnabled(on and any(s.get("speaker") for s in segments))
        self.follow_words.setEnabled(on and any(s.get("words") for s in segments))

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
        self._fill_segments()
        self.note.setText("Click a line to play the recording from there.")
        self.search.clear()
        self._enable(True)
        return True

    def _fill_segments(self) -> None:
        segments = (self.result or {}).get("segments") or []
        self.table.setRowCount(len(segments))
        for i, s in enumerate(segments):
            values = (clock(s["start"]), clock(s["end"]), s["text"].strip(), self.speaker_name(s.get("speaker")))
            for j, value in enumerate(values):
                item = QTableWidgetItem(value)
                item.setData(Qt.UserRole, float(s["start"]))
                self.table.setItem(i, j, item)
        self.table.setColumnHidden(SPEAKER, not any(s.get("speaker") for s in segments))
        self.table.resizeRowsToContents()

    # ------------------------------------------------------------------ speakers
    def speaker_name(self, speaker: str | None) -> str:
        if not speaker:
            return ""
        names = (self.result or {}).get("speaker_names") or {}
        return names.get(speaker) or default_speaker_name(speaker)

    def rename_speaker(self, speaker: str, name: str) -> None:
        """Call ``speaker`` (an id such as "S1") ``name`` in every line, in the stored transcript and its exports."""
        if self.result is None or self.job_id is None:
            return
        name = name.strip()
        names = dict(self.result.get("speaker_names") or {})
        if name:
            names[speaker] = name
        else:
            names.pop(speaker, None)
        self.result["speaker_names"] = names
        self.result["speakers"] = {i: names.get(i) or default_speaker_name(i) for i in self.result.get("speakers") or {}}
        self.bridge.jobs.finished(self.job_id, self.result)
        self._fill_segments()
        self._apply_search(self.search.text())
        self.note.setText(f"{default_speaker_name(speaker)} is now called {name or default_speaker_name(speaker)}.")

    def _choose_speaker_name(self) -> None:
        row = self.table.currentRow()
        segments = (self.result or {}).get("segments") or []
        if not 0 <= row < len(segments) or not segments[row].get("speaker"):
            self.note.setText("Select a line of the speaker to rename first.")
            return
        speaker = segments[row]["speaker"]
        name, ok = QInputDialog.getText(self, "Rename speaker", f"Name for {self.speaker_name(speaker)}:",
                                        text=self.speaker_name(speaker))
        if ok:
            self.rename_speaker(speaker, name)

    # ------------------------------------------------------------------ following the words as they play
    def highlight_at(self, seconds: float) -> tuple[int, int] | None:
        """Show the segment being played at ``seconds`` with its current word highlighted; (row, word) or None."""
        segments = (self.result or {}).get("segments") or []
        for row, s in enumerate(segments):
            words = s.get("words") or []
            if not words or not s["start"] - 0.05 <= seconds <= s["end"] + 0.05:
                continue
            current = max((i for i, w in enumerate(words) if w["start"] <= seconds), default=0)
            shown = "".join(f"<b><u>{html.escape(w['word'])}</u></b>" if i == current else html.escape(w["word"])
                            for i, w in enumerate(words))
            self.now_playing.setText(shown.strip())
            if self.table.currentRow() != row:
                self.table.selectRow(row)
            return row, current
        return None

    def _follow(self) -> None:
        if self.play_started is None or not self.follow_words.isChecked() or self.player.position is None:
            return
        self.highlight_at(self.player.position + time.monotonic() - self.play_started)

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
        self.table.setColumnHidden(SPEAKER, True)  # speakers are told apart once the whole file is done
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
            for column in range(self.table.columnCount()):
                if self.table.item(row, column) is None:
                    continue
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
        self.play_started = None if problem else time.monotonic()
        self.note.setText(problem or f"Playing from {clock(start)}.")

    def copy_text(self) -> None:
        if self.result:
            QApplication.clipboard().setText(self.result.get("text", ""))
            self.note.setText("The transcript is on the clipboard.")

    def export_to(self, path: str | Path) -> Path | None:
        try:
            written = export_transcript(self.result or {}, path, self.bridge.settings.subtitle_rules)
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
