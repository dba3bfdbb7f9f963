"""Whisper's decoder on the batched seam, with per-slot encoder memory for cross-attention."""

from __future__ import annotations

import torch

from engine.loading import LoadedModel
from engine.seam import BatchedDecoder, SlotKVCache, StepBatch, attend, attend_fixed


class WhisperBatched(BatchedDecoder):
    family = "whisper"

    def __init__(self, loaded: LoadedModel, width: int):
        super().__init__(width)
        self.hf = loaded.model
        cfg = self.hf.config
        self.decoder = self.hf.model.decoder
        self.encoder = self.hf.model.encoder
        self.vocab_size = cfg.vocab_size
        self.heads = cfg.decoder_attention_heads
        self.head_dim = cfg.d_model // self.heads
        self.max_len = cfg.max_target_positions
        p = next(self.hf.parameters())
        layers = cfg.decoder_layers
        self.cache = SlotKVCache(layers, width, self.heads, self.max_len, self.head_dim, p.dtype, p.device)
        memory = (layers, width, self.heads, cfg.max_source_positions, self.head_dim)
        self.cross_k = torch.zeros(memory, dtype=p.dtype, device=p.device)
        self.cross_v = torch.zeros(memory, dtype=p.dtype, device=p.device)

    @property
    def cache_bytes(self) -> int:
        return self.cache.nbytes + 2 * self.cross_k.numel() * self.cross_k.element_size()

    @torch.inference_mode()
    def encode(self, windows: torch.Tensor) -> torch.Tensor:
        """[n, mels, 3000] log-mel windows -> [n, 1500, d] encoder states."""
        return self.encoder(input_features=windows).last_hidden_state

    @torch.inference_mode()
    def set_memory(self, slot: int, encoded: torch.Tensor) -> None:
        """Project one window's encoder states [1500, d] into the slot's cross-attention keys/values."""
        M = encoded.shape[0]
        for i, layer in enumerate(self.decoder.layers):
            attn = layer.encoder_attn
            self.cross_k[i, slot] = attn.k_proj(encoded).view(M, self.heads, self.head_dim).transpose(0, 1)
            self.cross_v[i, slot] = attn.v_proj(encoded).view(M, self.heads, self.head_dim).transpose(0, 1)

    @torch.inference_mode()
    def forward(self, batch: StepBatch, logit_rows: torch.Tensor | None = None) -> torch.Tensor:
        tokens = batch.flat(batch.tokens)
        x = self.decoder.embed_tokens(tokens) + self.decoder.embed_positions.weight[batch.row_positions]
        R = x.shape[0]
        shape = (R, self.heads, self.head_dim)
        for i, layer in enumerate(self.decoder.layers):
            sa = layer.self_attn
            h = layer.self_attn_layer_norm(x)
            out = attend(sa.q_proj(h).view(shape), sa.k_proj(h).view(shape), sa.v_proj(h).view(shape),
                         self.cache, i, batch)
            x = x + sa.out_proj(out)
            ca = layer.encoder_attn
            h = layer.encoder_attn_layer_norm(x)
            x = x + ca.out_proj(attend_fixed(ca.q_proj(h).view(shape), self.cross_k[i], self.cross_v[i], batch))
            h = layer.final_layer_norm(x)
            x = x + layer.fc2(layer.activation_fn(layer.fc1(h)))
        if logit_rows is not None:
            x = x[logit_rows]
        return self.hf.proj_out(self.decoder.layer_norm(x)).float()
