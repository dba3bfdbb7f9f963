"""Stored transcripts (a finished job's result JSON): rebuilding them, writing them to files, showing times."""

from __future__ import annotations

from pathlib import Path

from engine.errors import CadenceError
from engine.formats import render
from engine.subtitles import SubtitleRules
from engine.transcript import Segment, Transcript, Word


def transcript_from_json(data: dict) -> Transcript:
    """The engine's Transcript from the JSON a finished job keeps (with its speakers' names as given),
    so engine.formats can render it."""
    segments = []
    for s in data.get("segments") or []:
        words = [Word(float(w["start"]), float(w["end"]), str(w["word"]), float(w.get("probability", 0.0)))
                 for w in s["words"]] if s.get("words") is not None else None
        segments.append(Segment(float(s["start"]), float(s["end"]), str(s["text"]), words=words,
                                speaker=s.get("speaker")))
    return Transcript(file=str(data.get("file") or ""), text=str(data.get("text") or ""),
                      language=str(data.get("language") or ""), duration=float(data.get("duration") or 0.0),
                      segments=segments, stats=dict(data.get("stats") or {}),
                      speaker_names=dict(data.get("speaker_names") or {}))


def clock(seconds: float | None) -> str:
    """'1:05' or '1:02:03'; '' for unknown."""
    if seconds is None or seconds < 0:
        return ""
    seconds = int(round(seconds))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def output_targets(job) -> list[Path]:
    """Where a finished job's files go: the chosen folder or next to the input, one per format; a
    name already taken gets ' (2)', ' (3)' ... so nothing is ever replaced."""
    options = job.options or {}
    folder = Path(options["out"]).expanduser() if options.get("out") else Path(job.path).parent
    stem = Path(job.path).stem
    targets = []
    for fmt in options.get("formats") or ["txt"]:
        target, n = folder / f"{stem}.{fmt}", 2
        while target.exists():
            target, n = folder / f"{stem} ({n}).{fmt}", n + 1
        targets.append(target)
    return targets


def write_outputs(job, transcript) -> list[Path]:
    targets = output_targets(job)
    if targets:
        targets[0].parent.mkdir(parents=True, exist_ok=True)
    rules = SubtitleRules.from_options((job.options or {}).get("subtitles"))
    for target in targets:
        target.write_text(render(transcript, target.suffix[1:], rules), encoding="utf-8")
    return targets


def export_transcript(result: dict, path: str | Path, rules: SubtitleRules | None = None) -> Path:
    """Write a stored transcript (a finished job's result) to ``path``; the suffix picks the format."""
    path = Path(path)
    fmt = path.suffix.lower().lstrip(".")
    if fmt not in ("txt", "srt", "vtt", "json"):
        raise CadenceError(f"Transcripts export to .txt, .srt, .vtt or .json (not '{path.suffix or path.name}').")
    path.write_text(render(transcript_from_json(result), fmt, rules), encoding="utf-8")
    return path
