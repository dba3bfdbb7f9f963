"""The main window: Transcribe (queue + transcript), Record, Chats, Engine, Settings and Models tabs.

It builds the :class:`app.bridge.EngineBridge` (which owns the engine) and hands it to each view.
Closing the window saves a recording in progress, ends answers in flight (kept as interrupted)
and leaves unfinished jobs in the store, where the next start resumes them.
"""

from __future__ import annotations

from PySide6.QtCore import Qt
from PySide6.QtGui import QIcon
from PySide6.QtWidgets import (
    QLabel,
    QMainWindow,
    QSplitter,
    QTableWidget,
    QTableWidgetItem,
    QTabWidget,
    QVBoxLayout,
    QWidget,
)

from engine.backend import available_backends
from engine.errors import CadenceError
from engine.models import list_models

from app.bridge import EngineBridge
from app.chat_view import ChatView
from app.engine_panel import EnginePanel
from app.queue_view import QueueView
from app.record_view import RecordView
from app.recorder import recover_recordings
from app.remote_status import RemotePoller
from app.resources import icon_path
from app.settings import Settings
from app.settings_panel import SettingsPanel
from app.transcript_view import TranscriptView


def model_problem(name: str) -> str | None:
    """A sentence when a chosen model cannot be used here (checked without any network access)."""
    from pathlib import Path

    from engine.models import resolve

    builtin = {m["name"]: m for m in list_models()}
    if name in builtin:
        m = builtin[name]
        return None if m["available"] else f"{name} cannot be used: {m['detail']}"
    if "/" in name and not Path(name).expanduser().exists():
        return None  # a hub id: only checked when it is first used
    try:
        resolve(name)
    except CadenceError as exc:
        return str(exc)
    return None


class MainWindow(QMainWindow):
    def __init__(self, settings: Settings | None = None, resume: bool = True) -> None:
        super().__init__()
        self.setWindowTitle("Cadence")
        self.setWindowIcon(QIcon(str(icon_path())))
        self.resize(1180, 760)
        self.settings = settings or Settings()
        self.bridge = EngineBridge(self.settings, self)
        self.bridge.problem.connect(self.show_problem)
        self.bridge.start(resume=resume)

        self.queue = QueueView(self.bridge)
        self.transcript = TranscriptView(self.bridge)
        self.recording = RecordView(self.bridge)
        self.chats = ChatView(self.bridge)
        self.engine_panel = EnginePanel()
        self.settings_panel = SettingsPanel(self.bridge)
        self.bridge.status_changed.connect(self.engine_panel.update_status)
        self.remote_poller = RemotePoller(self.bridge)  # a server's slots and metrics, while the engine is one
        self.queue.open_transcript.connect(self.open_transcript)
        self.transcript.chat_about.connect(self.chat_about)
        self.chats.notice.connect(lambda sentence: self.statusBar().showMessage(sentence, 5000))
        self.recording.recorded.connect(lambda _path: self.statusBar().showMessage("The recording was queued.", 8000))

        transcribe = QSplitter(Qt.Vertical)
        transcribe.addWidget(self.queue)
        transcribe.addWidget(self.transcript)
        transcribe.setSizes([380, 340])
        self.tabs = QTabWidget()
        self.tabs.addTab(transcribe, "Transcribe")
        self.tabs.addTab(self.recording, "Record")
        self.tabs.addTab(self.chats, "Chats")
        self.tabs.addTab(self.engine_panel, "Engine")
        self.tabs.addTab(self.settings_panel, "Settings")
        self.tabs.addTab(self._models_tab(), "Models")
        page = QWidget()
        layout = QVBoxLayout(page)
        layout.setContentsMargins(4, 4, 4, 4)
        self.banner = QLabel()
        self.banner.setWordWrap(True)
        self.banner.setStyleSheet("background: #fff4ce; padding: 6px; border: 1px solid #e0c060")
        self.banner.hide()
        layout.addWidget(self.banner)
        layout.addWidget(self.tabs)
        self.setCentralWidget(page)
        self.tabs.currentChanged.connect(self._engine_panel_shown)
        self._engine_panel_shown()
        self.remote_poller.start()
        self._first_run()
        self.statusBar().showMessage(f"Backends here: {', '.join(available_backends())}", 10000)
        for path in recover_recordings():  # a crash mid-recording: what was written is kept and queued
            self.bridge.add_paths([path])
            self.show_problem(f"A recording interrupted by a crash was kept and queued: {path.name}.")

    # ------------------------------------------------------------------ pieces
    def _models_tab(self) -> QWidget:
        page = QWidget()
        layout = QVBoxLayout(page)
        intro = QLabel("Models Cadence can run on this machine. The defaults install as ordinary packages, so nothing "
                       "is downloaded when you use them. The larger Whisper models are used by name once their folder "
                       "is in the models folder of your data (or, with a network, downloaded on first use).")
        intro.setWordWrap(True)
        layout.addWidget(intro)
        rows = list_models()
        self.models_table = QTableWidget(len(rows), 6)
        self.models_table.setHorizontalHeaderLabels(["Model", "Kind", "Size", "Here", "Source", "Description"])
        for i, row in enumerate(rows):
            values = [row["name"], row["family"], row.get("size", ""), "yes" if row["available"] else "no",
                      row["source"], row["description"]]
            for j, value in enumerate(values):
                item = QTableWidgetItem(value)
                item.setFlags(item.flags() & ~Qt.ItemIsEditable)
                if not row["available"]:
                    item.setToolTip(row["detail"])
                self.models_table.setItem(i, j, item)
        self.models_table.resizeColumnsToContents()
        layout.addWidget(self.models_table)
        return page

    def _first_run(self) -> None:
        """Say plainly when a default model is missing and what to do; otherwise greet once."""
        problems = [p for p in (model_problem(self.settings.transcription_model),
                                model_problem(self.settings.chat_model)) if p and not self.bridge.remote]
        if problems:
            self.banner.setText(" ".join(problems) + " Choose another model on the Settings tab.")
            self.banner.show()
        elif not self.settings.first_run_done:
            self.banner.setText("Welcome to Cadence. The default models are installed and everything runs on this "
                                "computer, offline: drop recordings on the Transcribe tab, or start a chat.")
            self.banner.show()
        self.settings.first_run_done = True

    def _engine_panel_shown(self, *_) -> None:
        """A server is asked for its slots and metrics only while someone looks at them."""
        self.remote_poller.active = self.tabs.currentWidget() is self.engine_panel

    def show_problem(self, sentence: str) -> None:
        self.statusBar().showMessage(sentence, 15000)

    def open_transcript(self, job_id: int) -> None:
        if self.transcript.show_job(job_id):
            self.tabs.setCurrentIndex(0)

    def chat_about(self, job_id: int) -> None:
        """*Chat about this transcript*: the Chats tab is shown first (showing it moves the keyboard focus
        into it, to its "New chat" button, where a space typed at once would start a plain chat), then
        the new conversation opens with its input focused, so a question typed at once goes to it whole."""
        self.tabs.setCurrentWidget(self.chats)
        self.chats.chat_about_job(job_id)

    # ------------------------------------------------------------------ closing
    def closeEvent(self, event) -> None:
        try:
            if self.recording.recorder.state != "idle":
                self.recording.stop()  # saved and queued: it resumes with the other jobs next time
        except CadenceError as exc:
            self.show_problem(str(exc))
        self.transcript.player.stop()
        self.queue.probe.stop()
        self.remote_poller.stop()
        self.bridge.close()
        super().closeEvent(event)
