"""Real text for training chat draft heads at corpus scale: passages of installed documentation,
a dictionary and Python source, each wrapped as a conversation (a question, the passage as the
assistant's answer) so a teacher-forced pass through the chat model sees it as its own answer.

Sources are Debian packages the Makefile's ``mtp-corpora`` target installs (nothing is fetched at
run time): the Python documentation (``python3.11-doc``: reStructuredText sources), the Debian
Administrator's Handbook (``debian-handbook``: HTML, English), the Collaborative International
Dictionary of English (``dict-gcide``) and the standard library's own Python source.
:func:`missing_sources` names the packages not installed (training refuses to start without them,
so a head's data does not depend on what happened to be installed).

Which passage goes to which split is fixed by a hash of its title, so the held-out passages stay
held out whatever the seed or the number of passages asked for.
"""

from __future__ import annotations

import gzip
import hashlib
import html.parser
import random
import re
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

PYTHON_DOCS = Path("/usr/share/doc/python3.11/html/_sources")
HANDBOOK = Path("/usr/share/doc/debian-handbook/html/en-US")
GCIDE = Path("/usr/share/dictd/gcide.dict.dz")
PACKAGES = {"python-docs": "python3.11-doc", "debian-handbook": "debian-handbook", "dictionary": "dict-gcide"}
HELD_OUT_PER_MILLE = 20  # 2% of passages, by title hash, never trained on


@dataclass(frozen=True)
class Passage:
    source: str  # python-docs, debian-handbook, dictionary, python-source
    title: str
    text: str

    @property
    def held_out(self) -> bool:
        digest = hashlib.sha256(f"{self.source}:{self.title}".encode()).digest()
        return int.from_bytes(digest[:4], "big") % 1000 < HELD_OUT_PER_MILLE

    def question(self, rng: random.Random) -> str:
        """The user turn this passage answers."""
        forms = {
            "python-docs": ["Explain {t} in Python.", "How does {t} work in Python?", "Tell me about {t}.",
                            "What does the Python documentation say about {t}?"],
            "debian-handbook": ["Explain {t} on Debian.", "How do I handle {t} on a Debian system?",
                                "Tell me about {t}.", "What should an administrator know about {t}?"],
            "dictionary": ["Define the word \"{t}\".", "What does \"{t}\" mean?", "Give the meaning of \"{t}\"."],
            "python-source": ["Show me Python code from {t}.", "Write the Python code of {t}.",
                              "How is {t} implemented in Python?"],
        }[self.source]
        return rng.choice(forms).format(t=self.title)

    def answer(self) -> str:
        return f"```python\n{self.text}\n```" if self.source == "python-source" else self.text


def missing_sources() -> dict[str, str]:
    """Sources whose package is not installed: name -> Debian package."""
    where = {"python-docs": PYTHON_DOCS, "debian-handbook": HANDBOOK, "dictionary": GCIDE}
    return {name: PACKAGES[name] for name, path in where.items() if not path.exists()}


# ---------------------------------------------------------------------------- cutting text
def _pieces(paragraphs: list[str], low: int, high: int) -> list[str]:
    """Paragraphs grouped into pieces of about ``low`` to ``high`` words (a longer paragraph is cut)."""
    out, words = [], []
    for para in paragraphs:
        w = para.split()
        if words and len(words) + len(w) > high:
            out.append(" ".join(words) if len(words) >= low else None)
            words = []
        words += w
        while len(words) > high:
            out.append(" ".join(words[:high]))
            words = words[high:]
    if len(words) >= low:
        out.append(" ".join(words))
    return [p for p in out if p]


def _rst_paragraphs(text: str) -> list[str]:
    """Prose paragraphs of a reStructuredText file: directives, tables, code and headings' underlines left out."""
    paras, current, skipping = [], [], False
    for line in text.splitlines():
        stripped = line.strip()
        if not stripped:
            if current:
                paras.append(" ".join(current))
                current = []
            continue
        if skipping and line[:1] in (" ", "\t"):
            continue
        skipping = False
        if stripped.startswith(("..", "+", "|", "=", "*", "#")) or re.fullmatch(r"[-=~^\"'`#*+]{3,}", stripped) \
                or stripped.endswith("::") or line[:1] in (" ", "\t"):
            skipping = stripped.startswith("..") or stripped.endswith("::")
            if current:
                paras.append(" ".join(current))
                current = []
            continue
        current.append(stripped)
    if current:
        paras.append(" ".join(current))
    cleaned = []
    for p in paras:
        p = re.sub(r":[a-z:]+:`~?([^`<]*?)(?:\s*<[^>]*>)?`", r"\1", p)  # :func:`name` -> name
        p = re.sub(r"`([^`<]*?)\s*<[^>]*>`_+", r"\1", p).replace("``", "").replace("`", "")
        if len(p.split()) >= 8 and p[0].isalpha():
            cleaned.append(p)
    return cleaned


