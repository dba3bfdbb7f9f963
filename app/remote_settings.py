"""Settings' "Engine: this computer / a server" box: the server's address and API key (kept by app.keys:
the system keyring, else this session only), and *Test connection*, which asks the server's ``/v1/models``
on a thread of its own and answers in one sentence; the names it lists fill the model choices."""

from __future__ import annotations

import threading

from PySide6.QtCore import Signal
from PySide6.QtWidgets import QComboBox, QFormLayout, QGroupBox, QHBoxLayout, QLabel, QLineEdit, QPushButton

from engine.errors import CadenceError
from engine.remote import RemoteEngine, server_url

from app.keys import where_kept

MODES = (("This computer", "local"), ("A server (Cadence, vLLM, llama.cpp)", "server"))
CONNECT_TIMEOUT_S = 10.0
SERVER_NOTE = ("A server runs its own engine, so backend, batching, drafting, precision, context, how recordings "
               "are cut and telling speakers apart are set where it runs (greyed out here), and recording needs "
               "\"This computer\".")


LISTED: dict[str, list[str]] = {}  # a server's API address -> the names it listed at its last connection test


def listed_chat_models(bridge) -> list[str] | None:
    """The chat models the bridge's server listed when it was last asked; None on this computer's engine (or a
    server not asked yet): the caller offers this computer's models instead."""
    if not bridge.remote:
        return None
    names = LISTED.get(bridge.engine.url)
    return None if names is None else [n for n in names if n not in whisper_names(names)]


def test_connection(url: str, key: str | None) -> tuple[bool, str, list[str]]:
    """(reachable, one sentence, the model names the server lists)."""
    try:
        engine = RemoteEngine(url, key or None, timeout=CONNECT_TIMEOUT_S, retries=0)
    except CadenceError as exc:
        return False, str(exc), []
    try:
        names = engine.models()
    except CadenceError as exc:
        return False, str(exc), []
    finally:
        engine.shutdown()
    LISTED[engine.url] = list(names)
    if not names:
        return False, f"The server at {engine.url} answered but lists no models.", []
    return True, f"Reachable: the server at {engine.url} lists {len(names)} model{'s' if len(names) != 1 else ''} " \
                 f"({', '.join(names)}).", names


def whisper_names(names: list[str]) -> list[str]:
    """The names that are speech-to-text models (as the command line picks them: 'whisper' in the name)."""
    return [n for n in names if "whisper" in n.lower()]


class ServerBox(QGroupBox):
    """The mode, address and key; ``tested`` carries each connection test's (reachable, sentence, names)."""

    tested = Signal(bool, str, list)

    def __init__(self, settings, parent=None):
        super().__init__("Engine: this computer or a server", parent)
        self.mode = QComboBox()
        for label, value in MODES:
            self.mode.addItem(label, value)
        self.mode.setCurrentIndex(max(0, self.mode.findData(settings.engine_mode)))
        self.url = QLineEdit(settings.server_url)
        self.url.setPlaceholderText("http://gpu-box:8000 (cadence serve, vLLM or llama.cpp's server)")
        self.key = QLineEdit(settings.api_key)
        self.key.setEchoMode(QLineEdit.Password)
        self.key.setPlaceholderText("the server's API key, if it needs one")
        self.key_note = QLabel(where_kept())
        self.key_note.setWordWrap(True)
        self.test_button = QPushButton("Test connection")
        self.test_button.clicked.connect(self.test)
        self.result = QLabel()
        self.result.setWordWrap(True)
        self.note = QLabel(SERVER_NOTE)
        self.note.setWordWrap(True)
        test_row = QHBoxLayout()
        test_row.addWidget(self.test_button)
        test_row.addWidget(self.result, 1)
        form = QFormLayout(self)
        form.addRow("Engine", self.mode)
        form.addRow("Server address", self.url)
        form.addRow("API key", self.key)
        form.addRow("", self.key_note)
        form.addRow(test_row)
        form.addRow(self.note)
        self.tests = 0  # connection tests answered (tests read it)
        self._testing = False
        self.tested.connect(self._show_result)
        self.mode.currentIndexChanged.connect(self._mode_changed)
        self._mode_changed()

    @property
    def server_mode(self) -> bool:
        return self.mode.currentData() == "server"

    def _mode_changed(self, *_) -> None:
        on = self.server_mode
        for widget in (self.url, self.key, self.key_note, self.test_button, self.result, self.note):
            widget.setEnabled(on)
        self.note.setVisible(on)

    def checked_url(self) -> str:
        """The address as the API's base URL; CadenceError with one sentence when it is not one."""
        return server_url(self.url.text())

    def test(self) -> None:
        """Ask the server on a thread of its own (a dead address can take seconds); ``tested`` answers."""
        if self._testing:
            return
        self._testing = True
        self.test_button.setEnabled(False)
        self.result.setText("Asking the server…")
        url, key = self.url.text(), self.key.text().strip()

        def work():
            try:
                answer = test_connection(url, key)
            except Exception as exc:  # nothing the client raises may reach the person as a traceback
                answer = (False, f"The connection test failed ({exc.__class__.__name__}).", [])
            self.tested.emit(*answer)

        threading.Thread(target=work, name="cadence-app-connection-test", daemon=True).start()

    def _show_result(self, ok: bool, sentence: str, names: list) -> None:
        self._testing = False
        self.test_button.setEnabled(self.server_mode)
        self.result.setText(sentence)
        self.result.setStyleSheet("" if ok else "color: #b00020")
        self.tests += 1
