"""Cadence's engine: models, the batched decoder and its scheduler, the transcription and chat pipelines,
and the store. No Qt, no front end.

The public face, importable from here::

    from engine import Engine, ChatRequest, TranscribeRequest, SamplingParams, Conversations, JobStore

Names load on first use, so ``import engine.errors`` (what the command line needs to start) does not
pull in PyTorch. Modules inside the engine import from their own modules, never from here.
"""

from __future__ import annotations

import importlib

_PUBLIC = {
    "Engine": "engine.engine",
    "ChatRequest": "engine.api",
    "DocumentChatRequest": "engine.api",
    "TranscribeRequest": "engine.api",
    "LiveTranscribeRequest": "engine.api",
    "ChatAnswer": "engine.api",
    "Handle": "engine.api",
    "Event": "engine.api",
    "SamplingParams": "engine.sampling",
    "Conversations": "engine.chat.answering",
    "JobStore": "engine.jobs",
    "Transcript": "engine.transcript",
    "CadenceError": "engine.errors",
}

__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
    if name in _PUBLIC:
        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
