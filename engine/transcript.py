"""What a transcription produces: timed text segments (with their words and speaker where asked) and statistics."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class WindowResult:
    """One decoded window: its tokens, and what the quality checks read (no-speech probability at the
    start of transcript, mean log-probability of the chosen tokens)."""

    tokens: list[int]  # generated ids, end-of-text excluded
    no_speech_prob: float
    avg_logprob: float
    # With word timestamps: the window's words (engine.whisper.alignment.WordTiming, seconds from its start)
    words: list | None = None
    token_probs: list[float] | None = None  # each generated token's probability as it was chosen (for words)


@dataclass
class Word:
    """One word, timed on the file's clock by the decoder's cross-attention (see engine.whisper.alignment)."""

    start: float
    end: float
    text: str  # as written, with its leading space
    probability: float = 0.0

    def to_json(self) -> dict:
        return {"start": round(self.start, 3), "end": round(self.end, 3), "word": self.text,
                "probability": round(self.probability, 4)}


@dataclass
class Segment:
    start: float
    end: float
    text: str
    tokens: list[int] = field(default_factory=list)
    words: list[Word] | None = None  # with word timestamps
    speaker: str | None = None  # a speaker id ("S1", "S2", ...) when speakers were told apart

    def to_json(self, names: dict | None = None) -> dict:
        out = {"start": round(self.start, 3), "end": round(self.end, 3), "text": self.text}
        if self.speaker is not None:
            out["speaker"] = (names or {}).get(self.speaker, self.speaker)
        if self.words is not None:
            out["words"] = [w.to_json() for w in self.words]
        return out


@dataclass
class Transcript:
    file: str
    text: str
    language: str | None  # None when the file had no speech to detect it from
    duration: float
    segments: list[Segment]
    stats: dict
    speaker_names: dict[str, str] = field(default_factory=dict)  # speaker id -> the name a person gave it

    def speaker_name(self, speaker: str | None) -> str | None:
        """What a speaker is called: the name given to it, else "Speaker N" for id "SN"."""
        if speaker is None:
            return None
        return self.speaker_names.get(speaker) or default_speaker_name(speaker)

    def to_json(self) -> dict:
        out = {
            "file": self.file,
            "text": self.text,
            "language": self.language,
            "duration": round(self.duration, 3),
            "segments": [s.to_json() for s in self.segments],
            "stats": self.stats,
        }
        for s, j in zip(self.segments, out["segments"]):
            if s.speaker is not None:
                j["speaker"] = s.speaker
        if any(s.speaker is not None for s in self.segments):
            ids = sorted({s.speaker for s in self.segments if s.speaker is not None}, key=speaker_order)
            out["speakers"] = {i: self.speaker_name(i) for i in ids}
        if self.speaker_names:
            out["speaker_names"] = dict(self.speaker_names)
        return out


def default_speaker_name(speaker: str) -> str:
    return f"Speaker {speaker[1:]}" if speaker[:1] == "S" and speaker[1:].isdigit() else speaker


def speaker_order(speaker: str) -> tuple:
    return (int(speaker[1:]) if speaker[1:].isdigit() else 1 << 30, speaker)
