"""Shared pieces for the desktop app's tests: a private home (data folder + settings file) per test,
opening the real window offscreen, dropping files on it, and waiting without blocking Qt."""

from __future__ import annotations

from pathlib import Path

import pytest
import warnings

from PySide6.QtCore import QMimeData, QPointF, Qt, QUrl
from PySide6.QtGui import QDragEnterEvent, QDropEvent
from PySide6.QtWidgets import QApplication

CHAT_TOKENS = 24  # answers stay short so the suite stays quick


@pytest.fixture
def app_home(tmp_path, monkeypatch):
    """A data folder and a settings file of this test's own; returns a factory for Settings on them."""
    from app.settings import Settings

    data = tmp_path / "data"
    data.mkdir()
    monkeypatch.setenv("CADENCE_DATA_DIR", str(data))
    ini = tmp_path / "settings.ini"

    def settings(**values) -> Settings:
        s = Settings(ini)
        for key, value in values.items():
            setattr(s, key, value)
        return s

    first = settings(max_width=8, first_run_done=True)
    first.q.sync()
    return settings


def open_window(qtbot, settings, resume: bool = True):
    from app.main_window import MainWindow

    window = MainWindow(settings, resume=resume)
    qtbot.addWidget(window)
    window.show()
    qtbot.waitExposed(window)
    return window


def drop_files(widget, paths) -> None:
    """Drop files on a widget the way a file manager does (a real QDropEvent through Qt)."""
    mime = QMimeData()
    mime.setUrls([QUrl.fromLocalFile(str(Path(p))) for p in paths])
    center = widget.rect().center()
    with warnings.catch_warnings():  # PySide6 marks the QPoint constructor deprecated; it is the one Qt has
        warnings.simplefilter("ignore", DeprecationWarning)
        enter = QDragEnterEvent(center, Qt.CopyAction, mime, Qt.LeftButton, Qt.NoModifier)
    QApplication.sendEvent(widget, enter)  # Qt delivers a drop only to a widget the drag entered
    assert enter.isAccepted(), "the widget refused the drag"
    drop = QDropEvent(QPointF(center), Qt.CopyAction, mime, Qt.LeftButton, Qt.NoModifier)
    QApplication.sendEvent(widget, drop)
    assert drop.isAccepted(), "the widget refused the drop"


def wait_jobs_settled(qtbot, window, timeout: float = 120) -> None:
    """Until no job is in flight and every row shows its stored state."""
    qtbot.waitUntil(lambda: not window.bridge.transcribing, timeout=int(timeout * 1000))
    qtbot.wait(100)  # the last signals reach the window


def wait_answers(qtbot, window, timeout: float = 120) -> None:
    qtbot.waitUntil(lambda: not window.bridge.live_replies, timeout=int(timeout * 1000))
    qtbot.wait(100)


def row_texts(table) -> list[list[str]]:
    return [[table.item(r, c).text() if table.item(r, c) else "" for c in range(table.columnCount())]
            for r in range(table.rowCount())]


def short_params(max_tokens: int = CHAT_TOKENS):
    from engine.sampling import SamplingParams

    return SamplingParams(max_tokens=max_tokens)


def type_text(text: str) -> None:
    """Type as a keyboard does: each key goes to whichever widget has the keyboard focus at that moment."""
    from PySide6.QtTest import QTest

    for character in text:
        focus = QApplication.focusWidget()
        assert focus is not None, "no widget has the keyboard focus"
        QTest.keyClick(focus, character)


def click_link(qtbot, browser, href: str) -> None:
    """Click the link to ``href`` in a QTextBrowser with the mouse, where it is drawn."""
    from PySide6.QtCore import QPoint
    from PySide6.QtGui import QTextCursor

    document = browser.document()
    block = document.begin()
    while block.isValid():
        it = block.begin()
        while not it.atEnd():
            fragment = it.fragment()
            if fragment.charFormat().anchorHref() == href:
                cursor = QTextCursor(document)
                cursor.setPosition(fragment.position())
                browser.setTextCursor(cursor)
                browser.ensureCursorVisible()
                rect = browser.cursorRect(cursor)
                point = QPoint(rect.x() + 3, rect.center().y())
                assert browser.anchorAt(point) == href, f"{href} is not drawn at {point}"
                qtbot.mouseClick(browser.viewport(), Qt.LeftButton, pos=point)
                return
            it += 1
        block = block.next()
    raise AssertionError(f"no link to {href} in the document")


def chat_equals_servers_answer(qtbot, window, client, model: str, prompt: str, max_tokens: int):
    """A new chat sent from the window's Chats tab (greedy, ``max_tokens``), streamed through the server the window
    is set to and stored, equals the server's own greedy answer asked directly with ``client`` (an openai client):
    (the stored answer, the server's direct completion), for the caller's further checks."""
    chats = window.chats
    conversation_id = chats.new_chat()
    assert chats.apply_settings(params=short_params(max_tokens))
    assert chats.send(prompt), chats.error.text()
    wait_answers(qtbot, window, timeout=300)
    answer = window.bridge.conversations.get(conversation_id).messages[-1]
    direct = client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                            max_tokens=max_tokens, temperature=0)
    assert answer.state == "complete" and answer.content == direct.choices[0].message.content, \
        (answer.state, answer.error, answer.content, direct.choices[0].message.content)
    return answer, direct
