"""Whisper's decoder on the batched seam, with per-slot encoder memory for cross-attention.

A lean forward pass like the Llama family's: weights fused (self-attention q/k/v) and prepared for
the backend's kernels once in the chosen precision, for the decoder and for the encoder (where
oneDNN's packed matrix product is about twice the default on CPU even at 1500 rows, and bfloat16
runs on the CPU's matrix units where it has them). Activations are kept in the precision's
activation dtype; the KV cache and self-attention in engine.kernels.attention_dtype. The encoder
memory (cross-attention's keys and values) is kept in the activation dtype wherever this machine
has a way to attend over it that leaves each row independent of its batch (see
:func:`memory_dtype`): it never changes length, so bfloat16's sums stay put, and at 16 slots it is
most of the bytes a decode step reads. Where int8 runs its attention in C (float32 activations,
engine/native/layer_ops.c), the memory is kept in float16 and summed in float32, and the output layer runs on
16-bit integer products where those are faster on the machine (:func:`output_kernel`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.nn.functional as F

from engine import many_rows_int8, native
from engine.kernels import Linear, activation_dtype, attention_dtype, precision_of, unquantized_dtype
from engine.loading import LoadedModel
from engine.seam import BatchedDecoder, SlotKVCache, StepBatch, attend, attend_fixed, attention_way, round_up
from engine.weights import WeightPrep


@dataclass
class _Layer:
    self_norm: tuple[torch.Tensor, torch.Tensor]
    qkv: Linear
    self_out: Linear
    cross_norm: tuple[torch.Tensor, torch.Tensor]
    cross_q: Linear
    cross_kv: Linear
    cross_out: Linear
    ffn_norm: tuple[torch.Tensor, torch.Tensor]
    fc1: Linear
    fc2: Linear


@dataclass
class _EncoderLayer:
    attn_norm: tuple[torch.Tensor, torch.Tensor]
    qkv: Linear
    out: Linear
    ffn_norm: tuple[torch.Tensor, torch.Tensor]
    fc1: Linear
    fc2: Linear


class _EncoderPrep(WeightPrep):
    """The encoder's layers: unquantized, or on ``int8_engine``'s integer products (engine.many_rows_int8)."""

    def __init__(self, loaded: LoadedModel, precision: str, int8_engine: str | None):
        super().__init__(loaded, precision)
        self.int8_engine = int8_engine

    def linear(self, name: str, weight: torch.Tensor, bias: torch.Tensor | None = None, invariant: bool = True):
        if self.int8_engine:
            return many_rows_int8.ManyRowsInt8Linear(weight, bias, self.int8_engine)
        return super().linear(name, weight, bias, invariant)


def memory_dtype(precision: str, device: torch.device) -> torch.dtype:
    """The dtype of the encoder memory and the cross-attention over it: the activations' (the cross
    keys and values are computed in it, so nothing is lost keeping them so), where an attention way
    keeps rows independent of their batch for it over a fixed-length memory; else attention_dtype's
    (float32 on CPU). bfloat16 halves what each decode step reads from the memory."""
    dtype = activation_dtype(precision, device)
    if dtype == attention_dtype(precision, device) or attention_way(device, dtype, fixed_memory=True) == "fused":
        return attention_dtype(precision, device)
    return dtype


def _time_output_kernels() -> str:
    """"i16dot" where the 16-bit integer kernel runs a whisper-base-sized output layer (51864 x 512, int8)
    at 8 rows at least 1.15x faster than the float kernel here, else "layer" (the layer's own kernel)."""
    generator = torch.Generator().manual_seed(0)
    q = torch.randint(-127, 128, (51864, 512), generator=generator, dtype=torch.int8)
    scale = torch.rand(51864, 512 // native.int8_group(), generator=generator) * 0.01
    x = torch.randn(8, 512, generator=generator)
    float_kernel = native.int8_kernel()
    best = many_rows_int8.best_times({kernel: (lambda kernel=kernel: native.int8_linear(x, q, scale, kernel=kernel))
                                      for kernel in (float_kernel, "i16dot")})
    return "i16dot" if best[float_kernel] >= many_rows_int8.MARGIN * best["i16dot"] else "layer"


def output_kernel() -> str | None:
    """The int8 kernel Whisper's output layer runs on here: "i16dot" (activations rounded to int16 per 32
    inputs, integer products: about float32's logits, each row alone) where it is measurably faster than the
    float kernel, else None (the layer's own). Measured once per machine and recorded; where
    ``CADENCE_INT8_KERNEL`` names kernels, or the processor has no integer ones, None."""
    if os.environ.get("CADENCE_INT8_KERNEL") or "i16dot" not in native.int8_kernels_here():
        return None
    from engine.kernels import recorded_choice

    way = recorded_choice("whisper-output-i16dot-vs-float", _time_output_kernels, lambda v: v in ("i16dot", "layer"))
    return "i16dot" if way == "i16dot" else None


def _norm_of(module: torch.nn.LayerNorm, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    return module.weight.detach().to(dtype), module.bias.detach().to(dtype)


class WhisperBatched(BatchedDecoder):
    family = "whisper"
    architecture = "whisper"

    def __init__(self, loaded: LoadedModel, width: int = 1, precision: str = "float32", keep_4bit: bool | None = None,
                 float_encoder: bool = False):
        hf = loaded.model
        cfg = hf.config
        decoder = hf.model.decoder
        encoder = hf.model.encoder
        self.precision = precision
        self.embed = decoder.embed_tokens.weight.detach()
        dtype = self.dtype = activation_dtype(precision, self.embed.device)
        prep = WeightPrep(loaded, precision, keep_4bit)
        self.weights_from_cache = prep.from_cache
        # The encoder is compute-bound (1500 rows a window): int8 weights read by the decode kernels would
        # only add dequantizing work there, so with int8 it runs on 8-bit integer products where this
        # CPU has faster ones (engine.many_rows_int8, measured once per machine), else unquantized (in
        # bfloat16 where the machine has it).
        dtype_e = self.encoder_dtype = unquantized_dtype(precision, self.embed.device)
        self.encoder_int8 = (many_rows_int8.encoder_int8_engine(dtype_e)  # float_encoder: kept unquantized
                             if precision == "int8" and self.embed.device.type == "cpu" and not float_encoder else None)
        if self.encoder_int8:
            dtype_e = self.encoder_dtype = torch.float32
        encoder_prep = prep if precision != "int8" else _EncoderPrep(loaded, precision_of(dtype_e), self.encoder_int8)
        # Each window's keys and values for cross-attention: 1500 rows once a window, like the encoder's
        # layers, so with int8 they keep their float weights where the decode kernels' int8 is no faster.
        memory_prep, self.memory_projection = prep, precision_of(dtype)
        if precision == "int8":
            self.memory_projection = "int8"
            unquantized = unquantized_dtype(precision, self.embed.device)
            if self.embed.device.type == "cpu" and many_rows_int8.memory_projection_way(unquantized) == "float":
                memory_prep, self.memory_projection = WeightPrep(loaded, precision_of(unquantized)), precision_of(unquantized)
        self.conv1 = (encoder.conv1.weight.detach().to(dtype_e), encoder.conv1.bias.detach().to(dtype_e))
        self.conv2 = (encoder.conv2.weight.detach().to(dtype_e), encoder.conv2.bias.detach().to(dtype_e))
        self.encoder_positions = encoder.embed_positions.weight.detach().to(dtype_e)
        self.encoder_heads = cfg.encoder_attention_heads
        self.encoder_layers = []
        for i, layer in enumerate(encoder.layers):
            sa = layer.self_attn
            self.encoder_layers.append(_EncoderLayer(
                attn_norm=_norm_of(layer.self_attn_layer_norm, dtype_e),
                qkv=encoder_prep.fused(f"encoder.{i}.qkv", [sa.q_proj.weight, sa.k_proj.weight, sa.v_proj.weight],
                                       [sa.q_proj.bias, sa.k_proj.bias, sa.v_proj.bias], invariant=False),
                out=encoder_prep.of(f"encoder.{i}.out", sa.out_proj, invariant=False),
                ffn_norm=_norm_of(layer.final_layer_norm, dtype_e),
                fc1=encoder_prep.of(f"encoder.{i}.fc1", layer.fc1, invariant=False),
                fc2=encoder_prep.of(f"encoder.{i}.fc2", layer.fc2, invariant=False),
            ))
        self.encoder_norm = _norm_of(encoder.layer_norm, dtype_e)
        self.vocab_size = cfg.vocab_size
        self.d_model = cfg.d_model
        self.heads = cfg.decoder_attention_heads
        self.head_dim = cfg.d_model // self.heads
        self.max_len = self.context_limit = cfg.max_target_positions
        self.eps = decoder.layer_norm.eps
        self.positions = decoder.embed_positions.weight.detach().to(dtype)
        self.layers = []
        for i, layer in enumerate(decoder.layers):
            sa, ca = layer.self_attn, layer.encoder_attn
            self.layers.append(_Layer(
                self_norm=_norm_of(layer.self_attn_layer_norm, dtype),
                qkv=prep.fused(f"decoder.{i}.qkv", [sa.q_proj.weight, sa.k_proj.weight, sa.v_proj.weight],
                               [sa.q_proj.bias, sa.k_proj.bias, sa.v_proj.bias]),
                self_out=prep.of(f"decoder.{i}.self_out", sa.out_proj),
                cross_norm=_norm_of(layer.encoder_attn_layer_norm, dtype),
                cross_q=prep.of(f"decoder.{i}.cross_q", ca.q_proj),
                # the encoder memory of one window: always its 1500 rows
                cross_kv=memory_prep.fused(f"decoder.{i}.cross_kv", [ca.k_proj.weight, ca.v_proj.weight],
                                    [ca.k_proj.bias, ca.v_proj.bias], invariant=False),
                cross_out=prep.of(f"decoder.{i}.cross_out", ca.out_proj),
                ffn_norm=_norm_of(layer.final_layer_norm, dtype),
                fc1=prep.of(f"decoder.{i}.fc1", layer.fc1),
                fc2=prep.of(f"decoder.{i}.fc2", layer.fc2),
            ))
        self.final_norm = _norm_of(decoder.layer_norm, dtype)
        self.proj_out = prep.linear("proj_out", hf.proj_out.weight)
        # int8 on the native kernel: the output layer (the whole vocabulary at a step's few rows, a quarter of
        # a step at 8 slots) on 16-bit integer products where those are faster here (:func:`output_kernel`)
        self.output_kernel = output_kernel() if self.proj_out.native else None
        prep.save()
        self._output_weight = hf.proj_out.weight.detach()
        self.memory_len = cfg.max_source_positions
        # int8 on the native kernel keeps float32 activations: the decoder's self- and cross-attention
        # run in C too (engine/native/layer_ops.c), each row and head alone over exactly its positions,
        # and the encoder memory is kept in float16 (half what each step reads; summed in float32).
        self._fused_attention = self.dtype == torch.float32 and all(
            m.native for layer in self.layers for m in (layer.qkv, layer.self_out, layer.cross_q, layer.cross_out))
        self.alignment_heads: dict[int, list[int]] = {}  # layer -> heads, where words are timed
        self.allocate(width)

    def set_alignment_heads(self, heads: list[tuple[int, int]] | None) -> None:
        """The cross-attention heads whose scores word alignment reads (layer, head)."""
        self.alignment_heads = {}
        for layer, head in heads or []:
            self.alignment_heads.setdefault(layer, []).append(head)

    def _allocate(self, width: int, max_len: int) -> None:
        dtype, device, n = attention_dtype(self.precision, self.embed.device), self.embed.device, len(self.layers)
        self.cache = self.cross_k = self.cross_v = None  # release the old memory first
        self.cache = SlotKVCache(n, width, self.heads, max_len, self.head_dim, dtype, device)
        padded = round_up(self.memory_len)  # whole attention blocks; the padding is never attended to
        memory = (n, width, self.heads, padded, self.head_dim)
        kept = torch.float16 if self._fused_attention else memory_dtype(self.precision, torch.device(device))
        self.cross_k = torch.zeros(memory, dtype=kept, device=device)
        self.cross_v = torch.zeros(memory, dtype=kept, device=device)
        self.memory_blocked = (torch.arange(padded, device=device) >= self.memory_len)[None, None, None, :]

    @property
    def cache_bytes(self) -> int:
        return self.cache.nbytes + 2 * self.cross_k.numel() * self.cross_k.element_size()

    def slot_bytes_at(self, length: int) -> int:
        per_position = 2 * len(self.layers) * self.heads * self.head_dim  # keys and values, every layer
        cache = torch.tensor([], dtype=attention_dtype(self.precision, self.embed.device)).element_size()
        return per_position * (cache * round_up(length) + self.cross_k.element_size() * round_up(self.memory_len))

    def _norm(self, x: torch.Tensor, norm: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return F.layer_norm(x, (self.d_model,), norm[0], norm[1], self.eps)

    def encode_in_steps(self, windows: torch.Tensor) -> Iterator[None]:
        """The encoder as a generator that pauses after the convolutions and after each layer, so a
        lane can interleave a joining window's encoding with the running slots' decode steps.
        Returns (as the generator's value) the [n, 1500, d] encoder states of [n, mels, 3000] windows."""
        with torch.inference_mode():
            x = F.gelu(F.conv1d(windows.to(self.encoder_dtype), *self.conv1, padding=1))
            x = F.gelu(F.conv1d(x, *self.conv2, stride=2, padding=1)).transpose(1, 2)  # [n, M, d]
            n, M, d = x.shape
            x = x + self.encoder_positions[:M]  # [n, M, d]: each window its own rows (int8 rounds per window)
        yield
        H, D = self.encoder_heads, d // self.encoder_heads
        for layer in self.encoder_layers:
            with torch.inference_mode():
                qkv = layer.qkv(self._norm(x, layer.attn_norm)).view(n, M, 3, H, D).permute(2, 0, 3, 1, 4)
                attn = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2])  # [n, H, M, D]
                x = x + layer.out(attn.transpose(1, 2).reshape(n, M, d))
                x = x + layer.fc2(F.gelu(layer.fc1(self._norm(x, layer.ffn_norm))))
            yield
        with torch.inference_mode():
            return self._norm(x, self.encoder_norm)

    def encode(self, windows: torch.Tensor) -> torch.Tensor:
        """[n, mels, 3000] log-mel windows -> [n, 1500, d] encoder states, in one go."""
        steps = self.encode_in_steps(windows)
        while True:
            try:
                next(steps)
            except StopIteration as done:
                return done.value

    @torch.inference_mode()
    def set_memory(self, slot: int, encoded: torch.Tensor) -> None:
        """Project one window's encoder states [1500, d] into the slot's cross-attention keys/values."""
        M = encoded.shape[0]
        for i, layer in enumerate(self.layers):
            k, v = layer.cross_kv(encoded).view(M, 2, self.heads, self.head_dim).unbind(1)
            self.cross_k[i, slot, :, :M] = k.transpose(0, 1)
            self.cross_v[i, slot, :, :M] = v.transpose(0, 1)

    @torch.inference_mode()
    def output_embeddings(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.embed, self._output_weight

    def _collect_attention(self, batch: StepBatch, layer: int, q: torch.Tensor) -> None:
        """Raw cross-attention scores (query . key / sqrt(d)) of this layer's alignment heads for the
        rows asked for, appended per group to ``batch.attention``; the decoding itself is untouched."""
        if batch.attention is None:
            batch.attention = [[] for _ in batch.attention_groups]
        heads = self.alignment_heads[layer]
        for parts, (slot, rows) in zip(batch.attention, batch.attention_groups):
            keys = self.cross_k[layer, slot, heads, : self.memory_len].float()  # [h, M, D]
            queries = q[rows][:, heads].float().transpose(0, 1)  # [h, n, D]
            parts.append(torch.matmul(queries, keys.transpose(1, 2)) * self.head_dim ** -0.5)

    def _self_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, i: int, batch: StepBatch) -> torch.Tensor:
        if self._fused_attention:
            return native.attend(q, k, v, self.cache.k[i], self.cache.v[i], batch.row_slots, batch.row_positions,
                                 None, self.head_dim ** -0.5)
        return attend(q, k, v, self.cache, i, batch)

    def _cross_attention(self, q: torch.Tensor, i: int, batch: StepBatch) -> torch.Tensor:
        if self._fused_attention:
            return native.attend_memory(q, self.cross_k[i], self.cross_v[i], batch.row_slots, self.memory_len,
                                        self.head_dim ** -0.5)
        keys, values = self.cross_k[i], self.cross_v[i]
        if keys.dtype == torch.float16:  # kept for the C path, which a test or benchmark turned off after
            keys, values = keys.float(), values.float()
        return attend_fixed(q, keys, values, batch, self.memory_blocked)

    def forward(self, batch: StepBatch, logit_rows: torch.Tensor | None = None, with_hidden: bool = False):
        x = F.embedding(batch.flat(batch.tokens), self.embed).to(self.dtype) + self.positions[batch.row_positions]
        R = x.shape[0]
        for i, layer in enumerate(self.layers):
            q, k, v = layer.qkv(self._norm(x, layer.self_norm)).view(R, 3, self.heads, self.head_dim).unbind(1)
            x = x + layer.self_out(self._self_attention(q, k, v, i, batch))
            q = layer.cross_q(self._norm(x, layer.cross_norm)).view(R, self.heads, self.head_dim)
            if batch.attention_groups is not None and i in self.alignment_heads:
                self._collect_attention(batch, i, q)
            x = x + layer.cross_out(self._cross_attention(q, i, batch))
            x = x + layer.fc2(F.gelu(layer.fc1(self._norm(x, layer.ffn_norm))))
        if batch.attention_groups is not None:  # per group, [alignment heads, rows, memory] in layer order
            batch.attention = [torch.cat(parts) for parts in batch.attention]
        if logit_rows is not None:
            x = x[logit_rows]
        hidden = self._norm(x, self.final_norm)
        if self.output_kernel:
            logits = native.int8_linear(hidden.float().contiguous(), self.proj_out.q, self.proj_out.scale,
                                        self.proj_out.bias, kernel=self.output_kernel)
        else:
            logits = self.proj_out(hidden).float()
        return (logits, hidden) if with_hidden else logits
