"""What every decoder-only chat family shares: a lean batched forward pass on the seam.

The loaded transformers model's weights are fused per layer into one q/k/v and one gate/up matrix
(or taken fused, where the checkpoint stores them so) and prepared for the backend's kernels in the
chosen precision (engine/kernels.py); rotary tables are computed once (engine/families/rope.py);
attention and the cache are the seam's. No transformers module is called per step. Activations are
kept in the precision's activation dtype (float32, or bfloat16 for the bfloat16 and int8
precisions); the KV cache and attention in engine.kernels.attention_dtype.

A family file subclasses :class:`DecoderOnly` and changes only what differs (hooks below): how a
layer's weights are found, norms stored as ``w - 1`` (Gemma), per-head q/k norms (Qwen3, Gemma 3),
norms after attention and the MLP, which layers see a sliding window or no rotation, the
attention scale, soft-capping, a scaled embedding.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine import native
from engine.kernels import Linear, activation_dtype, attention_dtype
from engine.loading import LoadedModel
from engine.families.rope import SINGLE, context_limit, longrope_switch, rope_table
from engine.seam import ATTENTION_BLOCK, MIN_SLOT_LENGTH, BatchedDecoder, SlotKVCache, StepBatch, attend, round_up
from engine.weights import WeightPrep

FIRST_POSITIONS = 8 * ATTENTION_BLOCK  # cache positions a slot holds at first; more as histories grow
RECOMPUTE_CHUNK = 256  # rows per pass when longrope's long factors recompute a history

ACTIVATIONS = {  # the MLP's activation by its config name (the same functions transformers calls)
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


def activation(name: str):
    if name in ACTIVATIONS:
        return ACTIVATIONS[name]
    from transformers.activations import ACT2FN

    return ACT2FN[name]


def sliding_window(config, i: int) -> int | None:
    """Layer ``i``'s sliding window as transformers applies it: the config's ``sliding_window`` for the
    layers ``layer_types`` marks 'sliding_attention' (Gemma 3, Qwen2/3, SmolLM3), for every layer
    where the config has no layer types (Mistral, Phi-3); None where it has no window."""
    window = getattr(config, "sliding_window", None)
    if not window or not getattr(config, "use_sliding_window", True):
        return None
    kinds = getattr(config, "layer_types", None)
    if kinds:
        return window if kinds[i] == "sliding_attention" else None
    return window


@dataclass
class Layer:
    """One decoder layer, prepared."""

    input_norm: torch.Tensor
    qkv: Linear
    out: Linear
    ffn_norm: torch.Tensor  # before the MLP (Llama's post_attention_layernorm)
    gate_up: Linear
    down: Linear
    qk_norm: torch.Tensor | None = None  # [H + Hkv, D]: per-head RMS norm weights of q and k, before rotation
    attn_out_norm: torch.Tensor | None = None  # on the attention's output, before the residual (Gemma)
    ffn_out_norm: torch.Tensor | None = None  # on the MLP's output, before the residual (Gemma)
    rope: str | None = SINGLE  # which rotary table; None: no rotation (SmolLM3's NoPE layers)
    window: int | None = None  # sliding window (positions a row sees, itself included); None: all


class DecoderOnly(BatchedDecoder):
    """A decoder-only transformer (Llama's layout: pre-norm attention and gated MLP) on the seam."""

    family = "chat"
    architecture = "llama"
    norm_offset = 0.0  # RMS norm weights are stored as w - norm_offset (Gemma: 1)
    windows = False  # whether the config's sliding window applies (see sliding_window)

    def __init__(self, loaded: LoadedModel, width: int = 1, max_len: int | None = None,
                 precision: str = "float32", keep_4bit: bool | None = None):
        hf = self._model = loaded.model
        cfg = self.config = hf.config
        self.precision = precision
        self.vocab_size = cfg.vocab_size
        self.heads = cfg.num_attention_heads
        self.kv_heads = getattr(cfg, "num_key_value_heads", None) or self.heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.heads
        self.hidden = cfg.hidden_size
        self.eps = cfg.rms_norm_eps
        self.embed = hf.model.embed_tokens.weight.detach()
        self.dtype = activation_dtype(precision, self.embed.device)
        self.cache_dtype = attention_dtype(precision, self.embed.device)
        prep = WeightPrep(loaded, precision, keep_4bit)  # (int8: weights that already are 4-bit kept so, or not)
        self.weights_from_cache = prep.from_cache
        self.layers = [self._layer(i, layer, prep) for i, layer in enumerate(hf.model.layers)]
        self.norm = self._norm_weight(hf.model.norm)
        self.lm_head = prep.of("lm_head", hf.lm_head)
        prep.save()
        self._output_weight = hf.lm_head.weight.detach()
        self.embed_scale = self._embed_scale()
        self.scale = self._attention_scale()  # None: 1 / sqrt(head_dim)
        self.softcap, self.final_softcap = self._softcaps()  # (attention scores, logits), None: none
        self.activation = activation(self._activation_name())
        self._rope_kinds = sorted({layer.rope for layer in self.layers if layer.rope is not None})
        self._windows = sorted({layer.window for layer in self.layers if layer.window is not None})
        self.context_limit = context_limit(cfg, self._rope_kinds or [SINGLE])
        self.max_len = min(self.context_limit, max_len or MIN_SLOT_LENGTH)
        self.tables: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self._table_len = 0
        self._switch: int | None = None  # longrope: where a sequence's long factors take over
        self._qk = (self.heads + self.kv_heads) * self.head_dim  # q and k, normed and rotated together
        self._ffn = self.layers[0].down.in_features
        # int8 on the native kernel keeps float32 activations: its residual adds, norms, rotary, SiLU
        # gating and attention (but soft-capped) run fused in C too (engine/native/layer_ops.c), each row alone; the
        # other precisions keep PyTorch's ops.
        self._fused_ops = self.dtype == torch.float32 and all(
            m.native for layer in self.layers for m in (layer.qkv, layer.out, layer.gate_up, layer.down))
        # Where every layer is of the plain Llama layout, the fused path's whole layer loop runs in one C
        # call (the same kernels, the same bits: tests/test_native.py); False runs it here, op by op.
        self.layers_in_c = self._fused_ops and self.softcap is None and self.activation is F.silu and all(
            layer.rope == SINGLE and layer.qk_norm is None and layer.attn_out_norm is None
            and layer.ffn_out_norm is None for layer in self.layers)
        self._c_layers = native.DecoderLayers(self) if self.layers_in_c else None
        self._head_kernels: tuple[str, str] | None = None  # the output layer's (prompt, generated) rows' kernels
        self.allocate(width)

    def use_integer_dot(self, on: bool = True, down: bool = True, bits: int = 8) -> bool:
        """int8 on CPU: run generated tokens' rows through the layers on an integer kernel (activations
        rounded to int8, ``bits`` 8, or int16, 16: faster at a few rows, int8 a little less exact; prompt
        rows keep the float kernel), and the output layer's generated rows on the 16-bit one, or not;
        ``down`` False runs the MLP's down projection on the 16-bit kernel whatever ``bits`` says.
        Whether it now runs so (False where the layer loop is not in C)."""
        running = self._c_layers.integer_dot(on, down, bits) if self._c_layers is not None else False
        self._head_kernels = None
        if running and self.lm_head.native and not os.environ.get("CADENCE_INT8_KERNEL"):
            self._head_kernels = (native.int8_kernel(), "i16dot")
        return running

    # ------------------------------------------------------------------ hooks (a family changes these)
    def _layer(self, i: int, layer, prep: WeightPrep) -> Layer:
        """Layer ``i``'s weights, from transformers' module of the Llama layout."""
        qkv, out = self._attention_weights(i, layer.self_attn, prep)
        gate_up, down = self._mlp_weights(i, layer.mlp, prep)
        return Layer(input_norm=self._norm_weight(layer.input_layernorm), qkv=qkv, out=out,
                     ffn_norm=self._norm_weight(layer.post_attention_layernorm), gate_up=gate_up, down=down,
                     qk_norm=self._qk_norm(layer.self_attn), rope=self._rope_of(i), window=self._window_of(i))

    def _attention_weights(self, i: int, attn, prep: WeightPrep) -> tuple[Linear, Linear]:
        """One q/k/v matrix (biases where the model has them: Qwen2) and the output projection."""
        qkv = prep.fused(f"layers.{i}.qkv", [attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight],
                         [attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias])
        return qkv, prep.of(f"layers.{i}.out", attn.o_proj)

    def _mlp_weights(self, i: int, mlp, prep: WeightPrep) -> tuple[Linear, Linear]:
        gate_up = prep.fused(f"layers.{i}.gate_up", [mlp.gate_proj.weight, mlp.up_proj.weight],
                             [mlp.gate_proj.bias, mlp.up_proj.bias])
        return gate_up, prep.of(f"layers.{i}.down", mlp.down_proj)

    def _qk_norm(self, attn) -> torch.Tensor | None:
        """Per-head q and k norm weights stacked as [H + Hkv, D], where the model has them."""
        q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
        if q_norm is None or k_norm is None:
            return None
        q, k = self._norm_weight(q_norm), self._norm_weight(k_norm)
        return torch.cat([q.expand(self.heads, -1), k.expand(self.kv_heads, -1)]).contiguous()

    def _rope_of(self, i: int) -> str | None:
        """The rotary table layer ``i`` uses (None: it has no rotation)."""
        return SINGLE

    def _window_of(self, i: int) -> int | None:
        """Layer ``i``'s sliding window, or None (it sees the whole history)."""
        return sliding_window(self.config, i) if self.windows else None

    def _embed_scale(self) -> torch.Tensor | None:
        return None

    def _attention_scale(self) -> float | None:
        return None

    def _softcaps(self) -> tuple[float | None, float | None]:
        return None, None

    def _activation_name(self) -> str:
        return self.config.hidden_act

    def _norm_weight(self, norm) -> torch.Tensor:
        weight = norm.weight.detach()
        if self.norm_offset:
            weight = self.norm_offset + weight.float()  # as the model computes it, in float32
        return weight.to(self.dtype)

    # ------------------------------------------------------------------ memory
    def _allocate(self, width: int, max_len: int) -> None:
        self.cache = None  # release the old cache before building the new one
        self.cache = SlotKVCache(len(self.layers), width, self.kv_heads, max_len, self.head_dim,
                                 self.cache_dtype, self.embed.device, initial=FIRST_POSITIONS)
        if max_len > self._table_len:  # rotary tables for every position a slot may reach
            self._switch = longrope_switch(self.config, self._rope_kinds, max_len)
            self.tables = {kind: rope_table(self._model, kind, max_len, self.dtype, self._switch)
                           for kind in self._rope_kinds}
            self._table_len = max_len
        if self._switch is not None:  # what passing the original context takes: each slot's tokens, its factors
            self._history = torch.zeros(width, max_len, dtype=torch.long, device=self.embed.device)
            self._shift = torch.zeros(width, dtype=torch.long, device=self.embed.device)  # switch: long factors

    @property
    def cache_bytes(self) -> int:
        return self.cache.nbytes

    def slot_bytes_at(self, length: int) -> int:
        element = torch.tensor([], dtype=self.cache_dtype).element_size()
        return 2 * len(self.layers) * self.kv_heads * round_up(length) * self.head_dim * element

    @property
    def weight_bytes(self) -> int:
        """Weight bytes one step reads (every layer's matrices and the output layer)."""
        per_layer = sum(m.nbytes for layer in self.layers for m in (layer.qkv, layer.out, layer.gate_up, layer.down))
        return per_layer + self.lm_head.nbytes

    def output_embeddings(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.embed, self._output_weight

    # ------------------------------------------------------------------ the step
    @property
    def _layer_loop_in_c(self) -> bool:
        """Whether a step's layers run as one C call (its layer ops fused, rotary on whole heads)."""
        return self.layers_in_c and self.tables[SINGLE][0].shape[-1] == self.head_dim

    @property
    def _one_c_call(self) -> bool:
        """Whether the embedding and first norm go to C too (float32 embeddings, no scale): the same
        values as the op-by-op way, fewer calls."""
        return (self._layer_loop_in_c and self.embed_scale is None and self.embed.dtype == torch.float32
                and self.embed.is_contiguous())

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), weight, self.eps)

    def _rotate(self, qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotary position embedding (rotate_half, as the model does) on the first cos.shape[-1] dims
        of every head (all of them, unless the model rotates only part: Phi-4-mini)."""
        rot = cos.shape[-1]
        half = rot // 2
        if rot == self.head_dim:
            return qk * cos + torch.cat((-qk[..., half:], qk[..., :half]), dim=-1) * sin
        part = qk[..., :rot]
        turned = torch.cat((-part[..., half:], part[..., :half]), dim=-1)
        return torch.cat((part * cos + turned * sin, qk[..., rot:]), dim=-1)

    def _add_norm(self, x: torch.Tensor, h: torch.Tensor | None, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + h, its RMS norm by ``weight``); h None: (x, x's norm)."""
        if self._fused_ops:
            return native.add_rms_norm(x, h, weight, self.eps)
        if h is not None:
            x = x + h
        return x, self._norm(x, weight)

    def _gated(self, gate_up: torch.Tensor) -> torch.Tensor:
        """activation(gate) * up, the MLP's gate and up halves side by side in each row."""
        if self._fused_ops and self.activation is F.silu:
            return native.silu_mul(gate_up, self._ffn)
        gate, up = gate_up.split(self._ffn, dim=-1)
        return self.activation(gate) * up

    def _qkv(self, layer: Layer, qkv: torch.Tensor, turns: dict) -> tuple[torch.Tensor, ...]:
        """q, k (normed per head where the model does, then rotated) and v, as [R, heads, D] each."""
        R, D = qkv.shape[0], self.head_dim
        qk = qkv[:, : self._qk].view(R, self.heads + self.kv_heads, D)
        if layer.qk_norm is not None:
            qk = F.rms_norm(qk, (D,), None, self.eps) * layer.qk_norm
        if layer.rope is not None and layer.rope not in turns:  # fused: rotated where it lies
            native.rotary(qk.view(R, -1) if qk.is_contiguous() else qkv, self.heads + self.kv_heads,
                          *self.tables[layer.rope], turns["rows"])  # in place: qk is this step's own
        elif layer.rope is not None:
            qk = self._rotate(qk, *turns[layer.rope])
        v = qkv[:, self._qk :].view(R, self.kv_heads, D)
        return qk[:, : self.heads], qk[:, self.heads :], v

    @torch.inference_mode()
    def forward(self, batch: StepBatch, logit_rows: torch.Tensor | None = None, with_hidden: bool = False):
        self.cache.reserve(batch.kv_len)
        if self._switch is None:
            x = self._hidden_states(batch, batch.row_positions)
        else:
            x = self._hidden_states_longrope(batch)
        if logit_rows is not None:
            x = x[logit_rows]
        hidden = self._add_norm(x, None, self.norm)[1]  # (in C where the layer ops are)
        if self._head_kernels is not None and batch.generated is not None:
            generated = batch.generated if logit_rows is None else batch.generated[logit_rows]
            logits = native.int8_linear_by_kind(hidden.float().contiguous(), self.lm_head.q, self.lm_head.scale,
                                                self.lm_head.bias, generated.contiguous(), self._head_kernels,
                                                self.lm_head.minimum)
        else:
            logits = self.lm_head(hidden).float()
        if self.final_softcap is not None:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return (logits, hidden) if with_hidden else logits

    def _hidden_states(self, batch: StepBatch, table_rows: torch.Tensor) -> torch.Tensor:
        """Every layer over the step's rows: [R, d] before the final norm. ``table_rows``: each row's
        row in the rotary tables (its position, unless longrope's long factors apply)."""
        if self._one_c_call:  # the embedding and first norm, then every layer, in two C calls
            x, normed = native.embed_norm(batch.flat(batch.tokens), self.embed, self.layers[0].input_norm, self.eps)
            return self._c_layers(self, x, normed, batch, table_rows.contiguous())
        x = F.embedding(batch.flat(batch.tokens), self.embed)  # [R, d]
        if self.embed_scale is not None:
            x = x * self.embed_scale
        x = x.to(self.dtype)
        # each rotary table's (cos, sin) at the rows' positions; the fused rotary (whole heads) reads
        # the tables itself, at "rows"
        turns = {"rows": table_rows.contiguous() if self._fused_ops else None}
        for kind, (cos, sin) in self.tables.items():
            if turns["rows"] is None or cos.shape[-1] != self.head_dim:
                turns[kind] = (cos[table_rows][:, None, :], sin[table_rows][:, None, :])
        x, normed = self._add_norm(x, None, self.layers[0].input_norm)
        if self._layer_loop_in_c:  # (layers in C implies fused ops, so turns["rows"] is set)
            return self._c_layers(self, x, normed, batch, turns["rows"])
        masks = {None: batch.blocked}
        for window in self._windows:
            masks[window] = batch.window_blocked(window)
        for i, layer in enumerate(self.layers):
            q, k, v = self._qkv(layer, layer.qkv(normed), turns)
            if self._fused_ops and self.softcap is None:
                    a = native.attend(q, k, v, self.cache.k[i], self.cache.v[i], batch.row_slots, batch.row_positions,
                                  layer.window, self.scale or self.head_dim ** -0.5)
            else:
                a = attend(q, k, v, self.cache, i, batch, masks[layer.window], self.scale, self.softcap)
            h = layer.out(a)
            if layer.attn_out_norm is not None:
                h = self._norm(h, layer.attn_out_norm)
            x, normed = self._add_norm(x, h, layer.ffn_norm)
            h = layer.down(self._gated(layer.gate_up(normed)))
            if layer.ffn_out_norm is not None:
                h = self._norm(h, layer.ffn_out_norm)
            if i + 1 < len(self.layers):  # the next layer's input norm with this residual add
                x, normed = self._add_norm(x, h, self.layers[i + 1].input_norm)
            else:
                x = x + h
        return x

    # ------------------------------------------------------------------ longrope past the original context
    def _hidden_states_longrope(self, batch: StepBatch) -> torch.Tensor:
        """As transformers' Phi-3: a sequence uses the short factors while it fits the original context
        and the long ones at every position once it is longer, its whole history recomputed with them
        when it first passes (a prompt longer than the original context: long throughout)."""
        self._history[batch.row_slots, batch.row_positions] = batch.flat(batch.tokens)
        starts = batch.positions[:, 0]
        self._shift[batch.slots[starts == 0]] = 0  # a sequence new in its slot starts with the short factors
        passing = (self._shift[batch.slots] == 0) & (starts + batch.lengths - 1 >= self._switch)
        if not bool(passing.any()):
            return self._hidden_states(batch, batch.row_positions + self._shift[batch.row_slots])
        return self._pass_original_context(batch, passing.tolist())

    def _pass_original_context(self, batch: StepBatch, passing: list[bool]) -> torch.Tensor:
        """The step in three parts: rows before the switch as they are; the passing sequences' history
        recomputed with the long factors (the cache rewritten); their rows from the switch on."""
        slots, starts, counts = batch.slots.tolist(), batch.positions[:, 0].tolist(), batch.lengths.tolist()
        tokens, switch = batch.tokens.tolist(), self._switch
        offsets = [sum(counts[:i]) for i in range(len(counts))]
        out: list[tuple[list[int], torch.Tensor]] = []  # (rows of the step, their hidden states)

        def run(parts: list[tuple[int, int, int]]) -> None:  # (sequence, first row, end row) of the step
            parts = [(i, lo, hi) for i, lo, hi in parts if hi > lo]
            if parts:
                out.append(([offsets[i] + r for i, lo, hi in parts for r in range(lo, hi)], self._run_rows(
                    [slots[i] for i, _, _ in parts], [tokens[i][lo:hi] for i, lo, hi in parts],
                    [starts[i] + lo for i, lo, _ in parts])))

        run([(i, 0, max(0, min(n, switch - a)) if p else n) for i, (a, n, p) in enumerate(zip(starts, counts, passing))])
        crossing = [i for i, p in enumerate(passing) if p]
        self._shift[torch.tensor([slots[i] for i in crossing], device=self._shift.device)] = switch
        history = self._history[[slots[i] for i in crossing], :switch].tolist()
        for lo in range(0, switch, RECOMPUTE_CHUNK):  # the cache, recomputed (in chunks: attention's memory)
            hi = min(lo + RECOMPUTE_CHUNK, switch)
            self._run_rows([slots[i] for i in crossing], [h[lo:hi] for h in history], [lo] * len(crossing))
        run([(i, max(0, switch - starts[i]), counts[i]) for i in crossing])
        x = torch.empty(batch.row_positions.numel(), self.hidden, dtype=out[0][1].dtype, device=out[0][1].device)
        for rows, hidden in out:
            x[torch.tensor(rows, device=x.device)] = hidden
        return x

    def _run_rows(self, slots: list[int], rows: list[list[int]], starts: list[int]) -> torch.Tensor:
        sub = StepBatch.build(slots, rows, starts, device=self.embed.device)
        return self._hidden_states(sub, sub.row_positions + self._shift[sub.row_slots])
