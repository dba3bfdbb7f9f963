"""Llama-family chat models (SmolLM2, Llama, Qwen2-style) on the batched seam.

A lean forward pass: the loaded model's weights, fused per layer into one q/k/v and one
gate/up matrix and prepared for the backend's kernels (engine/kernels.py); rotary tables computed
once; attention and the cache are the seam's. No transformers module is called per step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.kernels import Linear
from engine.loading import LoadedModel
from engine.seam import BatchedDecoder, SlotKVCache, StepBatch, attend


@dataclass
class _Layer:
    input_norm: torch.Tensor
    qkv: Linear
    out: Linear
    post_norm: torch.Tensor
    gate_up: Linear
    down: Linear


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class LlamaBatched(BatchedDecoder):
    family = "chat"

    def __init__(self, loaded: LoadedModel, width: int = 1, max_len: int = 2048):
        hf = loaded.model
        cfg = hf.config
        self.vocab_size = cfg.vocab_size
        self.heads = cfg.num_attention_heads
        self.kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.heads
        self.max_len = min(max_len, cfg.max_position_embeddings)
        self.eps = cfg.rms_norm_eps
        self.hidden = cfg.hidden_size
        self.embed = hf.model.embed_tokens.weight.detach()
        self.layers = []
        for layer in hf.model.layers:
            a, mlp = layer.self_attn, layer.mlp
            self.layers.append(_Layer(
                input_norm=layer.input_layernorm.weight.detach(),
                qkv=Linear.fused([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight],
                                 [a.q_proj.bias, a.k_proj.bias, a.v_proj.bias]),
                out=Linear.of(a.o_proj),
                post_norm=layer.post_attention_layernorm.weight.detach(),
                gate_up=Linear.fused([mlp.gate_proj.weight, mlp.up_proj.weight]),
                down=Linear.of(mlp.down_proj),
            ))
        self.norm = hf.model.norm.weight.detach()
        self.lm_head = Linear.of(hf.lm_head)
        self._output_weight = hf.lm_head.weight.detach()
        with torch.inference_mode():  # rotary tables for every position, as the model computes them
            positions = torch.arange(self.max_len, device=self.embed.device)[None]
            cos, sin = hf.model.rotary_emb(self.embed[:1][None], positions)
        self.cos, self.sin = cos[0].to(self.embed.dtype), sin[0].to(self.embed.dtype)  # [max_len, D]
        self._split = (self.heads * self.head_dim, self.kv_heads * self.head_dim, self.kv_heads * self.head_dim)
        self._ffn = cfg.intermediate_size
        self.allocate(width)

    def _allocate(self, width: int, max_len: int) -> None:
        self.cache = None  # release the old cache before building the new one
        self.cache = SlotKVCache(len(self.layers), width, self.kv_heads, max_len, self.head_dim,
                                 self.embed.dtype, self.embed.device)

    @property
    def cache_bytes(self) -> int:
        return self.cache.nbytes

    @property
    def slot_bytes(self) -> int:
        return 2 * len(self.layers) * self.kv_heads * self.max_len * self.head_dim * self.embed.element_size()

    def output_embeddings(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.embed, self._output_weight

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (self.hidden,), weight, self.eps)

    @torch.inference_mode()
    def forward(self, batch: StepBatch, logit_rows: torch.Tensor | None = None, with_hidden: bool = False):
        x = F.embedding(batch.flat(batch.tokens), self.embed)  # [R, d]
        R = x.shape[0]
        cos = self.cos[batch.row_positions][:, None, :]  # [R, 1, D]
        sin = self.sin[batch.row_positions][:, None, :]
        for i, layer in enumerate(self.layers):
            q, k, v = layer.qkv(self._norm(x, layer.input_norm)).split(self._split, dim=-1)
            q = q.view(R, self.heads, self.head_dim)
            k = k.view(R, self.kv_heads, self.head_dim)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            x = x + layer.out(attend(q, k, v.view(R, self.kv_heads, self.head_dim), self.cache, i, batch))
            gate, up = layer.gate_up(self._norm(x, layer.post_norm)).split(self._ffn, dim=-1)
            x = x + layer.down(F.silu(gate) * up)
        if logit_rows is not None:
            x = x[logit_rows]
        hidden = self._norm(x, self.norm)
        logits = self.lm_head(hidden).float()
        return (logits, hidden) if with_hidden else logits