class _HTMLText(html.parser.HTMLParser):
    """The sections of an HTML page: (heading, paragraph texts), from h1-h3 and p / li / dd /
    ``div class="para"`` elements; scripts, code listings and tables left out."""

    BLOCKS = ("p", "li", "dd")
    SKIPPED = ("script", "style", "pre", "table")

    def __init__(self):
        super().__init__()
        self.sections: list[tuple[str, list[str]]] = [("", [])]
        self.current, self.heading, self.divs, self.skip, self.inside = [], None, [], 0, 0

    def handle_starttag(self, tag, attrs):
        if tag in self.SKIPPED:
            self.skip += 1
        elif tag in ("h1", "h2", "h3"):
            self._flush()
            self.heading = []
        elif tag in self.BLOCKS or tag == "div":
            para = tag != "div" or ("class", "para") in attrs
            if tag == "div":
                self.divs.append(para)
            if para:
                self._flush()
                self.inside += 1

    def handle_endtag(self, tag):
        if tag in self.SKIPPED:
            self.skip = max(0, self.skip - 1)
        elif tag in ("h1", "h2", "h3") and self.heading is not None:
            title = " ".join("".join(self.heading).split())
            self.sections.append((re.sub(r"^[\d.]+\.?\s*", "", title), []))
            self.heading = None
        elif tag in self.BLOCKS or (tag == "div" and self.divs and self.divs.pop()):
            self._flush()
            self.inside = max(0, self.inside - 1)

    def handle_data(self, data):
        if self.heading is not None:
            self.heading.append(data)
        elif self.inside and not self.skip:
            self.current.append(data)

    def _flush(self):
        text = " ".join("".join(self.current).split())
        if len(text.split()) >= 8:
            self.sections[-1][1].append(text)
        self.current = []


# ---------------------------------------------------------------------------- sources
def python_docs() -> list[Passage]:
    out = []
    for path in sorted(PYTHON_DOCS.rglob("*.rst.txt")):
        title = path.name.removesuffix(".rst.txt").replace("_", " ")
        text = path.read_text(errors="replace")
        head = re.search(r"^(?:[:\w].*)\n[=*#-]{3,}\s*$", text, re.M)
        if head:
            title = re.sub(r":[a-z:]+:`~?([^`]*)`", r"\1", head.group(0).splitlines()[0])
            title = title.replace("`", "").strip(" :*")
        for n, piece in enumerate(_pieces(_rst_paragraphs(text), 60, 220)):
            out.append(Passage("python-docs", f"{title} ({path.parent.name}/{path.name}, part {n + 1})"
                               if n else title, piece))
    return out


def debian_handbook() -> list[Passage]:
    out = []
    for path in sorted(HANDBOOK.glob("*.html")):
        parser = _HTMLText()
        parser.feed(path.read_text(errors="replace"))
        parser.close()
        for heading, paras in parser.sections:
            for n, piece in enumerate(_pieces(paras, 60, 220)):
                title = heading or path.stem.replace("-", " ")
                out.append(Passage("debian-handbook", f"{title} (part {n + 1})" if n else title, piece))
    return out


