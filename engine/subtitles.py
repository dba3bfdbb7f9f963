"""Subtitle cues that read well: short lines, few of them, on screen long enough, never too long.

The defaults follow common broadcast practice: at most 42 characters a line and 2 lines a cue, at
least 5/6 of a second and at most 7 seconds on screen, two frames (80 ms) between cues. A cue
ends at the end of a sentence, at a pause in the speech, when the speaker changes, or where the
next word would break a rule; lines are balanced and broken after punctuation where that costs
little. Times come from the words (with word timestamps) or, without them, from each segment's
times shared out over its characters; either way every time is read from the file's own clock,
so cues do not drift on long files.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.errors import RequestError

SENTENCE_END = ".!?。！？…"
CLAUSE_END = ",;:，、"
CLINGING_WORDS = {"a", "an", "the", "to", "of", "and", "or", "in", "on", "at", "for", "with", "by", "from", "my",
                  "your", "our", "their", "his", "her", "its", "this", "that"}
PAUSE_S = 0.6  # a silence this long between two words ends the cue


@dataclass(frozen=True)
class SubtitleRules:
    max_chars: int = 42  # characters per line
    max_lines: int = 2  # lines per cue
    min_duration: float = 5 / 6  # seconds a cue stays on screen at least ...
    max_duration: float = 7.0  # ... and at most
    min_gap: float = 0.08  # seconds between one cue's end and the next one's start

    def __post_init__(self):
        if not 10 <= self.max_chars <= 200:
            raise RequestError(f"Subtitle lines must hold 10 to 200 characters (got {self.max_chars}).")
        if not 1 <= self.max_lines <= 5:
            raise RequestError(f"A subtitle cue must have 1 to 5 lines (got {self.max_lines}).")
        if not 0 < self.min_duration < self.max_duration:
            raise RequestError(f"A cue's shortest time on screen ({self.min_duration:g} s) must be above 0 and "
                               f"below its longest ({self.max_duration:g} s).")
        if not 0 <= self.min_gap < self.min_duration:
            raise RequestError(f"The gap between cues ({self.min_gap:g} s) must be at least 0 and shorter than "
                               f"a cue.")

    @classmethod
    def from_options(cls, options: dict | None) -> "SubtitleRules":
        """Rules from stored job options or settings (unknown keys ignored, missing ones at their defaults)."""
        known = {"max_chars": int, "max_lines": int, "min_duration": float, "max_duration": float, "min_gap": float}
        return cls(**{k: kind(v) for k, v in (options or {}).items() if k in known and v is not None
                      for kind in [known[k]]})

    def to_options(self) -> dict:
        return {"max_chars": self.max_chars, "max_lines": self.max_lines, "min_duration": self.min_duration,
                "max_duration": self.max_duration, "min_gap": self.min_gap}


@dataclass
class Cue:
    start: float
    end: float
    lines: list[str] = field(default_factory=list)
    speaker: str | None = None


@dataclass
class _Timed:
    text: str
    start: float
    end: float
    speaker: str | None


def _timed_words(transcript) -> list[_Timed]:
    """Every word with its times: the aligned words where there are, else each segment's words timed by
    their place among its characters."""
    out: list[_Timed] = []
    for s in transcript.segments:
        if s.words:
            out += [_Timed(w.text.strip(), w.start, max(w.end, w.start), s.speaker) for w in s.words if w.text.strip()]
            continue
        words = s.text.split()
        total = sum(len(w) + 1 for w in words) or 1
        at, span = 0, max(0.0, s.end - s.start)
        for w in words:
            begin = s.start + span * at / total
            at += len(w) + 1
            out.append(_Timed(w, begin, s.start + span * at / total, s.speaker))
    return out


def _pieces(text_words: list[str], max_chars: int) -> list[str]:
    """The words, any longer than a line (a long address) cut into line-sized pieces."""
    pieces = []
    for w in text_words:
        while len(w) > max_chars:
            pieces.append(w[:max_chars])
            w = w[max_chars:]
        pieces.append(w)
    return pieces


def fits(text_words: list[str], max_chars: int, max_lines: int) -> bool:
    """Whether the words fill at most ``max_lines`` lines of ``max_chars``, filled one after another."""
    lines, line = 1, 0
    for piece in _pieces(text_words, max_chars):
        if line and line + 1 + len(piece) > max_chars:
            lines, line = lines + 1, len(piece)
        else:
            line += len(piece) + (1 if line else 0)
    return lines <= max_lines


def _break_cost(line: str) -> int:
    """How bad a line break after ``line`` is: free after punctuation, worse after a little word that
    belongs with the next one (an article, a preposition)."""
    if line[-1] in SENTENCE_END + CLAUSE_END:
        return 0
    return 10 + (6 if line.rsplit(" ", 1)[-1].lower() in CLINGING_WORDS else 0)


def wrap(text_words: list[str], max_chars: int, max_lines: int) -> list[str]:
    """The words as at most ``max_lines`` lines of at most ``max_chars`` characters (they must fit), as even
    as can be, a break after punctuation preferred."""
    pieces = _pieces(text_words, max_chars)
    best: tuple[float, list[str]] | None = None

    def search(start: int, lines: list[str]) -> None:
        nonlocal best
        if start == len(pieces):
            lengths = [len(line) for line in lines]
            cost = max(lengths) - min(lengths) + sum(_break_cost(line) for line in lines[:-1])
            if best is None or cost < best[0]:
                best = (cost, list(lines))
            return
        if len(lines) == max_lines or not fits(pieces[start:], max_chars, max_lines - len(lines)):
            return
        line = ""
        for end in range(start, len(pieces)):
            line = pieces[end] if not line else f"{line} {pieces[end]}"
            if len(line) > max_chars:
                break
            search(end + 1, lines + [line])

    search(0, [])
    return best[1] if best else [" ".join(pieces)]


def _joins(group: list[_Timed], word: _Timed, rules: SubtitleRules) -> bool:
    """Whether ``word`` continues the cue ``group``: same speaker, no pause, no sentence ended a cue long
    enough already, and the rules still hold with it."""
    before = group[-1]
    return not (word.speaker != group[0].speaker or word.start - before.end >= PAUSE_S
                or (before.text[-1] in SENTENCE_END and before.end - group[0].start >= rules.min_duration)
                or word.end - group[0].start > rules.max_duration
                or not fits([w.text for w in group] + [word.text], rules.max_chars, rules.max_lines))


def _labelled(words: list[_Timed], transcript) -> list[_Timed]:
    """The first word of each speaker's turn carries the speaker's name, ``[Name] word``, so the name
    counts in the line it starts (it stays within the rules) and is never left alone on a line."""
    speaker = None
    for word in words:
        if word.speaker is not None and word.speaker != speaker:
            word.text = f"[{transcript.speaker_name(word.speaker)}] {word.text}"
        speaker = word.speaker
    return words


def cues(transcript, rules: SubtitleRules = SubtitleRules(), labels: bool = False) -> list[Cue]:
    """The transcript's cues under ``rules``; ``labels``: each speaker turn's first cue starts with the
    speaker's name (see _labelled)."""
    groups: list[list[_Timed]] = []
    words = _timed_words(transcript)
    for word in _labelled(words, transcript) if labels else words:
        if groups and _joins(groups[-1], word, rules):
            groups[-1].append(word)
            continue
        full = groups and (word.end - groups[-1][0].start > rules.max_duration or not fits(
            [w.text for w in groups[-1]] + [word.text], rules.max_chars, rules.max_lines))
        if full and _balance(groups, rules) and _joins(groups[-1], word, rules):
            groups[-1].append(word)
            continue
        groups.append([word])
    result = [Cue(g[0].start, min(g[-1].end, g[0].start + rules.max_duration),
                  wrap([w.text for w in g], rules.max_chars, rules.max_lines), g[0].speaker) for g in groups]
    return _timed(result, rules)


