"""The Llama family on the batched seam: Llama 3.x and SmolLM2 (``llama``), Mistral (``mistral``:
a sliding window where the config has one) and SmolLM3 (``smollm3``: every few layers without
rotation, NoPE). The forward pass itself is engine/families/decoder.py's."""

from __future__ import annotations

from engine.families.decoder import DecoderOnly
from engine.families.rope import SINGLE


class LlamaBatched(DecoderOnly):
    architecture = "llama"


class MistralBatched(DecoderOnly):
    architecture = "mistral"
    windows = True


class SmolLM3Batched(DecoderOnly):
    architecture = "smollm3"
    windows = True

    def _rope_of(self, i: int) -> str | None:
        return SINGLE if self.config.no_rope_layers[i] else None
