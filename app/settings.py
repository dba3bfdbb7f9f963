"""What a person chooses once and keeps: this computer's engine or a server's, backend, batching, drafter,
default models, outputs. A server's API key is kept by :mod:`app.keys` (the system keyring, else this
session only), never in the settings file.

:class:`Settings` is the typed store (QSettings underneath: the platform's usual place, or an INI
file given by path, which the tests use). The panel that edits it lives in
:mod:`app.settings_panel`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from PySide6.QtCore import QSettings

from engine.errors import CadenceError
from engine.formats import FORMATS
from engine.api import MIN_CONTEXT, PRECISIONS
from engine.speakers import parse_speakers
from engine.subtitles import SubtitleRules
from engine.models import DEFAULT_CHAT, DEFAULT_WHISPER
from engine.whisper.pipeline import WINDOWINGS

BACKENDS = ("auto", "cpu", "cuda", "mps")
DRAFTERS = ("auto", "mtp", "ngram", "draft", "off")  # "draft" is sent as "draft:MODEL"
PRECISION_CHOICES = ("auto", *PRECISIONS)
DEFAULT_FORMATS = ("txt",)
ENGINE_MODES = ("local", "server")  # this computer's engine, or a server's (engine.remote.RemoteEngine)


@dataclass
class EngineChoice:
    """The settings that decide how the engine is built (changing one means a new engine)."""

    backend: str
    batch: str | int  # "auto", "off" or a width
    drafter: str  # auto | mtp | ngram | draft:MODEL | off
    draft_depth: int  # 0: the engine chooses
    precision: str = "auto"  # auto | float32 | bfloat16 | int8
    context: str | int = "auto"  # tokens per chat slot: auto (the model's, as memory allows) or a number
    server: str = ""  # a server's address: the engine is that server's (the fields above are then its own)
    api_key: str = field(default="", repr=False)  # the server's key (from the keyring or this session)


class Settings:
    """Typed access to the app's QSettings. ``path``: an INI file (tests); None: the platform's place."""

    def __init__(self, path: str | Path | None = None):
        if path is None:
            self.q = QSettings("Cadence", "Cadence")
        else:
            self.q = QSettings(str(path), QSettings.IniFormat)

    # ------------------------------------------------------------------ helpers
    def _get(self, key: str, default):
        value = self.q.value(key, default)
        return default if value is None else value

    def _set(self, key: str, value) -> None:
        self.q.setValue(key, value)
        self.q.sync()

    # ------------------------------------------------------------------ engine
    @property
    def backend(self) -> str:
        value = str(self._get("engine/backend", "auto"))
        return value if value in BACKENDS else "auto"

    @backend.setter
    def backend(self, value: str) -> None:
        self._set("engine/backend", value)

    @property
    def batching(self) -> bool:
        return str(self._get("engine/batching", "true")).lower() in ("true", "1")

    @batching.setter
    def batching(self, on: bool) -> None:
        self._set("engine/batching", "true" if on else "false")

    @property
    def max_width(self) -> int:
        """0: the calibrated width (auto); else a fixed lane width."""
        try:
            return max(0, int(self._get("engine/max_width", 0)))
        except (TypeError, ValueError):
            return 0

    @max_width.setter
    def max_width(self, value: int) -> None:
        self._set("engine/max_width", int(value))

    @property
    def drafter(self) -> str:
        value = str(self._get("engine/drafter", "auto"))
        return value if value in DRAFTERS else "auto"

    @drafter.setter
    def drafter(self, value: str) -> None:
        self._set("engine/drafter", value)

    @property
    def draft_model(self) -> str:
        return str(self._get("engine/draft_model", ""))

    @draft_model.setter
    def draft_model(self, value: str) -> None:
        self._set("engine/draft_model", value)

    @property
    def draft_depth(self) -> int:
        try:
            return max(0, int(self._get("engine/draft_depth", 0)))
        except (TypeError, ValueError):
            return 0

    @draft_depth.setter
    def draft_depth(self, value: int) -> None:
        self._set("engine/draft_depth", int(value))

    @property
    def precision(self) -> str:
        value = str(self._get("engine/precision", "auto"))
        return value if value in PRECISION_CHOICES else "auto"

    @precision.setter
    def precision(self, value: str) -> None:
        self._set("engine/precision", value)

    @property
    def context(self) -> int:
        """0: the model's own context, as far as memory allows (auto); else at most this many tokens per chat slot."""
        try:
            value = int(self._get("engine/context", 0))
        except (TypeError, ValueError):
            return 0
        return value if value >= MIN_CONTEXT else 0

    @context.setter
    def context(self, value: int) -> None:
        self._set("engine/context", int(value))

    @property
    def engine_mode(self) -> str:
        """'local': the engine on this computer; 'server': a server at ``server_url``."""
        value = str(self._get("engine/mode", "local"))
        return value if value in ENGINE_MODES else "local"

    @engine_mode.setter
    def engine_mode(self, value: str) -> None:
        self._set("engine/mode", value)

    @property
    def server_url(self) -> str:
        return str(self._get("engine/server_url", ""))

    @server_url.setter
    def server_url(self, value: str) -> None:
        self._set("engine/server_url", value)

    @property
    def api_key(self) -> str:
        """The key for ``server_url``: from the system keyring, or kept for this session (app.keys)."""
        from app.keys import get_key

        return get_key(self.server_url)

    @api_key.setter
    def api_key(self, value: str) -> None:
        from app.keys import set_key

        set_key(self.server_url, value)

    @property
    def remote(self) -> bool:
        return self.engine_mode == "server" and bool(self.server_url)

    def engine_choice(self) -> EngineChoice:
        if self.remote:
            return EngineChoice("auto", "auto", "auto", 0, server=self.server_url, api_key=self.api_key)
        batch: str | int = "off" if not self.batching else (self.max_width or "auto")
        drafter = self.drafter
        if drafter == "draft":
            drafter = f"draft:{self.draft_model}" if self.draft_model else "auto"
        return EngineChoice(self.backend, batch, drafter, self.draft_depth, self.precision, self.context or "auto")

    # ------------------------------------------------------------------ models
    @property
    def transcription_model(self) -> str:
        return str(self._get("models/transcription", DEFAULT_WHISPER)) or DEFAULT_WHISPER

    @transcription_model.setter
    def transcription_model(self, value: str) -> None:
        self._set("models/transcription", value)

    @property
    def chat_model(self) -> str:
        return str(self._get("models/chat", DEFAULT_CHAT)) or DEFAULT_CHAT

    @chat_model.setter
    def chat_model(self, value: str) -> None:
        self._set("models/chat", value)

    @property
    def language(self) -> str:
        """'' : detect (multilingual models) or English (English-only models)."""
        return str(self._get("transcription/language", ""))

    @language.setter
    def language(self, value: str) -> None:
        self._set("transcription/language", value)

    @property
    def windowing(self) -> str:
        """How recordings are cut into 30-s windows: "vad" (in the pauses of speech) or "fixed"."""
        value = str(self._get("transcription/windowing", "vad"))
        return value if value in WINDOWINGS else "vad"

    @windowing.setter
    def windowing(self, value: str) -> None:
        self._set("transcription/windowing", value)

    # ------------------------------------------------------------------ transcripts: speakers, words, subtitles
    @property
    def speakers(self) -> str:
        """'off', 'auto' or a number of speakers (as text)."""
        value = str(self._get("transcription/speakers", "off"))
        try:
            return str(parse_speakers(value))
        except CadenceError:
            return "off"

    @speakers.setter
    def speakers(self, value) -> None:
        self._set("transcription/speakers", str(value))

    @property
    def word_timestamps(self) -> bool:
        return str(self._get("transcription/word_timestamps", "false")).lower() in ("true", "1")

    @word_timestamps.setter
    def word_timestamps(self, on: bool) -> None:
        self._set("transcription/word_timestamps", "true" if on else "false")

    @property
    def subtitle_rules(self) -> SubtitleRules:
        stored = {key: self._get(f"subtitles/{key}", None) for key in SubtitleRules().to_options()}
        try:
            return SubtitleRules.from_options(stored)
        except (CadenceError, TypeError, ValueError):
            return SubtitleRules()

    @subtitle_rules.setter
    def subtitle_rules(self, rules: SubtitleRules) -> None:
        for key, value in rules.to_options().items():
            self._set(f"subtitles/{key}", value)

    def transcript_options(self) -> dict:
        """What a new job takes from here: speakers, word timestamps and subtitle rules."""
        speakers = self.speakers
        return {"speakers": int(speakers) if speakers.isdigit() else speakers, "words": self.word_timestamps,
                "subtitles": self.subtitle_rules.to_options()}

    # ------------------------------------------------------------------ outputs
    @property
    def output_folder(self) -> str:
        """'' : next to each input file."""
        return str(self._get("output/folder", ""))

    @output_folder.setter
    def output_folder(self, value: str) -> None:
        self._set("output/folder", value)

    @property
    def output_formats(self) -> list[str]:
        value = self._get("output/formats", ",".join(DEFAULT_FORMATS))
        items = value if isinstance(value, list) else str(value).split(",")
        return [f for f in FORMATS if f in {i.strip() for i in items}]

    @output_formats.setter
    def output_formats(self, formats) -> None:
        self._set("output/formats", ",".join(f for f in FORMATS if f in set(formats)))

    # ------------------------------------------------------------------ recording
    @property
    def input_device(self) -> str:
        """The name of the microphone last chosen ('' : the system default)."""
        return str(self._get("record/device", ""))

    @input_device.setter
    def input_device(self, value: str) -> None:
        self._set("record/device", value)

    # ------------------------------------------------------------------ window
    @property
    def first_run_done(self) -> bool:
        return str(self._get("app/first_run_done", "false")).lower() in ("true", "1")

    @first_run_done.setter
    def first_run_done(self, value: bool) -> None:
        self._set("app/first_run_done", "true" if value else "false")
