"""Llama-family chat models (SmolLM2, Llama, Qwen2-style) on the batched seam.

A lean forward pass: the loaded model's weights, fused per layer into one q/k/v and one
gate/up matrix and prepared for the backend's kernels in the chosen precision (engine/kernels.py);
rotary tables computed once; attention and the cache are the seam's. No transformers module is
called per step. Activations are kept in the precision's activation dtype (float32, or bfloat16
for the bfloat16 and int8 precisions); the KV cache and attention in engine.kernels.attention_dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.kernels import Linear, activation_dtype, attention_dtype
from engine.loading import LoadedModel
from engine.seam import BatchedDecoder, SlotKVCache, StepBatch, attend
from engine.weights import WeightPrep


@dataclass
class _Layer:
    input_norm: torch.Tensor
    qkv: Linear
    out: Linear
    post_norm: torch.Tensor
    gate_up: Linear
    down: Linear


class LlamaBatched(BatchedDecoder):
    family = "chat"

    def __init__(self, loaded: LoadedModel, width: int = 1, max_len: int = 2048, precision: str = "float32"):
        hf = loaded.model
        cfg = hf.config
        self.precision = precision
        self.vocab_size = cfg.vocab_size
        self.heads = cfg.num_attention_heads
        self.kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.heads
        self.max_len = min(max_len, cfg.max_position_embeddings)
        self.eps = cfg.rms_norm_eps
        self.hidden = cfg.hidden_size
        self.embed = hf.model.embed_tokens.weight.detach()
        self.dtype = activation_dtype(precision, self.embed.device)
        self.cache_dtype = attention_dtype(precision, self.embed.device)
        prep = WeightPrep(loaded, precision)
        self.weights_from_cache = prep.from_cache
        self.layers = []
        for i, layer in enumerate(hf.model.layers):
            a, mlp = layer.self_attn, layer.mlp
            self.layers.append(_Layer(
                input_norm=layer.input_layernorm.weight.detach().to(self.dtype),
                qkv=prep.fused(f"layers.{i}.qkv", [a.q_proj.weight, a.k_proj.weight, a.v_proj.weight],
                               [a.q_proj.bias, a.k_proj.bias, a.v_proj.bias]),
                out=prep.of(f"layers.{i}.out", a.o_proj),
                post_norm=layer.post_attention_layernorm.weight.detach().to(self.dtype),
                gate_up=prep.fused(f"layers.{i}.gate_up", [mlp.gate_proj.weight, mlp.up_proj.weight]),
                down=prep.of(f"layers.{i}.down", mlp.down_proj),
            ))
        self.norm = hf.model.norm.weight.detach().to(self.dtype)
        self.lm_head = prep.of("lm_head", hf.lm_head)
        prep.save()
        self._output_weight = hf.lm_head.weight.detach()
        with torch.inference_mode():  # rotary tables for every position, as the model computes them
            positions = torch.arange(self.max_len, device=self.embed.device)[None]
            cos, sin = hf.model.rotary_emb(self.embed[:1][None], positions)
        self.cos, self.sin = cos[0].to(self.dtype), sin[0].to(self.dtype)  # [max_len, D]
        self._qk = (self.heads + self.kv_heads) * self.head_dim  # q and k, rotated together
        self._ffn = cfg.intermediate_size
        self.allocate(width)

    def _allocate(self, width: int, max_len: int) -> None:
        self.cache = None  # release the old cache before building the new one
        self.cache = SlotKVCache(len(self.layers), width, self.kv_heads, max_len, self.head_dim,
                                 self.cache_dtype, self.embed.device)

    @property
    def cache_bytes(self) -> int:
        return self.cache.nbytes

    @property
    def slot_bytes(self) -> int:
        element = torch.tensor([], dtype=self.cache_dtype).element_size()
        return 2 * len(self.layers) * self.kv_heads * self.max_len * self.head_dim * element

    @property
    def weight_bytes(self) -> int:
        """Weight bytes one step reads (every layer's matrices and the output layer)."""
        per_layer = sum(m.nbytes for layer in self.layers for m in (layer.qkv, layer.out, layer.gate_up, layer.down))
        return per_layer + self.lm_head.nbytes

    def output_embeddings(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.embed, self._output_weight

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (self.hidden,), weight, self.eps)

    def _rotate(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """q, k (rotary position embedding applied to both in one go) and v, as [R, heads, D] each."""
        R, D, half = qkv.shape[0], self.head_dim, self.head_dim // 2
        qk = qkv[:, : self._qk].view(R, self.heads + self.kv_heads, D)
        turned = torch.cat((-qk[..., half:], qk[..., :half]), dim=-1)  # rotate_half, as the model does
        qk = qk * cos + turned * sin
        v = qkv[:, self._qk :].view(R, self.kv_heads, D)
        return qk[:, : self.heads], qk[:, self.heads :], v

    @torch.inference_mode()
    def forward(self, batch: StepBatch, logit_rows: torch.Tensor | None = None, with_hidden: bool = False):
        x = F.embedding(batch.flat(batch.tokens), self.embed).to(self.dtype)  # [R, d]
        cos = self.cos[batch.row_positions][:, None, :]  # [R, 1, D]
        sin = self.sin[batch.row_positions][:, None, :]
        for i, layer in enumerate(self.layers):
            q, k, v = self._rotate(layer.qkv(self._norm(x, layer.input_norm)), cos, sin)
            x = x + layer.out(attend(q, k, v, self.cache, i, batch))
            gate, up = layer.gate_up(self._norm(x, layer.post_norm)).split(self._ffn, dim=-1)
            x = x + layer.down(F.silu(gate) * up)
        if logit_rows is not None:
            x = x[logit_rows]
        hidden = self._norm(x, self.norm)
        logits = self.lm_head(hidden).float()
        return (logits, hidden) if with_hidden else logits
