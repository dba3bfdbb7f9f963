"""The settings panel: the engine (this computer's or a server's: app.remote_settings), backend, batching,
drafter, default models, outputs, where files live.

Pressing Apply stores everything (QSettings, via :class:`app.settings.Settings`). Models, language
and outputs apply to what is added from then on; backend, batching and drafter need a new engine,
which the bridge builds at once when nothing is in flight, else as soon as the current work ends.
The note under the button says which happened.
"""

from __future__ import annotations

import inspect

from PySide6.QtCore import Qt
from PySide6.QtWidgets import (
    QCheckBox,
    QComboBox,
    QDoubleSpinBox,
    QFileDialog,
    QFormLayout,
    QGroupBox,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QPushButton,
    QSpinBox,
    QVBoxLayout,
    QWidget,
)

from engine.errors import CadenceError
from engine.subtitles import SubtitleRules
from engine.backend import available_backends, describe_backend, resolve_backend
from engine.api import MIN_CONTEXT
from engine.kernels import precisions_on
from engine import Engine
from engine.formats import FORMATS
from engine.models import CHAT, WHISPER, list_models
from engine.paths import cache_dir, data_dir

from app.bridge import EngineBridge
from app.keys import where_kept
from app.remote_settings import ServerBox, whisper_names
from app.settings import PRECISION_CHOICES, BACKENDS, DRAFTERS

SPEAKER_CHOICES = (("Off", "off"), ("Tell apart, count them", "auto"),
                   *((f"Tell apart: {n} speakers", str(n)) for n in range(2, 9)))
WINDOWING_CHOICES = (("By voice activity (in pauses)", "vad"), ("Every 30 seconds", "fixed"))
DRAFTER_LABELS = {"auto": "Automatic", "mtp": "MTP head", "ngram": "n-gram", "draft": "Draft model", "off": "Off"}
PRECISION_LABELS = {"auto": "Automatic (measured per model)", "float32": "float32 (reference)",
                    "bfloat16": "bfloat16", "int8": "int8 weights"}


def engine_drafts() -> bool:
    return "drafter" in inspect.signature(Engine).parameters


