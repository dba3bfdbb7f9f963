"""The transcription queue: drop files and folders, watch each one's progress, control them.

One row per stored job (they persist: the queue a person left is the queue they find). The row
shows file, duration, model, state, a progress bar, elapsed time and ETA, which slots it sits in,
and for a failed file the sentence saying why.
"""

from __future__ import annotations

import time
from pathlib import Path

from PySide6.QtCore import QItemSelectionModel, QRect, Qt, QTimer, QUrl, Signal
from PySide6.QtGui import QDesktopServices
from PySide6.QtWidgets import (
    QAbstractItemView,
    QApplication,
    QFileDialog,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QPushButton,
    QStyle,
    QStyledItemDelegate,
    QStyleOptionProgressBar,
    QTableWidget,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
)

from engine.audio import AUDIO_EXTENSIONS
from engine.errors import CadenceError

from app.bridge import EngineBridge
from app.probe import DurationProbe
from app.transcripts import clock, output_targets

COLUMNS = ["File", "Duration", "Model", "State", "Progress", "Elapsed / ETA", "Slots", "Message"]
FILE, DURATION, MODEL, STATE, PROGRESS, TIMES, SLOTS, MESSAGE = range(len(COLUMNS))
PROGRESS_ROLE = Qt.UserRole + 1
PROGRESS_TEXT_ROLE = Qt.UserRole + 2  # what the bar says (windows done of all, while a file is in flight)
STATE_NAMES = {"queued": "Queued", "running": "Transcribing", "done": "Done", "failed": "Failed",
               "cancelled": "Cancelled"}


class ProgressDelegate(QStyledItemDelegate):
    """Paints a progress bar from the cell's percentage: cheaper than a widget per row."""

    def paint(self, painter, option, index) -> None:
        value = index.data(PROGRESS_ROLE)
        if value is None:
            return super().paint(painter, option, index)
        bar = QStyleOptionProgressBar()
        bar.rect = QRect(option.rect.adjusted(2, 3, -2, -3))
        bar.minimum, bar.maximum, bar.progress = 0, 100, int(value)
        bar.text, bar.textVisible = index.data(PROGRESS_TEXT_ROLE) or f"{int(value)}%", True
        QApplication.style().drawControl(QStyle.CE_ProgressBar, bar, painter)


