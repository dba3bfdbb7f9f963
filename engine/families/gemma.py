"""Gemma 3 text models (``gemma3_text``: Gemma 3 270M, 1B) and Gemma 2 (``gemma2``) on the batched seam.

What differs from Llama: the embedding is scaled by sqrt(hidden); RMS norms multiply by (1 + w);
norms after attention and after the MLP too (four per layer); sliding-window layers alternating with
full ones; queries scaled by ``query_pre_attn_scalar`` ** -0.5; GELU (tanh) MLP; logits soft-capped
where the config says. Gemma 3 adds per-head q/k norms and a rope base of its own for the
sliding-window layers (``rope_local_base_freq``); Gemma 2 soft-caps attention scores too (transformers'
Gemma 3 ignores ``attn_logit_softcapping``, and so does this).
"""

from __future__ import annotations

from engine.errors import ModelError
from engine.families.decoder import DecoderOnly, Layer
from engine.families.rope import SINGLE


class Gemma3Batched(DecoderOnly):
    architecture = "gemma3_text"
    norm_offset = 1.0
    windows = True

    def __init__(self, loaded, *args, **kwargs):
        if getattr(loaded.model.config, "use_bidirectional_attention", False):
            raise ModelError(f"{loaded.source.name} attends both ways (an embedding model), so it cannot chat.")
        super().__init__(loaded, *args, **kwargs)

    def _layer(self, i: int, layer, prep) -> Layer:
        qkv, out = self._attention_weights(i, layer.self_attn, prep)
        gate_up, down = self._mlp_weights(i, layer.mlp, prep)
        return Layer(input_norm=self._norm_weight(layer.input_layernorm), qkv=qkv, out=out,
                     attn_out_norm=self._norm_weight(layer.post_attention_layernorm),
                     ffn_norm=self._norm_weight(layer.pre_feedforward_layernorm), gate_up=gate_up, down=down,
                     ffn_out_norm=self._norm_weight(layer.post_feedforward_layernorm),
                     qk_norm=self._qk_norm(layer.self_attn), rope=self._rope_of(i), window=self._window_of(i))

    def _rope_of(self, i: int) -> str:
        return self.config.layer_types[i]  # 'sliding_attention' and 'full_attention' rotate differently

    def _embed_scale(self):
        scale = self._model.model.embed_tokens.embed_scale  # the model's own factor
        return scale.to(self.embed.dtype)

    def _attention_scale(self) -> float:
        return self.config.query_pre_attn_scalar ** -0.5

    def _softcaps(self):
        return None, self.config.final_logit_softcapping

    def _activation_name(self) -> str:
        return self.config.hidden_activation


class Gemma2Batched(Gemma3Batched):
    architecture = "gemma2"

    def _rope_of(self, i: int) -> str:
        return SINGLE  # one rope for every layer

    def _softcaps(self):
        return self.config.attn_logit_softcapping, self.config.final_logit_softcapping
