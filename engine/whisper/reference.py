"""The exact single-stream Whisper decoder: greedy, one 30-second window at a time.

This is the yardstick: small and obvious, built on transformers' Whisper modules, and equal token
for token to faster-whisper (beam_size=1, temperature=0, with or without timestamps) on the same weights.
Faster paths elsewhere in the engine are tested against it.
"""

from __future__ import annotations

import numpy as np
import torch

from engine.loading import LoadedModel
from engine.transcript import WindowResult
from engine.whisper.timestamps import TimestampRules

MAX_LENGTH = 448  # decoder positions, prompt included


class WhisperReference:
    def __init__(self, loaded: LoadedModel):
        self.loaded = loaded
        self.model = loaded.model
        self.tok = loaded.tokenizer
        self.device = next(self.model.parameters()).device
        self.dtype = next(self.model.parameters()).dtype
        self.suppress = torch.tensor(self.tok.suppressed_tokens(), dtype=torch.long)
        self.begin_suppress = torch.tensor(self.tok.begin_suppress, dtype=torch.long)

    @torch.inference_mode()
    def encode(self, window: np.ndarray) -> torch.Tensor:
        feats = torch.from_numpy(window)[None].to(self.device, self.dtype)
        return self.model.model.encoder(input_features=feats).last_hidden_state

    def _logits(self, ids: list[int], encoded: torch.Tensor, cache=None):
        out = self.model.model.decoder(
            input_ids=torch.tensor([ids], device=self.device),
            encoder_hidden_states=encoded,
            cache=cache,
            use_cache=True,
        )
        return self.model.proj_out(out.last_hidden_state)[0].float(), out.cache

    def timestamp_rules(self, prompt: list[int]) -> TimestampRules | None:
        """The time-token rules when ``prompt`` asks for timestamps (it does not end in <|notimestamps|>)."""
        return None if prompt[-1] == self.tok.no_timestamps else TimestampRules.of(self.tok)

    def no_speech_probability(self, sot_logits: torch.Tensor) -> float:
        """P(no speech) from the logits at the start-of-transcript row."""
        return float(torch.softmax(sot_logits.float(), -1)[self.tok.no_speech])

    @torch.inference_mode()
    def detect_language(self, encoded: torch.Tensor) -> tuple[str, float]:
        logits, _ = self._logits([self.tok.sot], encoded)
        codes = list(self.tok.languages)
        ids = torch.tensor([self.tok.languages[c] for c in codes])
        probs = torch.softmax(logits[-1, ids], dim=-1)
        best = int(torch.argmax(probs))
        return codes[best], float(probs[best])

    @torch.inference_mode()
    def decode(self, encoded: torch.Tensor, prompt: list[int], max_length: int = MAX_LENGTH) -> WindowResult:
        logits, cache = self._logits(prompt, encoded)
        no_speech_prob = self.no_speech_probability(logits[prompt.index(self.tok.sot)])
        step = logits[-1]
        tokens: list[int] = []
        probs: list[float] = []
        logprob_sum = 0.0
        rules = self.timestamp_rules(prompt)
        while len(prompt) + len(tokens) < max_length:
            step = step.clone()
            step[self.suppress] = -float("inf")
            if not tokens:
                step[self.begin_suppress] = -float("inf")
            if rules is not None:
                rules.apply(step, tokens)
            token = int(torch.argmax(step))
            logprob = float(torch.log_softmax(step, -1)[token])
            logprob_sum += logprob
            if token == self.tok.eot:
                break
            tokens.append(token)
            probs.append(float(np.exp(logprob)))
            logits, cache = self._logits([token], encoded, cache)
            step = logits[-1]
        return WindowResult(tokens, no_speech_prob, logprob_sum / (len(tokens) + 1), token_probs=probs)

    @torch.inference_mode()
    def alignment_scores(self, encoded: torch.Tensor, prompt: list[int], heads: list[tuple[int, int]]) -> np.ndarray:
        """Raw cross-attention scores (query . key / sqrt(d)) of the alignment ``heads`` for every row of
        ``prompt`` read in one pass: [heads, rows, frames]. The queries are caught on their way out of
        each layer's projection; the keys are the layer's projection of the encoder states."""
        layers = self.model.model.decoder.layers
        queries: dict[int, torch.Tensor] = {}
        hooks = [layers[i].encoder_attn.q_proj.register_forward_hook(
            lambda _m, _inp, out, i=i: queries.__setitem__(i, out[0])) for i in sorted({layer for layer, _ in heads})]
        try:
            self._logits(prompt, encoded)
        finally:
            for hook in hooks:
                hook.remove()
        cfg = self.model.config
        n, d = cfg.decoder_attention_heads, cfg.d_model // cfg.decoder_attention_heads
        out = []
        for layer, head in heads:
            keys = layers[layer].encoder_attn.k_proj(encoded[0]).view(-1, n, d)[:, head].float()
            q = queries[layer].view(-1, n, d)[:, head].float()
            out.append((q @ keys.T) * d ** -0.5)
        return torch.stack(out).numpy()
