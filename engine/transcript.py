"""What a transcription produces: timed text segments and statistics."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class WindowResult:
    """One decoded window: its tokens, and what the quality checks read (no-speech probability at the
    start of transcript, mean log-probability of the chosen tokens)."""

    tokens: list[int]  # generated ids, end-of-text excluded
    no_speech_prob: float
    avg_logprob: float


@dataclass
class Segment:
    start: float
    end: float
    text: str
    tokens: list[int] = field(default_factory=list)


@dataclass
class Transcript:
    file: str
    text: str
    language: str | None  # None when the file had no speech to detect it from
    duration: float
    segments: list[Segment]
    stats: dict

    def to_json(self) -> dict:
        return {
            "file": self.file,
            "text": self.text,
            "language": self.language,
            "duration": round(self.duration, 3),
            "segments": [{"start": round(s.start, 3), "end": round(s.end, 3), "text": s.text} for s in self.segments],
            "stats": self.stats,
        }
