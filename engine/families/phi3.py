"""Phi-3, Phi-3.5 and Phi-4-mini (``phi3``) on the batched seam: the checkpoint stores q/k/v as one
matrix and gate/up as another, which the seam uses as they are; a sliding window over every layer
where the config has one; partial rotary dimensions (Phi-4-mini) and longrope scaling come with the
rotary tables (engine/families/rope.py)."""

from __future__ import annotations

from engine.families.decoder import DecoderOnly


class Phi3Batched(DecoderOnly):
    architecture = "phi3"
    windows = True

    def _attention_weights(self, i: int, attn, prep):
        return prep.of(f"layers.{i}.qkv", attn.qkv_proj), prep.of(f"layers.{i}.out", attn.o_proj)

    def _mlp_weights(self, i: int, mlp, prep):
        return prep.of(f"layers.{i}.gate_up", mlp.gate_up_proj), prep.of(f"layers.{i}.down", mlp.down_proj)
