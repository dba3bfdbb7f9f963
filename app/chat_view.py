"""Chats: the list of conversations and the open one, with streamed answers.

Several conversations can be answered at once (each answer is one engine slot); only the open
one is drawn, at most every :data:`REDRAW_MS`, however fast tokens arrive. Answers are drawn as
Markdown (:mod:`app.chat_markdown`: headings, lists, tables, coloured code blocks with a Copy link
each); a message's own Copy link copies its Markdown source. Every answer shows its speed (live
while streaming, the engine's own figure once done). Stop, regenerate, edit the last message,
per-chat settings and export are here; versions made by regenerate/edit are kept.
"""

from __future__ import annotations

import html
import time
from pathlib import Path

from PySide6.QtCore import Qt, QTimer, QUrl, Signal
from PySide6.QtGui import QDesktopServices, QFontDatabase
from PySide6.QtWidgets import (
    QApplication,
    QFileDialog,
    QHBoxLayout,
    QLabel,
    QListWidget,
    QListWidgetItem,
    QPlainTextEdit,
    QPushButton,
    QSplitter,
    QTextBrowser,
    QVBoxLayout,
    QWidget,
)

from engine.errors import CadenceError

from app.bridge import EngineBridge
from app.chat_markdown import MarkdownRenderer, copy_kind, copy_link, style_sheet
from app.chat_settings import ChatSettingsDialog
from app.remote_settings import listed_chat_models

REDRAW_MS = 80  # at most ~12 redraws a second while an answer streams
DRAW_SHARE = 0.25  # ... and fewer when a redraw is slow: drawing takes at most this share of the window's time
OPEN_LINK_SCHEMES = ("http", "https", "mailto")
TRANSCRIPT_SUGGESTION = "Summarize this recording in three sentences."  # links in answers the browser or mail program may open
STATE_NOTES = {"stopped": "stopped", "interrupted": "interrupted: the app closed while it was written",
               "streaming": "writing…"}
# An answer the model had not finished when it reached the length limit (or the end of the context).
LENGTH_NOTE = "cut off at the length limit (Chat settings… sets it)"


