"""A transcript kept in a conversation's context: cut into parts so the system prompt fits.

A conversation about a transcript keeps the transcript in its context and puts it into the system
prompt, cut between segments (or words, for plain text) to fit the model's context with room for
the turns that follow, with a notice saying how much was kept.
"""

from __future__ import annotations

import re
from pathlib import Path

from engine.errors import CadenceError, RequestError

DOCUMENT_CHUNK_CHARS = 80  # a plain-text transcript is cut between chunks of about this many characters
TRANSCRIPT_SYSTEM = ("You answer questions about the transcript of a recording, given below. Answer from what the "
                     "transcript says; when it does not say, say so.\n\nTranscript{notice}:\n{text}")


def _clock(seconds: float) -> str:
    seconds = int(round(seconds))
    h, rest = divmod(seconds, 3600)
    return f"{h}:{rest // 60:02d}:{rest % 60:02d}" if h else f"{rest // 60}:{rest % 60:02d}"


def transcript_context(doc: dict):
    """(number of parts, system_for(n), notice(n)) for a transcript kept in a conversation's context."""
    segments = [s for s in doc.get("segments") or [] if str(s[2]).strip()]
    if segments:
        pieces = [str(s[2]).strip() for s in segments]
        ends = [float(s[1]) for s in segments]
        total = float(doc.get("duration") or ends[-1])
        text = " ".join(pieces)
        offsets = [0]
        for piece in pieces:
            offsets.append(offsets[-1] + len(piece) + 1)

        def notice(n):
            return None if n >= len(pieces) else f"the first {_clock(ends[n - 1] if n else 0)} of {_clock(total)}"
    else:
        text = doc["text"]
        offsets, size = [0], 0
        for match in re.finditer(r"\S+\s*", text):
            size += len(match.group())
            if size >= DOCUMENT_CHUNK_CHARS:
                offsets.append(match.end())
                size = 0
        if offsets[-1] < len(text):
            offsets.append(len(text))
        pieces = offsets[1:]

        def notice(n):
            if n >= len(pieces):
                return None
            return f"the first {len(text[: offsets[n]].rstrip()):,} of {len(text.rstrip()):,} characters"

    def system_for(n: int) -> str:
        cut = notice(n)
        return TRANSCRIPT_SYSTEM.format(notice=f" (cut to {cut} to fit)" if cut else "",
                                        text=text[: offsets[n]].rstrip())

    return len(pieces), system_for, notice


def transcript_document(transcript, job_id: int | None = None, store_path: str | Path | None = None) -> dict:
    """What a conversation keeps of a transcript: a str, an engine.transcript.Transcript, its JSON dict,
    or the id of a finished transcription job (read from the store at ``store_path``)."""
    if isinstance(transcript, int) and not isinstance(transcript, bool):
        from engine.jobs import JobStore

        job = JobStore(store_path).get(transcript)
        if job.state != "done" or not job.result:
            raise CadenceError(f"Transcription job {transcript} has not finished, so there is no transcript yet.")
        job_id, transcript = transcript, job.result
    if isinstance(transcript, str):
        return {"job_id": job_id, "file": None, "text": transcript, "segments": None, "duration": None}
    data = transcript.to_json() if hasattr(transcript, "to_json") else transcript
    if not isinstance(data, dict) or not isinstance(data.get("text"), str):
        raise RequestError("A transcript must be text, a transcript or a transcription job id.")
    segments = [[float(s["start"]), float(s["end"]), str(s["text"])] for s in data.get("segments") or []]
    return {"job_id": job_id, "file": data.get("file"), "text": data["text"], "segments": segments or None,
            "duration": data.get("duration")}


def fitted_transcript(transcript: dict, parts_used: int) -> dict:
    """The transcript's context entry once cut to ``parts_used`` parts, with the notice saying so."""
    parts, _, notice = transcript_context(transcript)
    cut = notice(parts_used)
    notice_text = f"The transcript was cut to {cut} to fit this model's context." if cut else None
    return dict(transcript) | {"fitted": True, "parts_used": parts_used, "parts": parts, "notice": notice_text}
