"""Answers drawn as Markdown in the real chat view: a real answer streams from the engine, then a fixed
Markdown answer (a table, two code blocks) goes through the same signal the stream uses, piece by
piece, also cut inside a code fence; the drawn document holds the table's cells and each block's
code in a coloured monospace block whose Copy link copies that code; a message's Copy copies its
Markdown source."""

from __future__ import annotations

from app_support import app_home, click_link, open_window, short_params, wait_answers  # noqa: F401
from PySide6.QtGui import QFontInfo, QTextCursor, QTextTable
from PySide6.QtWidgets import QApplication

from app.chat_markdown import copy_link

PYTHON = 'def mean(values: list[float]) -> float:\n    """The average."""\n    return sum(values) / len(values)\n'
SHELL = "cadence transcribe talk.wav --format srt\ncadence gui talk.wav\n"
ANSWER = f"""## Two ways to run it

Use `cadence` from a terminal, or read the [guide](https://example.com/guide).
Raw <i>html</i> and ![a diagram](diagram.png) stay text.

| Way | Speed | Needs |
|:----|------:|-------|
| Batched | 2.4x | one engine |
| Serial | 1.0x | nothing |

1. First item
2. Second item

```python
{PYTHON}```

Then in a shell:

```bash
{SHELL}```
"""


def _tables(frame) -> list[QTextTable]:
    """Every table under a frame (the document's root frame), in order; a code block is a two-by-two
    table: its language and Copy, then its code."""
    found = []
    for child in frame.childFrames():
        if isinstance(child, QTextTable):
            found.append(child)
        found += _tables(child)
    return found


def _cell_text(table: QTextTable, row: int, column: int) -> str:
    cell = table.cellAt(row, column)
    cursor = QTextCursor(table.document())
    cursor.setPosition(cell.firstPosition())
    cursor.setPosition(cell.lastPosition(), QTextCursor.KeepAnchor)
    return cursor.selection().toPlainText()


def _cells(table: QTextTable) -> list[list[str]]:
    return [[_cell_text(table, r, c) for c in range(table.columns())] for r in range(table.rows())]


def _code_blocks(document) -> list[QTextTable]:
    return [t for t in _tables(document.rootFrame()) if t.rows() == 2 and _cell_text(t, 0, 1) == "Copy"]


def _fragments(document, start: int = 0, end: int | None = None):
    """(text, char format) of each run of text between two positions."""
    end = document.characterCount() if end is None else end
    block = document.findBlock(start)
    while block.isValid() and block.position() <= end:
        it = block.begin()
        while not it.atEnd():
            fragment = it.fragment()
            if start <= fragment.position() <= end:
                yield fragment.text(), fragment.charFormat(), block
            it += 1
        block = block.next()


def test_a_streamed_markdown_answer_draws_tables_and_code_blocks_with_copy(qtbot, app_home):  # noqa: F811
    window = open_window(qtbot, app_home())
    window.tabs.setCurrentWidget(window.chats)
    chats = window.chats
    conversation_id = chats.new_chat()
    assert chats.apply_settings(params=short_params(24))
    assert chats.send("Show me a short Python function.")
    # The real answer streams into the view (drawn while it is written) ...
    qtbot.waitUntil(lambda: "writing…" in chats.view.toPlainText(), timeout=10000)
    wait_answers(qtbot, window, timeout=300)  # the model loads first
    answer = window.bridge.conversations.get(conversation_id).messages[-1]
    assert answer.state == "complete" and answer.content.strip()
    # ... and a message's Copy copies what the model wrote, as written.
    click_link(qtbot, chats.view, copy_link("message", answer.id))
    assert QApplication.clipboard().text() == answer.content

    # A fixed Markdown answer through the same path the stream takes (the bridge's update signal),
    # in pieces: the view redraws at its own pace, and a fence still open is drawn as code so far.
    def stream(text: str) -> None:
        window.bridge.reply_update.emit(conversation_id, answer.id, text, 42.0)
        qtbot.waitUntil(lambda: chats.copyable.get(copy_link("message", answer.id)) == text, timeout=5000)

    cut_in_fence = ANSWER.index("return sum")
    for end in (40, ANSWER.index("| Serial"), cut_in_fence):
        stream(ANSWER[:end])
    document = chats.view.document()
    [open_block] = _code_blocks(document)
    assert _cell_text(open_block, 1, 0) == PYTHON[:PYTHON.index("return sum")].rstrip()
    shown = chats.view.toPlainText()
    assert shown.rstrip().endswith("42.0 tok/s") and "writing…" in shown  # the rest of the view is intact
    stream(ANSWER)

    document = chats.view.document()
    table = next(t for t in _tables(document.rootFrame()) if _cells(t)[0] == ["Way", "Speed", "Needs"])
    assert _cells(table) == [["Way", "Speed", "Needs"], ["Batched", "2.4x", "one engine"], ["Serial", "1.0x", "nothing"]]
    python_block, shell_block = _code_blocks(document)
    assert _cell_text(python_block, 0, 0) == "python" and _cell_text(shell_block, 0, 0) == "bash"
    assert _cell_text(python_block, 1, 0) == PYTHON.rstrip("\n")
    assert _cell_text(shell_block, 1, 0) == SHELL.rstrip("\n")
    # Code is drawn in a fixed-width font and coloured by its language (the keyword "def" stands out).
    cell = python_block.cellAt(1, 0)
    code = [(text, f) for text, f, _ in _fragments(document, cell.firstPosition(), cell.lastPosition() - 1)]
    assert code and all(QFontInfo(f.font()).fixedPitch() for _, f in code)
    colours = {text.strip(): f.foreground().color().name() for text, f in code}
    assert colours["def"] != colours["mean"]
    # The heading, the list, inline code and the link are Markdown's, not the text's.
    seen = set()
    for text, f, block in _fragments(document):
        if block.blockFormat().headingLevel() == 2 and text == "Two ways to run it":
            seen.add("heading")
        if block.textList() is not None and text == "Second item":
            seen.add("list")
        if f.anchorHref() == "https://example.com/guide" and text == "guide":
            seen.add("link")
        if text == "cadence" and QFontInfo(f.font()).fixedPitch():
            seen.add("inline code")
        if f.anchorHref() == "diagram.png" and text == "[a diagram]":
            seen.add("image as a link")  # never loaded
    assert seen == {"heading", "list", "link", "inline code", "image as a link"}
    assert "Raw <i>html</i> and [a diagram] stay text." in chats.view.toPlainText()  # raw HTML is not interpreted
    assert "```" not in chats.view.toPlainText() and "|" not in chats.view.toPlainText()

    # Each code block's Copy copies that block's code; the message's Copy its Markdown source.
    click_link(qtbot, chats.view, copy_link("code", answer.id, 1))
    assert QApplication.clipboard().text() == SHELL
    click_link(qtbot, chats.view, copy_link("code", answer.id, 0))
    assert QApplication.clipboard().text() == PYTHON
    assert window.statusBar().currentMessage() == "The code is on the clipboard."
    click_link(qtbot, chats.view, copy_link("message", answer.id))
    assert QApplication.clipboard().text() == ANSWER
