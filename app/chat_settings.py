"""Per-chat settings: the model, system prompt and sampling settings of one conversation."""

from __future__ import annotations

import dataclasses

from PySide6.QtWidgets import (
    QComboBox,
    QDialog,
    QDialogButtonBox,
    QDoubleSpinBox,
    QFormLayout,
    QPlainTextEdit,
    QSpinBox,
    QWidget,
)

from engine.models import CHAT, list_models


def chat_models() -> list[str]:
    return [m["name"] for m in list_models() if m["family"] == CHAT and m["available"]]


class ChatSettingsDialog(QDialog):
    """Model, system prompt and sampling settings of one conversation."""

    def __init__(self, conversation, parent: QWidget | None = None, models: list[str] | None = None):
        """``models``: the names to offer (a server's); None: this computer's chat models."""
        super().__init__(parent)
        self.setWindowTitle("Chat settings")
        p = conversation.params
        self.model = QComboBox()
        self.model.setEditable(True)
        self.model.addItems(chat_models() if models is None else models)
        self.model.setCurrentText(conversation.model)
        self.system = QPlainTextEdit(conversation.system or "")
        self.system.setPlaceholderText("Optional: how the assistant should answer")
        self.temperature = QDoubleSpinBox(decimals=2, minimum=0, maximum=5, singleStep=0.1, value=p.temperature)
        self.top_p = QDoubleSpinBox(decimals=2, minimum=0.01, maximum=1, singleStep=0.05, value=p.top_p)
        self.top_k = QSpinBox(minimum=0, maximum=1000, value=p.top_k)
        self.repetition = QDoubleSpinBox(decimals=2, minimum=0.01, maximum=5, singleStep=0.05, value=p.repetition_penalty)
        self.max_tokens = QSpinBox(minimum=1, maximum=4096, value=p.max_tokens)
        self.seed = QSpinBox(minimum=-1, maximum=2**31 - 1, value=-1 if p.seed is None else p.seed)
        self.seed.setSpecialValueText("none")
        form = QFormLayout(self)
        form.addRow("Model", self.model)
        form.addRow("System prompt", self.system)
        form.addRow("Temperature (0 = greedy)", self.temperature)
        form.addRow("Top-p", self.top_p)
        form.addRow("Top-k (0 = off)", self.top_k)
        form.addRow("Repetition penalty (1 = off)", self.repetition)
        form.addRow("Max tokens per answer", self.max_tokens)
        form.addRow("Seed", self.seed)
        buttons = QDialogButtonBox(QDialogButtonBox.Ok | QDialogButtonBox.Cancel)
        buttons.accepted.connect(self.accept)
        buttons.rejected.connect(self.reject)
        form.addRow(buttons)
        self._params = p

    def values(self) -> dict:
        params = dataclasses.replace(self._params, temperature=self.temperature.value(), top_p=self.top_p.value(),
                                     top_k=self.top_k.value(), repetition_penalty=self.repetition.value(),
                                     max_tokens=self.max_tokens.value(),
                                     seed=None if self.seed.value() < 0 else self.seed.value())
        return {"model": self.model.currentText().strip(), "system": self.system.toPlainText(), "params": params}
