"""Answers drawn as Markdown: markdown-it-py parses them, Pygments colours code, Qt's rich text draws.

Why one HTML document in the chat's ``QTextBrowser`` rather than a widget per block: Qt's rich text
already draws everything an answer needs (headings, lists, tables, monospace blocks, coloured spans,
links), one document scrolls and selects across messages like a page, and a long chat stays one
widget instead of hundreds with their own sizing. The cost is reading the HTML again on each redraw
while an answer streams, about half parsing and half layout, growing with the answer:
``bench/chat_render.py`` measured 9-16 ms for 500 characters, 25-65 ms for 2 KB and 85-130 ms for
8 KB of Markdown with a table and a code block every 500 characters (on the project's 2 shared CPU
cores, busy with other work). So the chat view redraws at most ~12 times a second and, when a redraw
is slow, waits long enough that drawing takes at most a quarter of the window's time: a long answer
is redrawn less often, and the window still answers keys and clicks between redraws. Appending only
the changed blocks to the document (``QTextCursor.insertHtml``) was tried and rejected: Qt merges an
inserted fragment's first block into the current one and drops its margins, so the text drawn while
streaming was not the text drawn once done. Two choices keep the document cheap: a message is
plain blocks (a table around every message more than doubled the time), and finished messages and
coloured code blocks are cached.

Markdown is parsed as CommonMark plus tables and strikethrough, with single line breaks kept (as the
model wrote them). Raw HTML in an answer is shown as text, never interpreted, and images are shown
as links (nothing is loaded). A fence still open mid-stream is a code block up to the end of the
text so far, as CommonMark says, so a half-written answer draws cleanly.

A code block is a one-cell table (background, padding) headed by its language and a *Copy* link;
*Copy* links carry ``copy:code/KEY/N`` (the Nth block of the message KEY) and the chat view puts that
block's code on the clipboard (:func:`copy_kind`).
"""

from __future__ import annotations

import html
from collections import OrderedDict
from dataclasses import dataclass
from functools import lru_cache

from markdown_it import MarkdownIt
from pygments import highlight
from pygments.formatters import HtmlFormatter
from pygments.lexers import get_lexer_by_name
from pygments.util import ClassNotFound

CODE_STYLE = "default"  # Pygments' light style: matches the app's light message colours
CODE_BACKGROUND = "#fafbfc"
CODE_HEADER = "#e8ecf0"
CACHE_SIZE = 256  # finished messages kept rendered (not parsed again on every redraw)
MAX_HIGHLIGHT_CHARS = 60_000  # longer code blocks are shown uncoloured (colouring them costs a redraw)


def style_sheet(mono: str) -> str:
    """The chat document's default style sheet; ``mono``: the desktop's fixed-width font family."""
    family = f"'{mono}', monospace" if mono else "monospace"
    return (f"pre, code {{ font-family: {family}; }}\n"
            "code { background-color: #eceff2; }\n"
            "pre { white-space: pre-wrap; margin: 0; }\n"
            "h1 { font-size: x-large; } h2 { font-size: large; } h3, h4, h5, h6 { font-size: medium; }\n"
            "th { background-color: #eceff2; }\n"
            "a { color: #1a5fb4; }\n")


@dataclass(frozen=True)
class Rendered:
    """A message's HTML and the code of its code blocks, in order (what each block's Copy copies)."""

    html: str
    code_blocks: tuple[str, ...]


def copy_link(kind: str, *ids) -> str:
    """The href of a Copy link: ``copy:message/ID`` or ``copy:code/KEY/N``."""
    return "copy:" + "/".join([kind, *map(str, ids)])


def copy_kind(href: str) -> str | None:
    """"message" or "code" for a Copy link's href, else None (an ordinary link)."""
    return href[len("copy:"):].split("/")[0] if href.startswith("copy:") else None


@lru_cache(maxsize=1024)
def _coloured(code: str, language: str) -> str:
    """The code as HTML spans coloured for its language (inline styles: Qt reads no CSS classes)."""
    if language and len(code) <= MAX_HIGHLIGHT_CHARS:
        try:
            lexer = get_lexer_by_name(language, stripnl=False, ensurenl=False)
        except ClassNotFound:
            lexer = None
        if lexer is not None:
            return highlight(code, lexer, _formatter())
    return html.escape(code)


@lru_cache(maxsize=1)
def _formatter() -> HtmlFormatter:
    return HtmlFormatter(nowrap=True, noclasses=True, style=CODE_STYLE)


def _code_block(renderer, tokens, idx, options, env) -> str:
    """A fenced or indented code block: language and Copy above, the coloured code below."""
    token = tokens[idx]
    language = token.info.split()[0] if token.info.strip() else ""
    code = token.content
    number = len(env["code"])
    env["code"].append(code)
    body = _coloured(code.rstrip("\n"), language.lower())
    label = html.escape(language) if language else "code"
    href = copy_link("code", env["key"], number)
    return (f"<table width='100%' cellspacing='0' cellpadding='6' border='0' style='margin-top:4px; margin-bottom:6px'>"
            f"<tr style='background-color:{CODE_HEADER}'><td><small style='color:#57606a'>{label}</small></td>"
            f"<td align='right'><small><a href='{href}' style='text-decoration:none'>Copy</a></small></td></tr>"
            f"<tr style='background-color:{CODE_BACKGROUND}'><td colspan='2'><pre>{body}</pre></td></tr></table>\n")


def _image(renderer, tokens, idx, options, env) -> str:
    """An image is shown as a link with its description: the chat never loads files or addresses."""
    token = tokens[idx]
    alt = renderer.renderInlineAsText(token.children or [], options, env) or "image"
    return f"<a href='{html.escape(token.attrs.get('src', ''), quote=True)}'>[{html.escape(alt)}]</a>"


def _table_open(renderer, tokens, idx, options, env) -> str:
    return ("<table border='1' cellspacing='0' cellpadding='5' style='border-collapse: collapse; border-style: solid; "
            "border-color: #b8c0c8; margin-top: 4px; margin-bottom: 8px'>\n")


class MarkdownRenderer:
    """Markdown text -> :class:`Rendered` HTML for the chat document."""

    def __init__(self, cache_size: int = CACHE_SIZE):
        self._md = MarkdownIt("commonmark", {"html": False, "breaks": True}).enable(["table", "strikethrough"])
        for rule, function in (("fence", _code_block), ("code_block", _code_block), ("image", _image),
                               ("table_open", _table_open)):
            self._md.add_render_rule(rule, function)
        self._cache: OrderedDict[tuple[str, str], Rendered] = OrderedDict()
        self._cache_size = cache_size

    def render(self, text: str, key: str, keep: bool = True) -> Rendered:
        """``key`` names the message in its code blocks' Copy links; ``keep``: cache the result (a
        finished message; a streaming one changes with every redraw)."""
        cached = self._cache.get((text, key))
        if cached is not None:
            self._cache.move_to_end((text, key))
            return cached
        env = {"code": [], "key": key}
        rendered = Rendered(self._md.render(text, env), tuple(env["code"]))
        if not keep:
            return rendered
        self._cache[(text, key)] = rendered
        if len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return rendered