def dictionary(limit: int = 20000) -> list[Passage]:
    """Dictionary entries (headword, definitions), markup stripped; at most ``limit``, evenly spread."""
    index = GCIDE.with_name("gcide.index")
    if not index.is_file():
        return []
    with gzip.open(GCIDE, "rb") as f:
        data = f.read()

    def b64(s: str) -> int:
        alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
        n = 0
        for c in s:
            n = n * 64 + alphabet.index(c)
        return n

    entries = []
    for line in index.read_text(errors="replace").splitlines():
        parts = line.split("\t")
        if len(parts) == 3 and parts[0].isalpha() and parts[0].islower() and len(parts[0]) > 2:
            entries.append((parts[0], b64(parts[1]), b64(parts[2])))
    step = max(1, len(entries) // limit)
    out = []
    for word, offset, length in entries[::step]:
        text = data[offset: offset + length].decode("utf-8", "replace")
        lines = [ln.strip() for ln in text.splitlines()[1:] if ln.strip() and not ln.strip().startswith("[")]
        body = re.sub(r"\s+", " ", " ".join(lines))
        body = re.sub(r"\{[^}]*\}|\[[^\]]*\]", "", body).strip()
        if len(body.split()) >= 12:
            out.append(Passage("dictionary", word, " ".join(body.split()[:200])))
    return out


def python_source(limit_lines: int = 60) -> list[Passage]:
    """Functions and classes of the standard library's own Python files, in pieces of at most ``limit_lines``."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for path in sorted(root.glob("*.py")):
        lines = path.read_text(errors="replace").splitlines()
        starts = [i for i, ln in enumerate(lines) if re.match(r"(def|class) \w+", ln)]
        for a, b in zip(starts, starts[1:] + [len(lines)]):
            block = "\n".join(lines[a: min(b, a + limit_lines)]).rstrip()
            name = re.match(r"(?:def|class) (\w+)", lines[a]).group(1)
            if block.count("\n") >= 4:
                out.append(Passage("python-source", f"{name} in {path.stem}", block))
    return out


def passages(held_out: bool = False) -> list[Passage]:
    """Every passage of the installed sources in one split (training, or held-out), in a fixed order."""
    everything = python_docs() + debian_handbook() + dictionary() + python_source()
    return [p for p in everything if p.held_out == held_out]


def conversations(seed: int, count: int | None = None, held_out: bool = False) -> list[tuple[str, str]]:
    """(question, answer) pairs: ``count`` passages of one split (all when None), shuffled by ``seed``."""
    chosen = passages(held_out)
    rng = random.Random(seed)
    rng.shuffle(chosen)
    chosen = chosen[:count] if count is not None else chosen
    return [(p.question(rng), p.answer()) for p in chosen]


# ---------------------------------------------------------------------------- prompts the model answers itself
_WORD_FORMS = ["What does the word \"{w}\" mean? Give an example sentence.", "Use the word \"{w}\" in three sentences.",
               "Explain the word \"{w}\" to a child."]
_DOC_FORMS = ["Explain {t}, with a short example.", "What should a beginner know about {t}?",
              "Summarize this passage in two sentences:\n\n{x}", "Rewrite this passage in plain language:\n\n{x}",
              "Write three questions a reader might ask about this passage, with answers:\n\n{x}"]
_CODE_FORMS = ["Explain what this Python code does:\n\n```python\n{x}\n```",
               "Suggest improvements to this Python code:\n\n```python\n{x}\n```",
               "Write a short docstring for this Python code:\n\n```python\n{x}\n```"]


def corpus_prompts(seed: int, count: int | None = None) -> list[str]:
    """Chat prompts made from the training split's passages, for the model to answer itself (on-policy
    draft-head data): a dictionary word in the prompt set's own templates or a question about the word,
    a documentation passage's subject or its first 80 words to summarise or rewrite, or a piece of code
    to explain. Prompts naming a held-out or validation topic of :mod:`engine.mtp.prompts` are left out."""
    from engine.mtp.prompts import HELD_OUT_TOPICS, TEMPLATES, VALIDATION_TOPICS

    banned = {t.lower() for t in HELD_OUT_TOPICS | set(VALIDATION_TOPICS)}
    chosen = passages(held_out=False)
    rng = random.Random(seed)
    rng.shuffle(chosen)
    words = [p.title for p in chosen if p.source == "dictionary"]
    out = []
    for p in chosen:
        if p.source == "dictionary":
            if rng.random() < 0.7:
                prompt = rng.choice(TEMPLATES).format(t=p.title, u=rng.choice(words))
            else:
                prompt = rng.choice(_WORD_FORMS).format(w=p.title)
        elif p.source == "python-source":
            prompt = rng.choice(_CODE_FORMS).format(x="\n".join(p.text.splitlines()[:16]))
        else:
            subject = re.sub(r"\s*\([^)]*\)$", "", p.title)
            subject = f"{subject} in Python" if p.source == "python-docs" else f"{subject} on Debian"
            prompt = rng.choice(_DOC_FORMS).format(t=subject, x=" ".join(p.text.split()[:80]))
        if not any(b in prompt.lower() for b in banned):
            out.append(prompt)
    return out[:count] if count is not None else out


if __name__ == "__main__":  # a look at the corpus: counts and one passage per source
    every = python_docs() + debian_handbook() + dictionary() + python_source()
    for name in ("python-docs", "debian-handbook", "dictionary", "python-source"):
        some = [p for p in every if p.source == name]
        words = sum(len(p.text.split()) for p in some)
        print(f"{name}: {len(some)} passages, {words} words, {sum(p.held_out for p in some)} held out", file=sys.stderr)
        if some:
            p = some[len(some) // 2]
            print(f"  [{p.title}] {p.text[:300]}", file=sys.stderr)