class QueueView(QWidget):
    open_transcript = Signal(int)  # job id

    def __init__(self, bridge: EngineBridge, parent: QWidget | None = None):
        super().__init__(parent)
        self.bridge = bridge
        self.setAcceptDrops(True)
        self.rows: dict[int, int] = {}  # job id -> row
        self.window_texts: dict[int, dict[int, str]] = {}  # job in flight -> its finished windows' text
        self.probed: dict[int, float] = {}  # job id -> seconds read from the file's header (not yet decoded)
        self.probe = DurationProbe(self)
        self.probe.known.connect(self._on_duration)

        intro = QLabel("Drop audio or video files or folders here (folders are searched inside), or add them. "
                       "Each file's transcript is saved as it finishes, and the queue is kept between sessions.")
        intro.setWordWrap(True)
        self.table = QTableWidget(0, len(COLUMNS))
        self.table.setHorizontalHeaderLabels(COLUMNS)
        self.table.setSelectionBehavior(QAbstractItemView.SelectRows)
        self.table.setEditTriggers(QAbstractItemView.NoEditTriggers)
        self.table.verticalHeader().setVisible(False)
        self.table.setItemDelegateForColumn(PROGRESS, ProgressDelegate(self.table))
        header = self.table.horizontalHeader()
        header.setSectionResizeMode(QHeaderView.Interactive)
        header.setStretchLastSection(True)
        for column, width in ((FILE, 200), (DURATION, 70), (MODEL, 120), (STATE, 95), (PROGRESS, 140),
                              (TIMES, 100), (SLOTS, 50)):
            self.table.setColumnWidth(column, width)
        self.table.doubleClicked.connect(lambda index: self._open_row(index.row()))
        self.table.itemSelectionChanged.connect(self._update_buttons)

        self.add_files_button = QPushButton("Add files…")
        self.add_folder_button = QPushButton("Add folder…")
        self.cancel_button = QPushButton("Cancel")
        self.retry_button = QPushButton("Retry")
        self.remove_button = QPushButton("Remove")
        self.open_button = QPushButton("Open transcript")
        self.folder_button = QPushButton("Open output folder")
        self.add_files_button.clicked.connect(self._choose_files)
        self.add_folder_button.clicked.connect(self._choose_folder)
        self.cancel_button.clicked.connect(lambda: self._for_selected(self.bridge.cancel_job))
        self.retry_button.clicked.connect(lambda: self._for_selected(self.bridge.retry_job))
        self.remove_button.clicked.connect(lambda: self._for_selected(self.bridge.remove_job))
        self.open_button.clicked.connect(lambda: self._open_row(self.table.currentRow()))
        self.folder_button.clicked.connect(self.open_output_folder)
        buttons = QHBoxLayout()
        for b in (self.add_files_button, self.add_folder_button):
            buttons.addWidget(b)
        buttons.addStretch(1)
        for b in (self.cancel_button, self.retry_button, self.remove_button, self.open_button, self.folder_button):
            buttons.addWidget(b)
        self.summary = QLabel()

        layout = QVBoxLayout(self)
        layout.addWidget(intro)
        layout.addLayout(buttons)
        layout.addWidget(self.table)
        layout.addWidget(self.summary)

        bridge.job_changed.connect(self.refresh_job)
        bridge.jobs_added.connect(self.add_jobs)
        bridge.job_progress.connect(self._on_progress)
        bridge.job_text.connect(self._on_text)
        self.clock_timer = QTimer(self)
        self.clock_timer.timeout.connect(self._tick)
        self.clock_timer.start(500)
        self.reload()

    # ------------------------------------------------------------------ rows
    def reload(self) -> None:
        self.table.setRowCount(0)
        self.rows.clear()
        for job in self.bridge.jobs.list():
            self._show(job)
        self._update_buttons()
        self._summarize()

    def add_jobs(self, jobs: list) -> None:
        """Rows for newly queued jobs (one summary update per batch)."""
        self.table.setUpdatesEnabled(False)
        try:
            for job in jobs:
                self._show(job)
        finally:
            self.table.setUpdatesEnabled(True)
        self._update_buttons()
        self._summarize()

    def refresh_job(self, job_id: int) -> None:
        try:
            job = self.bridge.jobs.get(job_id)
        except CadenceError:  # removed
            row = self.rows.pop(job_id, None)
            if row is not None:
                self.table.removeRow(row)
                self.rows = {j: (r - 1 if r > row else r) for j, r in self.rows.items()}
            self._summarize()
            return
        self._show(job)
        self._update_buttons()
        self._summarize()

    def _cell(self, row: int, column: int) -> QTableWidgetItem:
        item = self.table.item(row, column)
        if item is None:
            item = QTableWidgetItem()
            self.table.setItem(row, column, item)
        return item

    def _show(self, job) -> None:
        row = self.rows.get(job.id)
        if row is None:
            row = self.table.rowCount()
            self.table.insertRow(row)
            self.rows[job.id] = row
        name = Path(job.path).name
        live = self.bridge.live_jobs.get(job.id)
        state = STATE_NAMES.get(job.state, job.state)
        if live is not None and live.started is None:
            state = "Waiting"  # for the model to load, or the audio to be read
        self._cell(row, FILE).setText(name)
        self._cell(row, FILE).setToolTip(job.path)
        self._cell(row, FILE).setData(Qt.UserRole, job.id)
        duration = job.duration if job.duration is not None else self.probed.get(job.id)
        self._cell(row, DURATION).setText(clock(duration))
        if duration is None and job.state in ("queued", "running"):
            self.probe.ask(job.id, job.path)  # read from the header on a thread; the cell fills in when known
        self._cell(row, MODEL).setText(job.model)
        self._cell(row, STATE).setText(state)
        done, total = job.windows_done, job.windows_total or 0
        if live is not None and live.total:
            done, total = live.done, live.total
        percent = 100 if job.state == "done" else (int(100 * done / total) if total else 0)
        self._set_progress(row, percent, done, total, live is not None)
        message = job.error or ""
        if job.state in ("done", "failed", "cancelled", "queued"):
            self.window_texts.pop(job.id, None)  # ended (or queued again): the stored outcome says it all
        elif self.window_texts.get(job.id):
            message = " ".join(t for _, t in sorted(self.window_texts[job.id].items()) if t)
        if job.state == "done" and job.result:
            stats = job.result.get("stats") or {}
            message = f"{len(job.result.get('text', '').split())} words"
            if stats.get("realtime_factor"):
                message += f", {stats['realtime_factor']}x real time"
        item = self._cell(row, MESSAGE)
        item.setText(message)
        item.setToolTip(message)
        item.setForeground(Qt.red if job.state == "failed" else self.palette().text().color())
        if job.state == "done":
            took = (job.result or {}).get("stats", {}).get("seconds")
            self._cell(row, TIMES).setText(clock(took) if took is not None else "")
            self._cell(row, SLOTS).setText("")
        elif live is None:
            self._cell(row, TIMES).setText("")
            self._cell(row, SLOTS).setText("")

    def _set_progress(self, row: int, percent: int, done: int, total: int, in_flight: bool) -> None:
        item = self._cell(row, PROGRESS)
        item.setData(PROGRESS_ROLE, percent)
        item.setData(PROGRESS_TEXT_ROLE, f"{percent}% ({done}/{total})" if in_flight and total > 1 else None)

    def progress_of(self, job_id: int) -> tuple[int, str]:
        """The bar's percentage and its text, as drawn."""
        item = self._cell(self.rows[job_id], PROGRESS)
        percent = item.data(PROGRESS_ROLE)
        return percent, item.data(PROGRESS_TEXT_ROLE) or f"{percent}%"

    def _on_progress(self, job_id: int, done: int, total: int) -> None:
        row = self.rows.get(job_id)
        if row is None:
            return
        self._set_progress(row, int(100 * done / total) if total else 0, done, total, True)
        if self._cell(row, STATE).text() == "Waiting":
            self._cell(row, STATE).setText("Transcribing")
            self._summarize()
        live = self.bridge.live_jobs.get(job_id)
        if live is not None and live.duration is not None:  # the engine has read the file: its own figure
            self._cell(row, DURATION).setText(clock(live.duration))

    def _on_text(self, job_id: int, index: int, text: str) -> None:
        """One more window finished: the row shows the text so far (the whole of it in the tooltip)."""
        texts = self.window_texts.setdefault(job_id, {})
        texts[index] = text
        row = self.rows.get(job_id)
        if row is not None and self._cell(row, STATE).text() not in ("Done", "Failed", "Cancelled"):
            joined = " ".join(t for _, t in sorted(texts.items()) if t)
            item = self._cell(row, MESSAGE)
            item.setText(joined)
            item.setToolTip(joined)

    def _on_duration(self, job_id: int, seconds: float) -> None:
        self.probed[job_id] = seconds
        row = self.rows.get(job_id)
        if row is not None and not self._cell(row, DURATION).text():
            self._cell(row, DURATION).setText(clock(seconds))

    def _tick(self) -> None:
        """Elapsed time, ETA and slots of the jobs in flight (no store reads)."""
        now = time.monotonic()
        for job_id, live in list(self.bridge.live_jobs.items()):
            row = self.rows.get(job_id)
            if row is None:
                continue
            if live.started is None:
                self._cell(row, TIMES).setText("")
                continue
            elapsed = now - live.started
            text = clock(elapsed)
            if live.done and live.total > live.done:
                text += f" / {clock(elapsed / live.done * (live.total - live.done))}"
            self._cell(row, TIMES).setText(text)
            self._cell(row, SLOTS).setText(",".join(self.bridge.slots_of(live.handle.id)))
        self._summarize()  # counts by state stay right however the row changes reached the window

    def _summarize(self) -> None:
        """Counts by state, from the rows themselves (no store query per change)."""
        counts: dict[str, int] = {}
        for row in range(self.table.rowCount()):
            item = self.table.item(row, STATE)
            state = item.text().lower() if item else ""
            counts[state] = counts.get(state, 0) + 1
        total = self.table.rowCount()
        parts = [f"{n} {state}" for state, n in sorted(counts.items()) if state]
        self.summary.setText(f"{total} file{'s' if total != 1 else ''}" + (f": {', '.join(parts)}" if parts else ""))

    # ------------------------------------------------------------------ actions
    def selected_jobs(self) -> list[int]:
        rows = sorted({index.row() for index in self.table.selectionModel().selectedRows()})
        return [self.table.item(r, FILE).data(Qt.UserRole) for r in rows if self.table.item(r, FILE)]

    def select_job(self, job_id: int) -> None:
        """Select that job's row alone. (QTableWidget.selectRow follows the keyboard's modifiers, so with
        Ctrl down, or left down by a synthetic key press, it toggled the row instead of selecting it.)"""
        row = self.rows.get(job_id)
        if row is not None:
            flags = QItemSelectionModel.SelectionFlag
            self.table.selectionModel().setCurrentIndex(self.table.model().index(row, 0),
                                                        flags.ClearAndSelect | flags.Rows)

    def _for_selected(self, action) -> None:
        for job_id in self.selected_jobs():
            try:
                action(job_id)
            except CadenceError as exc:
                self.window().statusBar().showMessage(str(exc), 10000)

    def _update_buttons(self) -> None:
        chosen = self.selected_jobs()
        states = set()
        for job_id in chosen:
            try:
                states.add(self.bridge.jobs.get(job_id).state)
            except CadenceError:
                pass
        self.cancel_button.setEnabled(bool(states & {"queued", "running"}))
        self.retry_button.setEnabled(bool(states & {"failed", "cancelled"}))
        self.remove_button.setEnabled(bool(chosen))
        self.open_button.setEnabled(len(chosen) == 1 and (states == {"done"} or chosen[0] in self.bridge.live_jobs))
        self.folder_button.setEnabled(len(chosen) == 1)

    def _open_row(self, row: int) -> None:
        item = self.table.item(row, FILE) if row >= 0 else None
        if item is not None:
            self.open_transcript.emit(item.data(Qt.UserRole))

    def output_folder(self, job_id: int) -> Path:
        job = self.bridge.jobs.get(job_id)
        outputs = (job.result or {}).get("outputs")
        if outputs:
            return Path(outputs[0]).parent
        targets = output_targets(job)
        return targets[0].parent if targets else Path(job.path).parent

    def open_output_folder(self) -> None:
        chosen = self.selected_jobs()
        if chosen:
            QDesktopServices.openUrl(QUrl.fromLocalFile(str(self.output_folder(chosen[0]))))

    def _choose_files(self) -> None:
        patterns = " ".join(f"*{e}" for e in sorted(AUDIO_EXTENSIONS))
        files, _ = QFileDialog.getOpenFileNames(self, "Add recordings", "", f"Audio and video ({patterns});;All files (*)")
        if files:
            self.bridge.add_paths(files)

    def _choose_folder(self) -> None:
        folder = QFileDialog.getExistingDirectory(self, "Add a folder of recordings")
        if folder:
            self.bridge.add_paths([folder])

    # ------------------------------------------------------------------ drag and drop
    def dragEnterEvent(self, event) -> None:
        if event.mimeData().hasUrls():
            event.acceptProposedAction()

    def dragMoveEvent(self, event) -> None:
        if event.mimeData().hasUrls():
            event.acceptProposedAction()

    def dropEvent(self, event) -> None:
        paths = [u.toLocalFile() for u in event.mimeData().urls() if u.isLocalFile()]
        if paths:
            event.acceptProposedAction()
            self.bridge.add_paths(paths)
