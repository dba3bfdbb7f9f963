"""Llama-family chat models (SmolLM2, Llama, Qwen2-style) on the batched seam.

Uses the loaded transformers modules' weights and norms as they are, so numerics match the
reference decoder; only attention and the cache are Cadence's.
"""

from __future__ import annotations

import torch

from engine.loading import LoadedModel
from engine.seam import BatchedDecoder, SlotKVCache, StepBatch, attend


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class LlamaBatched(BatchedDecoder):
    family = "chat"

    def __init__(self, loaded: LoadedModel, width: int, max_len: int = 2048):
        super().__init__(width)
        self.hf = loaded.model
        cfg = self.hf.config
        self.model = self.hf.model
        self.vocab_size = cfg.vocab_size
        self.heads = cfg.num_attention_heads
        self.kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.heads
        self.max_len = min(max_len, cfg.max_position_embeddings)
        p = next(self.hf.parameters())
        self.cache = SlotKVCache(cfg.num_hidden_layers, width, self.kv_heads, self.max_len, self.head_dim,
                                 p.dtype, p.device)

    @property
    def cache_bytes(self) -> int:
        return self.cache.nbytes

    @torch.inference_mode()
    def forward(self, batch: StepBatch, logit_rows: torch.Tensor | None = None) -> torch.Tensor:
        tokens = batch.flat(batch.tokens)
        x = self.model.embed_tokens(tokens)  # [R, d]
        cos, sin = self.model.rotary_emb(x[None], batch.row_positions[None])
        cos, sin = cos[0][:, None, :], sin[0][:, None, :]  # [R, 1, D]
        R = x.shape[0]
        for i, layer in enumerate(self.model.layers):
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            q = attn.q_proj(h).view(R, self.heads, self.head_dim)
            k = attn.k_proj(h).view(R, self.kv_heads, self.head_dim)
            v = attn.v_proj(h).view(R, self.kv_heads, self.head_dim)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            x = x + attn.o_proj(attend(q, k, v, self.cache, i, batch))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        if logit_rows is not None:
            x = x[logit_rows]
        return self.hf.lm_head(self.model.norm(x)).float()
