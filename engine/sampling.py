"""Sampling settings: what a request asks of the token choice, checked into one sentence per mistake.

Light on purpose (no PyTorch), so front ends can check a request's settings before any model loads.
How the settings are applied, token by token: :mod:`engine.picking`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.errors import RequestError

if TYPE_CHECKING:
    import torch

MAX_STOP_STRINGS = 16


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0  # 1 = off
    top_k: int = 0  # 0 = off
    min_p: float = 0.0  # 0 = off
    repetition_penalty: float = 1.0  # 1 = off; > 1 discourages any token already in prompt or output
    presence_penalty: float = 0.0  # subtracted once from every token already in the output
    frequency_penalty: float = 0.0  # subtracted per occurrence in the output
    stop: list[str] = field(default_factory=list)  # the answer ends before the first of these
    seed: int | None = None
    max_tokens: int = 256

    def validate(self) -> "SamplingParams":
        if not _number(self.temperature) or self.temperature < 0:
            raise RequestError(f"Temperature must be a number of 0 or more (got {self.temperature}).")
        if not _number(self.top_p) or not (0 < self.top_p <= 1):
            raise RequestError(f"top-p must be above 0 and at most 1 (got {self.top_p}).")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise RequestError(f"top-k must be 0 (off) or a whole number above 0 (got {self.top_k}).")
        if not _number(self.min_p) or not (0 <= self.min_p < 1):
            raise RequestError(f"min-p must be at least 0 and below 1 (got {self.min_p}).")
        if not _number(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise RequestError(f"The repetition penalty must be above 0; 1 is off (got {self.repetition_penalty}).")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _number(value) or not (-2 <= value <= 2):
                raise RequestError(f"The {name.replace('_', ' ')} must be between -2 and 2 (got {value}).")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if len(self.stop) > MAX_STOP_STRINGS or any(not isinstance(s, str) or not s for s in self.stop):
            raise RequestError(f"Stop strings must be at most {MAX_STOP_STRINGS} non-empty texts.")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise RequestError(f"max tokens must be at least 1 (got {self.max_tokens}).")
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalized(self) -> bool:
        return self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0

    def generator(self) -> torch.Generator:
        import torch

        g = torch.Generator()
        g.manual_seed(self.seed if self.seed is not None else torch.seed())
        return g
