"""Sampling settings shared by every decoder, with validation that speaks to the user."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from engine.errors import RequestError


@dataclass
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    max_tokens: int = 256

    def validate(self) -> "SamplingParams":
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)) or self.temperature < 0:
            raise RequestError(f"Temperature must be a number of 0 or more (got {self.temperature}).")
        if not (0 < self.top_p <= 1):
            raise RequestError(f"top-p must be above 0 and at most 1 (got {self.top_p}).")
        if self.top_k < 0:
            raise RequestError(f"top-k must be 0 (off) or more (got {self.top_k}).")
        if self.max_tokens < 1:
            raise RequestError(f"max tokens must be at least 1 (got {self.max_tokens}).")
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def generator(self) -> torch.Generator:
        g = torch.Generator()
        g.manual_seed(self.seed if self.seed is not None else torch.seed())
        return g


def pick_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """Greedy argmax, or a sample from the tempered, top-k/top-p-filtered distribution."""
    if params.greedy:
        return int(torch.argmax(logits))
    logits = logits.float() / params.temperature
    if params.top_k and params.top_k < logits.numel():
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, -float("inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        cumulative = torch.cumsum(sorted_probs, dim=-1)
        drop = cumulative - sorted_probs >= params.top_p  # keep the smallest set reaching top_p
        sorted_probs[drop] = 0
        probs = torch.zeros_like(probs).scatter(0, order, sorted_probs)
        probs /= probs.sum()
    return int(torch.multinomial(probs, 1, generator=generator))
