"""Transcript writers: plain text, SubRip, WebVTT and JSON."""

from __future__ import annotations

import json

from engine.transcript import Transcript

FORMATS = ("txt", "srt", "vtt", "json")


def _clock(seconds: float, decimal: str) -> str:
    ms = max(0, int(round(seconds * 1000)))
    h, ms = divmod(ms, 3_600_000)
    m, ms = divmod(ms, 60_000)
    s, ms = divmod(ms, 1000)
    return f"{h:02d}:{m:02d}:{s:02d}{decimal}{ms:03d}"


def to_txt(t: Transcript) -> str:
    return "\n".join(s.text for s in t.segments) + ("\n" if t.segments else "")


def to_srt(t: Transcript) -> str:
    blocks = [
        f"{i}\n{_clock(s.start, ',')} --> {_clock(s.end, ',')}\n{s.text}\n" for i, s in enumerate(t.segments, 1)
    ]
    return "\n".join(blocks)


def to_vtt(t: Transcript) -> str:
    blocks = [f"{_clock(s.start, '.')} --> {_clock(s.end, '.')}\n{s.text}\n" for s in t.segments]
    return "WEBVTT\n\n" + "\n".join(blocks)


def to_json(t: Transcript) -> str:
    return json.dumps(t.to_json(), ensure_ascii=False, indent=2) + "\n"


WRITERS = {"txt": to_txt, "srt": to_srt, "vtt": to_vtt, "json": to_json}


def render(t: Transcript, fmt: str) -> str:
    return WRITERS[fmt](t)