def _balance(groups: list[list[_Timed]], rules: SubtitleRules) -> bool:
    """A full cue gives its last few words to the next cue when they follow a clause break in its second
    half, so it ends at the comma rather than a word or two after it. True when it did."""
    group = groups[-1]
    if group[-1].text[-1] in CLAUSE_END + SENTENCE_END:
        return False
    for cut in range(len(group) - 1, max(0, len(group) - 4), -1):
        if group[cut - 1].text[-1] in CLAUSE_END + SENTENCE_END and cut >= len(group) // 2:
            groups.append(group[cut:])
            del group[cut:]
            return True
    return False


def _timed(result: list[Cue], rules: SubtitleRules) -> list[Cue]:
    """Each cue on screen at least the shortest time and at most the longest, ``min_gap`` apart, in order:
    a short cue is lengthened into the silence after it, and where there is none, the next cue waits."""
    for i, cue in enumerate(result):
        if i:
            cue.start = max(cue.start, result[i - 1].end + rules.min_gap)
        cue.end = min(max(cue.end, cue.start + rules.min_duration), cue.start + rules.max_duration)
        if i + 1 < len(result):
            room = result[i + 1].start - rules.min_gap
            if cue.end > room >= cue.start + rules.min_duration:
                cue.end = room
    return result