class ChatView(QWidget):
    conversation_opened = Signal(int)
    notice = Signal(str)  # a short note for the status bar ("The code is on the clipboard.")

    def __init__(self, bridge: EngineBridge, parent: QWidget | None = None):
        super().__init__(parent)
        self.bridge = bridge
        self.current: int | None = None
        self.conversation = None  # the open Conversation (messages of its active branch)
        self.live_text: dict[int, tuple[str, float]] = {}  # answer id -> (text so far, tok/s), open chat only
        self.editing: int | None = None  # the user message being edited
        self.markdown = MarkdownRenderer()
        self.copyable: dict[str, str] = {}  # Copy link -> the text it copies, for what is drawn now
        self.redraw_ms = REDRAW_MS  # the pause before the next streaming redraw (longer when drawing is slow)

        self.list = QListWidget()
        self.list.currentItemChanged.connect(lambda item, _old: item is not None and self.open(item.data(Qt.UserRole)))
        self.new_button = QPushButton("New chat")
        self.delete_button = QPushButton("Delete")
        self.new_button.clicked.connect(lambda: self.new_chat())
        self.delete_button.clicked.connect(self.delete_current)
        left = QWidget()
        left_layout = QVBoxLayout(left)
        left_layout.setContentsMargins(0, 0, 0, 0)
        row = QHBoxLayout()
        row.addWidget(self.new_button)
        row.addWidget(self.delete_button)
        left_layout.addLayout(row)
        left_layout.addWidget(self.list)

        self.header = QLabel("Start a new chat, or pick one on the left.")
        self.header.setWordWrap(True)
        self.settings_button = QPushButton("Chat settings…")
        self.export_button = QPushButton("Export…")
        self.settings_button.clicked.connect(self.edit_settings)
        self.export_button.clicked.connect(self._choose_export)
        self.view = QTextBrowser()
        self.view.setOpenLinks(False)
        self.view.document().setDefaultStyleSheet(style_sheet(QFontDatabase.systemFont(QFontDatabase.FixedFont).family()))
        self.view.anchorClicked.connect(self.follow_link)
        self.input = QPlainTextEdit()
        self.input.setPlaceholderText("Write a message (Ctrl+Enter sends)")
        self.input.setMaximumHeight(90)
        self.send_button = QPushButton("Send")
        self.stop_button = QPushButton("Stop")
        self.regenerate_button = QPushButton("Regenerate")
        self.edit_button = QPushButton("Edit last message")
        self.older_button = QPushButton("◀ Older version")
        self.newer_button = QPushButton("Newer version ▶")
        self.older_button.clicked.connect(lambda: self.show_version(-1))
        self.newer_button.clicked.connect(lambda: self.show_version(+1))
        self.send_button.setShortcut("Ctrl+Return")
        self.send_button.clicked.connect(self.send_input)
        self.stop_button.clicked.connect(self.stop)
        self.regenerate_button.clicked.connect(self.regenerate)
        self.edit_button.clicked.connect(self.begin_edit)
        self.error = QLabel()
        self.error.setWordWrap(True)
        self.error.setStyleSheet("color: #b00020")

        right = QWidget()
        rl = QVBoxLayout(right)
        rl.setContentsMargins(0, 0, 0, 0)
        top = QHBoxLayout()
        top.addWidget(self.header, 1)
        top.addWidget(self.settings_button)
        top.addWidget(self.export_button)
        rl.addLayout(top)
        rl.addWidget(self.view, 1)
        rl.addWidget(self.error)
        rl.addWidget(self.input)
        actions = QHBoxLayout()
        for b in (self.edit_button, self.regenerate_button, self.older_button, self.newer_button):
            actions.addWidget(b)
        actions.addStretch(1)
        actions.addWidget(self.stop_button)
        actions.addWidget(self.send_button)
        rl.addLayout(actions)

        split = QSplitter()
        split.addWidget(left)
        split.addWidget(right)
        split.setSizes([240, 720])
        layout = QVBoxLayout(self)
        layout.addWidget(split)

        self.redraw_timer = QTimer(self)
        self.redraw_timer.setSingleShot(True)
        self.redraw_timer.timeout.connect(self.render)
        bridge.reply_update.connect(self._on_update)
        bridge.reply_ended.connect(self._on_ended)
        self.reload_list()
        self._update_buttons()

    # ------------------------------------------------------------------ list
    def reload_list(self) -> None:
        self.list.blockSignals(True)
        self.list.clear()
        for conv in self.bridge.conversations.list():
            item = QListWidgetItem(self._list_label(conv["id"], conv["title"]))
            item.setData(Qt.UserRole, conv["id"])
            self.list.addItem(item)
            if conv["id"] == self.current:
                self.list.setCurrentItem(item)
        self.list.blockSignals(False)

    def _list_label(self, conversation_id: int, title: str) -> str:
        busy = self.bridge.answering(conversation_id) is not None
        return ("● " if busy else "") + (title or f"New chat {conversation_id}")

    def _refresh_list_item(self, conversation_id: int) -> None:
        for i in range(self.list.count()):
            item = self.list.item(i)
            if item.data(Qt.UserRole) == conversation_id:
                try:
                    title = self.bridge.conversations.get(conversation_id).title
                except CadenceError:
                    return
                item.setText(self._list_label(conversation_id, title))

    # ------------------------------------------------------------------ opening and drawing
    def _open_created(self, create) -> int | None:
        """Create a conversation with ``create()`` and open it; a refusal shows its sentence."""
        try:
            conversation_id = create()
        except CadenceError as exc:
            self.error.setText(str(exc))
            return None
        self.current = conversation_id
        self.reload_list()
        self.open(conversation_id)
        return conversation_id

    def new_chat(self, model: str | None = None) -> int | None:
        conversation_id = self._open_created(
            lambda: self.bridge.conversations.create(model or self.bridge.settings.chat_model))
        if conversation_id is not None:
            self.input.setFocus()
        return conversation_id

    def chat_about_job(self, job_id: int) -> int | None:
        """Open a new conversation about a finished transcript, its input focused: what is typed next is
        its first message (the suggested question is selected, so typing replaces it). Call it with this
        view shown: a tab being shown moves the keyboard focus to its first button ("New chat")."""
        conversation_id = self._open_created(lambda: self.bridge.conversations.create_about_transcript(
            job_id, model=self.bridge.settings.chat_model)[0])
        if conversation_id is not None:
            self.input.setPlainText(TRANSCRIPT_SUGGESTION)
            self.input.selectAll()
            self.input.setFocus()
        return conversation_id

    def open(self, conversation_id: int) -> None:
        try:
            self.conversation = self.bridge.conversations.get(conversation_id)
        except CadenceError as exc:
            self.error.setText(str(exc))
            return
        if conversation_id != self.current:
            self.editing = None
        self.current = conversation_id
        self.live_text = {}
        live = self.bridge.answering(conversation_id)
        if live is not None:
            self.live_text[live.reply.message_id] = (live.reply.text, live.tok_s)
        c = self.conversation
        about = (c.context or {}).get("transcript")
        self.header.setText(f"<b>{html.escape(c.title or 'New chat')}</b> — {html.escape(c.model)}"
                            + (f" — about {html.escape(Path(about['file']).name)}" if about and about.get("file") else ""))
        self.error.clear()
        self._select_in_list(conversation_id)
        self.render()
        self._update_buttons()
        self.conversation_opened.emit(conversation_id)

    def _select_in_list(self, conversation_id: int) -> None:
        """The list's selection follows the open conversation, however it was opened."""
        for i in range(self.list.count()):
            item = self.list.item(i)
            if item.data(Qt.UserRole) == conversation_id:
                if self.list.currentItem() is not item:
                    self.list.blockSignals(True)
                    self.list.setCurrentItem(item)
                    self.list.blockSignals(False)
                return

    def showEvent(self, event) -> None:
        super().showEvent(event)
        self.render()  # what arrived while the tab was hidden

    def render(self) -> None:
        if self.isVisible():  # else drawn when shown: a hidden chat costs nothing however fast it streams
            self._draw()

    def _draw(self) -> None:
        started = time.perf_counter()
        self.copyable = {}
        if self.conversation is None:
            self.view.clear()
            return
        parts = [self._message_html(m) for m in self.conversation.messages]
        if not parts:
            parts.append("<p style='color:#666'>No messages yet. Write one below.</p>")
        bar = self.view.verticalScrollBar()
        at_end = bar.value() >= bar.maximum() - 4
        self.view.setHtml("".join(parts))
        if at_end:
            bar.setValue(bar.maximum())
        self.redraw_ms = max(REDRAW_MS, int((time.perf_counter() - started) * 1000 / DRAW_SHARE))

    def _message_html(self, m) -> str:
        """One message: who wrote it and its Copy link, then its text (an answer as Markdown) and notes."""
        live = m.id in self.live_text
        text, tok_s = self.live_text.get(m.id, (m.content, None))
        who = "You" if m.role == "user" else "Assistant"
        version = f" (version {m.sibling_index + 1} of {m.siblings})" if m.siblings > 1 else ""
        link = copy_link("message", m.id)
        self.copyable[link] = text  # the Markdown source, as written
        head = f"<b>{who}</b>{version} &nbsp;<small><a href='{link}' style='text-decoration:none'>Copy</a></small>"
        if m.role == "user":
            body = html.escape(text).replace("\n", "<br>") or "<i>…</i>"
            return f"<div style='background:#eef3fb; margin:4px'>{head}<br>{body}</div>"
        rendered = self.markdown.render(text, str(m.id), keep=not live)
        for number, code in enumerate(rendered.code_blocks):
            self.copyable[copy_link("code", m.id, number)] = code
        foot = []
        speed = tok_s if live else (m.stats.get("decode_tok_s") or m.stats.get("tok_s"))  # (a server's: tok_s)
        if live:
            foot.append("writing…")
        elif m.state in STATE_NOTES:
            foot.append(STATE_NOTES[m.state])
        if m.state == "failed" and m.error:
            foot.append(f"<span style='color:#b00020'>{html.escape(m.error)}</span>")
        if m.stats.get("tokens"):
            foot.append(f"{m.stats['tokens']} tokens")
        if m.state == "complete" and m.stats.get("finish_reason") == "length":
            foot.append(LENGTH_NOTE)
        if speed:
            foot.append(f"{speed:.1f} tok/s")
        if m.stats.get("dropped_turns"):
            foot.append(f"{m.stats['dropped_turns']} earlier turns left out to fit")
        return (f"<div style='background:#f6f6f6; margin:4px'>{head}</div>"
                f"<div style='margin-left:4px; margin-right:4px'>{rendered.html or '<p><i>…</i></p>'}</div>"
                + (f"<p style='margin:4px'><small style='color:#666'>{' · '.join(foot)}</small></p>" if foot else ""))

    def rendered_text(self) -> str:
        """What the open conversation shows (drawn now, even while the tab is hidden)."""
        self._draw()
        return self.view.toPlainText()

    def follow_link(self, url: QUrl) -> None:
        """A Copy link puts what it names on the clipboard, as drawn (a message's Markdown source, or one
        code block's code); a web or mail link opens outside the app; nothing else is followed."""
        href = url.toString()
        kind = copy_kind(href)
        if kind is not None:
            if href in self.copyable:
                QApplication.clipboard().setText(self.copyable[href])
                self.notice.emit(f"The {'code' if kind == 'code' else 'message'} is on the clipboard.")
        elif url.scheme() in OPEN_LINK_SCHEMES:
            QDesktopServices.openUrl(url)

    def _on_update(self, conversation_id: int, message_id: int, text: str, tok_s: float) -> None:
        if conversation_id != self.current:
            return
        if self.conversation is not None and all(m.id != message_id for m in self.conversation.messages):
            self.conversation = self.bridge.conversations.get(conversation_id)  # a new answer row
        self.live_text[message_id] = (text, tok_s)
        if not self.redraw_timer.isActive():
            self.redraw_timer.start(self.redraw_ms)

    def _on_ended(self, conversation_id: int, message_id: int, error: str) -> None:
        self._refresh_list_item(conversation_id)
        if conversation_id != self.current:
            return
        self.live_text.pop(message_id, None)
        try:
            self.conversation = self.bridge.conversations.get(conversation_id)
        except CadenceError:
            self.reload_list()
            return
        if error:
            self.error.setText(error)
        self.render()
        self._update_buttons()

    def _update_buttons(self) -> None:
        has = self.conversation is not None
        busy = has and self.bridge.answering(self.current) is not None
        messages = self.conversation.messages if has else []
        self.send_button.setEnabled(has and not busy)
        self.send_button.setText("Send edit" if self.editing else "Send")
        self.stop_button.setEnabled(bool(busy))
        self.regenerate_button.setEnabled(has and not busy and any(m.role == "assistant" for m in messages))
        self.edit_button.setEnabled(has and not busy and any(m.role == "user" for m in messages))
        for w in (self.settings_button, self.export_button, self.delete_button):
            w.setEnabled(has)
        versioned = self._versioned_message()
        self.older_button.setEnabled(not busy and versioned is not None and versioned.sibling_index > 0)
        self.newer_button.setEnabled(not busy and versioned is not None and versioned.sibling_index < versioned.siblings - 1)

    # ------------------------------------------------------------------ actions
    def _run(self, action) -> bool:
        try:
            action()
        except CadenceError as exc:
            self.error.setText(str(exc))
            return False
        self.error.clear()
        self.open(self.current)
        self._refresh_list_item(self.current)
        return True

    def send(self, text: str) -> bool:
        if self.current is None and self.new_chat() is None:
            return False
        editing, self.editing = self.editing, None
        if editing is not None:
            return self._run(lambda: self.bridge.edit(editing, text))
        return self._run(lambda: self.bridge.send(self.current, text))

    def send_input(self) -> None:
        if self.send(self.input.toPlainText()):
            self.input.clear()
        self._update_buttons()

    def stop(self) -> None:
        live = self.bridge.answering(self.current) if self.current is not None else None
        if live is not None:
            self.bridge.stop_answer(live.reply.message_id)

    def regenerate(self) -> None:
        answers = [m for m in (self.conversation.messages if self.conversation else []) if m.role == "assistant"]
        if answers:
            self._run(lambda: self.bridge.regenerate(answers[-1].id))

    def _versioned_message(self):
        """The last message of the open branch that has other versions (from regenerate or edit)."""
        for m in reversed(self.conversation.messages if self.conversation else []):
            if m.siblings > 1:
                return m
        return None

    def show_version(self, step: int) -> bool:
        """Flip the last message with versions to an older (-1) or newer (+1) one; the branch follows."""
        m = self._versioned_message()
        if m is None or not 0 <= m.sibling_index + step < m.siblings:
            return False
        target = self.bridge.conversations.siblings(m.id)[m.sibling_index + step]
        return self._run(lambda: self.bridge.conversations.choose(target.id))

    def begin_edit(self) -> None:
        mine = [m for m in (self.conversation.messages if self.conversation else []) if m.role == "user"]
        if mine:
            self.editing = mine[-1].id
            self.input.setPlainText(mine[-1].content)
            self.input.setFocus()
            self._update_buttons()

    def edit_settings(self) -> None:
        if self.conversation is None:
            return
        dialog = ChatSettingsDialog(self.conversation, self, models=listed_chat_models(self.bridge))
        if dialog.exec():
            self.apply_settings(**dialog.values())

    def apply_settings(self, **values) -> bool:
        return self._run(lambda: self.bridge.conversations.update(self.current, **values))

    def delete_current(self) -> None:
        if self.current is None:
            return
        try:
            self.bridge.conversations.delete(self.current)
        except CadenceError as exc:
            self.error.setText(str(exc))
        self.current, self.conversation = None, None
        self.reload_list()
        self.render()
        self._update_buttons()

    def export_to(self, path: str | Path) -> Path | None:
        path = Path(path)
        fmt = "json" if path.suffix.lower() == ".json" else "md"
        try:
            path.write_text(self.bridge.conversations.export(self.current, fmt), encoding="utf-8")
        except CadenceError as exc:
            self.error.setText(str(exc))
            return None
        except OSError as exc:
            self.error.setText(f"The chat could not be written to {path} ({exc.strerror or exc}).")
            return None
        return path

    def _choose_export(self) -> None:
        if self.current is None:
            return
        path, _ = QFileDialog.getSaveFileName(self, "Export chat", f"chat-{self.current}.md",
                                              "Markdown (*.md);;JSON (*.json)")
        if path:
            self.export_to(path)
