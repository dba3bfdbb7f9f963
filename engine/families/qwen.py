"""Qwen2 / Qwen2.5 (``qwen2``: biases on q, k and v) and Qwen3 (``qwen3``: an RMS norm per head on q
and k before rotation) on the batched seam. Both take the config's sliding window on the layers its
``layer_types`` mark (off unless ``use_sliding_window``). The biases and q/k norms are read from the
model's modules by engine/families/decoder.py; the forward pass is its."""

from __future__ import annotations

from engine.families.decoder import DecoderOnly


class Qwen2Batched(DecoderOnly):
    architecture = "qwen2"
    windows = True


class Qwen3Batched(DecoderOnly):
    architecture = "qwen3"
    windows = True