class SettingsPanel(QWidget):
    def __init__(self, bridge: EngineBridge, parent: QWidget | None = None):
        super().__init__(parent)
        self.bridge = bridge
        s = bridge.settings
        present = available_backends()

        # engine ---------------------------------------------------------------
        self.server = ServerBox(s)
        self.backend = QComboBox()
        for name in BACKENDS:
            self.backend.addItem(name.upper() if name != "auto" else "Automatic", name)
            index = self.backend.count() - 1
            if name != "auto" and name not in present:
                self.backend.model().item(index).setEnabled(False)
                self.backend.setItemData(index, f"{name.upper()} is not available on this machine", Qt.ToolTipRole)
        self.backend.setCurrentIndex(max(0, self.backend.findData(s.backend)))
        detected = resolve_backend("auto")
        self.detected = QLabel(f"Detected: {describe_backend(detected)}")
        self.batching = QCheckBox("Decode several requests together (batching)")
        self.batching.setChecked(s.batching)
        self.max_width = QSpinBox(minimum=0, maximum=256, value=s.max_width)
        self.max_width.setSpecialValueText("auto")
        self.batching.toggled.connect(self.max_width.setEnabled)
        self.max_width.setEnabled(s.batching)
        self.width_note = QLabel()
        self.drafter = QComboBox()
        for name in DRAFTERS:
            self.drafter.addItem(DRAFTER_LABELS[name], name)
        self.drafter.setCurrentIndex(max(0, self.drafter.findData(s.drafter)))
        self.draft_model = QLineEdit(s.draft_model)
        self.draft_model.setPlaceholderText("draft model name or path (for 'Draft model')")
        self.draft_depth = QSpinBox(minimum=0, maximum=16, value=s.draft_depth)
        self.draft_depth.setSpecialValueText("auto")
        self.drafter.currentIndexChanged.connect(self._drafter_changed)
        self.draft_note = QLabel("" if engine_drafts() else
                                 "This version of the engine does not draft yet; the choice is kept for when it does.")
        self.draft_note.setWordWrap(True)
        self.precision = QComboBox()
        offered = precisions_on(resolve_backend(s.backend if s.backend in present else "auto"))
        for name in PRECISION_CHOICES:
            self.precision.addItem(PRECISION_LABELS[name], name)
            if name != "auto" and name not in offered:
                index = self.precision.count() - 1
                self.precision.model().item(index).setEnabled(False)
                self.precision.setItemData(index, f"{name} is not offered on this machine", Qt.ToolTipRole)
        self.precision.setCurrentIndex(max(0, self.precision.findData(s.precision)))
        self.precision_note = QLabel()
        self.precision_note.setWordWrap(True)
        self.context = QSpinBox(minimum=0, maximum=1 << 20, value=s.context, singleStep=1024)
        self.context.setSpecialValueText("auto")
        self.context.setToolTip("Tokens per chat slot, prompt and answer together. Auto: the model's own "
                                "context, as far as memory allows at the lane's width.")
        self.context_note = QLabel()  # each chat lane's slot length, its model's limit, and why
        self.context_note.setWordWrap(True)
        engine_box = QGroupBox("Engine")
        ef = QFormLayout(engine_box)
        ef.addRow("Backend", self.backend)
        ef.addRow("", self.detected)
        ef.addRow(self.batching)
        ef.addRow("Max width (slots per model)", self.max_width)
        ef.addRow("", self.width_note)
        ef.addRow("Drafter", self.drafter)
        ef.addRow("Draft model", self.draft_model)
        ef.addRow("Draft depth", self.draft_depth)
        ef.addRow("", self.draft_note)
        ef.addRow("Precision", self.precision)
        ef.addRow("", self.precision_note)
        ef.addRow("Chat context (tokens per slot)", self.context)
        ef.addRow("", self.context_note)
        self._drafter_changed()
        self.engine_box = engine_box

        # models and outputs ---------------------------------------------------
        models = list_models()
        self.transcription_model = QComboBox()
        self.transcription_model.setEditable(True)
        self.transcription_model.addItems([m["name"] for m in models if m["family"] == WHISPER])
        self.transcription_model.setCurrentText(s.transcription_model)
        self.chat_model = QComboBox()
        self.chat_model.setEditable(True)
        self.chat_model.addItems([m["name"] for m in models if m["family"] == CHAT])
        self.chat_model.setCurrentText(s.chat_model)
        self.language = QLineEdit(s.language)
        self.language.setPlaceholderText("detect (e.g. en, de, fr)")
        self.windowing = QComboBox()
        for label, value in WINDOWING_CHOICES:
            self.windowing.addItem(label, value)
        self.windowing.setCurrentIndex(self.windowing.findData(s.windowing))
        self.windowing.setToolTip("By voice activity: windows end in pauses and long silences are skipped "
                                  "(fewer mistakes at window edges). Every 30 seconds: the same windows as "
                                  "faster-whisper's sequential run, so the same words.")
        self.output_folder = QLineEdit(s.output_folder)
        self.output_folder.setPlaceholderText("next to each recording")
        browse = QPushButton("Choose…")
        browse.clicked.connect(self._choose_folder)
        folder_row = QHBoxLayout()
        folder_row.addWidget(self.output_folder, 1)
        folder_row.addWidget(browse)
        self.formats = {fmt: QCheckBox(fmt.upper()) for fmt in FORMATS}
        formats_row = QHBoxLayout()
        for fmt, box in self.formats.items():
            box.setChecked(fmt in s.output_formats)
            formats_row.addWidget(box)
        formats_row.addStretch(1)
        self.local_models = ([m["name"] for m in models if m["family"] == WHISPER],
                             [m["name"] for m in models if m["family"] == CHAT])
        self.server_models: list[str] = []  # what the server listed at the last connection test
        models_box = QGroupBox("Models and outputs")
        mf = QFormLayout(models_box)
        mf.addRow("Transcription model", self.transcription_model)
        mf.addRow("Chat model", self.chat_model)
        mf.addRow("Language", self.language)
        mf.addRow("Cut recordings", self.windowing)
        mf.addRow("Save transcripts to", folder_row)
        mf.addRow("Formats saved", formats_row)

        # speakers, words, subtitles -------------------------------------------
        self.speakers = QComboBox()
        for label, value in SPEAKER_CHOICES:
            self.speakers.addItem(label, value)
        self.speakers.setCurrentIndex(max(0, self.speakers.findData(s.speakers)))
        self.word_timestamps = QCheckBox("Time each word (highlighted as the recording plays)")
        self.word_timestamps.setChecked(s.word_timestamps)
        rules = s.subtitle_rules
        self.max_chars = QSpinBox(minimum=10, maximum=200, value=rules.max_chars)
        self.max_lines = QSpinBox(minimum=1, maximum=5, value=rules.max_lines)
        self.min_cue = QDoubleSpinBox(minimum=0.1, maximum=10.0, singleStep=0.1, value=rules.min_duration, suffix=" s")
        self.max_cue = QDoubleSpinBox(minimum=0.5, maximum=30.0, singleStep=0.5, value=rules.max_duration, suffix=" s")
        transcripts_box = QGroupBox("Speakers, words and subtitles")
        tf = QFormLayout(transcripts_box)
        tf.addRow("Speakers", self.speakers)
        tf.addRow(self.word_timestamps)
        tf.addRow("Subtitle characters per line", self.max_chars)
        tf.addRow("Subtitle lines per cue", self.max_lines)
        tf.addRow("Shortest cue", self.min_cue)
        tf.addRow("Longest cue", self.max_cue)

        # where files live -----------------------------------------------------
        places = QGroupBox("Where files live")
        pf = QFormLayout(places)
        for label, value in (("Your data (jobs, chats, recordings)", str(data_dir())),
                             ("Converted models (safe to delete)", str(cache_dir())),
                             ("These settings", s.q.fileName())):
            text = QLabel(value)
            text.setTextInteractionFlags(Qt.TextSelectableByMouse)
            pf.addRow(label, text)

        self.apply_button = QPushButton("Apply")
        self.apply_button.clicked.connect(self.apply)
        self.note = QLabel()
        self.note.setWordWrap(True)
        row = QHBoxLayout()
        row.addWidget(self.apply_button)
        row.addWidget(self.note, 1)
        layout = QVBoxLayout(self)
        columns = QHBoxLayout()
        left = QVBoxLayout()
        left.addWidget(self.server)
        left.addWidget(engine_box)
        columns.addLayout(left, 1)
        right = QVBoxLayout()
        right.addWidget(models_box)
        right.addWidget(transcripts_box)
        right.addWidget(places)
        columns.addLayout(right, 1)
        layout.addLayout(columns)
        layout.addLayout(row)
        layout.addStretch(1)
        bridge.status_changed.connect(self._show_width)
        bridge.engine_rebuilt.connect(self.note.setText)
        self.server.tested.connect(self._server_models)
        self.server.mode.currentIndexChanged.connect(self._mode_changed)
        self._mode_changed()
        if self.server.server_mode and s.server_url:
            self.server.test()  # the server's model names fill the model choices

    def _mode_changed(self, *_) -> None:
        """In server mode the server runs its own engine: this computer's engine settings are greyed out (the
        box's note says why), and the model choices list the server's models once it has been asked."""
        remote = self.server.server_mode
        self.engine_box.setEnabled(not remote)
        self.engine_box.setToolTip(self.server.note.text() if remote else "")
        for widget in (self.speakers, self.windowing):
            widget.setEnabled(not remote)
        whisper, chat = (whisper_names(self.server_models), [n for n in self.server_models if n not in
                                                             whisper_names(self.server_models)]) \
            if remote and self.server_models else self.local_models
        for box, names in ((self.transcription_model, whisper), (self.chat_model, chat)):
            current = box.currentText()
            box.clear()
            box.addItems(names)
            # a server's names: keep the choice if it serves it, else its first; this computer's: keep the choice
            box.setCurrentText(current if not (remote and self.server_models) or current in names or not names
                               else names[0])

    def _server_models(self, ok: bool, sentence: str, names: list) -> None:
        if ok:
            self.server_models = list(names)
            self._mode_changed()

    def _drafter_changed(self, *_):
        self.draft_model.setEnabled(self.drafter.currentData() == "draft")
        self.draft_depth.setEnabled(self.drafter.currentData() != "off")

    def _choose_folder(self) -> None:
        folder = QFileDialog.getExistingDirectory(self, "Save transcripts to")
        if folder:
            self.output_folder.setText(folder)

    def _show_width(self, status: dict) -> None:
        parts = []
        for model, lane in (status.get("lanes") or {}).items():
            chosen = (lane.get("calibration") or {}).get("chosen")
            parts.append(f"{model}: {lane.get('width')} in use" + (f" (calibrated: {chosen})" if chosen else ""))
        text = "; ".join(parts) or "auto measures the best width for each model on first use"
        if self.width_note.text() != text:
            self.width_note.setText(text)
        chosen = "; ".join(f"{model}: {lane['precision_why']}" for model, lane in (status.get("lanes") or {}).items()
                           if lane.get("precision_why"))
        chosen = chosen or "auto measures each precision on each model's first use and keeps the fastest within " \
                           "quality bounds"
        if self.precision_note.text() != chosen:
            self.precision_note.setText(chosen)
        contexts = "; ".join(f"{model}: {lane['context']} tokens per slot, the model handles {lane['context_limit']} "
                             f"({lane.get('context_from', '?')})" for model, lane in (status.get("lanes") or {}).items()
                             if lane.get("family") == "chat" and lane.get("context"))
        contexts = contexts or "auto gives each chat slot the model's own context, as far as memory allows"
        if self.context_note.text() != contexts:
            self.context_note.setText(contexts)

    def apply(self) -> str:
        s = self.bridge.settings
        before = s.engine_choice()
        bad_address = None
        if self.server.server_mode:
            try:
                self.server.checked_url()
            except CadenceError as exc:  # a bad address changes nothing; the rest is stored
                bad_address = str(exc)
                self.server.result.setText(bad_address)
            if bad_address is None:
                s.engine_mode, s.server_url = "server", self.server.url.text().strip()
                s.api_key = self.server.key.text().strip()  # the keyring, or this session: never the settings file
                self.server.key_note.setText(where_kept())
        else:
            s.engine_mode = "local"
        s.backend = self.backend.currentData()
        s.batching = self.batching.isChecked()
        s.max_width = self.max_width.value()
        s.drafter = self.drafter.currentData()
        s.draft_model = self.draft_model.text().strip()
        s.draft_depth = self.draft_depth.value()
        s.precision = self.precision.currentData()
        s.context = self.context.value() if self.context.value() >= MIN_CONTEXT else 0
        s.transcription_model = self.transcription_model.currentText().strip()
        s.chat_model = self.chat_model.currentText().strip()
        s.language = self.language.text().strip()
        s.windowing = self.windowing.currentData()
        s.output_folder = self.output_folder.text().strip()
        s.output_formats = [f for f, box in self.formats.items() if box.isChecked()] or ["txt"]
        s.speakers = self.speakers.currentData()
        s.word_timestamps = self.word_timestamps.isChecked()
        notes = ["Saved. Models, language, windows and outputs apply to files and chats added from now on."]
        try:
            s.subtitle_rules = SubtitleRules(max_chars=self.max_chars.value(), max_lines=self.max_lines.value(),
                                             min_duration=self.min_cue.value(), max_duration=self.max_cue.value())
        except CadenceError as exc:
            notes.append(f"The subtitle rules were not changed: {exc}")
        if bad_address:
            notes.append(f"The engine was not changed: {bad_address}")
        if s.engine_choice() != before:
            notes.append(self.bridge.apply_engine_settings())
            if s.remote:
                self.server.test()  # says at once whether the server answers, and fills the model choices
        text = " ".join(notes)
        self.note.setText(text)
        return text
