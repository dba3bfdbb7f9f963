"""Transcript writers: plain text, SubRip, WebVTT and JSON.

Subtitles (SRT, VTT) are cut into cues by :mod:`engine.subtitles` under the given rules. Where
speakers were told apart, a line (TXT) or cue (SRT, VTT) starts with the speaker's name whenever
the speaker changes; JSON carries each segment's speaker and, with word timestamps, its words.
"""

from __future__ import annotations

import json

from engine.subtitles import SubtitleRules, cues
from engine.transcript import Transcript

FORMATS = ("txt", "srt", "vtt", "json")


def _clock(seconds: float, decimal: str) -> str:
    ms = max(0, int(round(seconds * 1000)))
    h, ms = divmod(ms, 3_600_000)
    m, ms = divmod(ms, 60_000)
    s, ms = divmod(ms, 1000)
    return f"{h:02d}:{m:02d}:{s:02d}{decimal}{ms:03d}"


def to_txt(t: Transcript, rules: SubtitleRules | None = None) -> str:
    lines, speaker = [], None
    for s in t.segments:
        if s.speaker is not None and s.speaker != speaker:
            lines.append(f"{t.speaker_name(s.speaker)}: {s.text}")
        else:
            lines.append(s.text)
        speaker = s.speaker
    return "\n".join(lines) + ("\n" if lines else "")


def _cue_texts(t: Transcript, rules: SubtitleRules | None):
    """(start, end, text) of each cue, the speaker's name starting the first cue of each turn."""
    for cue in cues(t, rules or SubtitleRules(), labels=True):
        yield cue.start, cue.end, "\n".join(cue.lines)


def to_srt(t: Transcript, rules: SubtitleRules | None = None) -> str:
    blocks = [f"{i}\n{_clock(start, ',')} --> {_clock(end, ',')}\n{text}\n"
              for i, (start, end, text) in enumerate(_cue_texts(t, rules), 1)]
    return "\n".join(blocks)


def to_vtt(t: Transcript, rules: SubtitleRules | None = None) -> str:
    blocks = [f"{_clock(start, '.')} --> {_clock(end, '.')}\n{text}\n" for start, end, text in _cue_texts(t, rules)]
    return "WEBVTT\n\n" + "\n".join(blocks)


def to_json(t: Transcript, rules: SubtitleRules | None = None) -> str:
    return json.dumps(t.to_json(), ensure_ascii=False, indent=2) + "\n"


WRITERS = {"txt": to_txt, "srt": to_srt, "vtt": to_vtt, "json": to_json}


def render(t: Transcript, fmt: str, rules: SubtitleRules | None = None) -> str:
    return WRITERS[fmt](t, rules)
