"""Exporting a stored conversation: Markdown for reading, JSON for everything."""

from __future__ import annotations

import dataclasses
import json
import time

from engine.errors import RequestError
from engine.sampling import SamplingParams

FORMATS = ("md", "json")


def export_conversation(store, conversation_id: int, fmt: str = "md") -> str:
    """The conversation as Markdown (the active branch, readable) or JSON (everything: the active
    branch in ``messages``, earlier answers and edits in ``other_messages``)."""
    if fmt not in FORMATS:
        raise RequestError(f"Conversations export to md or json (not '{fmt}').")
    conv = store.get(conversation_id)
    if fmt == "json":
        on_branch = {m.id for m in conv.messages}
        data = conv.to_json()
        data["other_messages"] = [m.to_json() for m in store.messages(conversation_id) if m.id not in on_branch]
        return json.dumps(data, ensure_ascii=False, indent=2)
    return _markdown(conv)


def _when(stamp: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(stamp))


def _markdown(conv) -> str:
    defaults = dataclasses.asdict(SamplingParams())
    changed = {k: v for k, v in dataclasses.asdict(conv.params).items() if v != defaults[k]}
    lines = [f"# {conv.title or f'Conversation {conv.id}'}", "",
             f"- Model: {conv.model}", f"- Created: {_when(conv.created)}; updated: {_when(conv.updated)}",
             "- Sampling: " + (", ".join(f"{k.replace('_', ' ')} {v}" for k, v in changed.items()) or "defaults (greedy)")]
    transcript = (conv.context or {}).get("transcript")
    if transcript:
        about = transcript.get("file") or (f"transcription job {transcript['job_id']}" if transcript.get("job_id")
                                           else "a transcript")
        lines.append(f"- About: {about}" + (f" ({transcript['notice']})" if transcript.get("notice") else ""))
    if conv.system:
        lines += ["", "## System", "", conv.system]
    for m in conv.messages:
        heading = "You" if m.role == "user" else "Assistant"
        if m.siblings > 1:
            heading += f" (version {m.sibling_index + 1} of {m.siblings})"
        lines += ["", f"## {heading}", "", m.content]
        if m.state == "failed":
            lines += ["", f"*(failed: {m.error})*"]
        elif m.state in ("stopped", "interrupted", "streaming"):
            lines += ["", {"stopped": "*(stopped)*", "interrupted": "*(interrupted: the answer was cut off)*",
                           "streaming": "*(still being written)*"}[m.state]]
        if m.role == "assistant" and m.stats.get("dropped_turns"):
            lines += ["", f"*({m.stats['dropped_turns']} earlier turns were left out to fit the context)*"]
    return "\n".join(lines) + "\n"
