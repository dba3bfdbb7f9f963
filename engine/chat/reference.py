"""The exact single-stream chat decoder: chat template, then one token per forward pass.

Greedy output equals transformers ``generate(do_sample=False)`` on the same prompt; this is the
yardstick for the batched engine's chat path.
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from engine.api import ChatAnswer, PromptFitting
from engine.errors import RequestError
from engine.loading import LoadedModel
from engine.picking import TokenPicker
from engine.sampling import SamplingParams
from engine.text_stream import TextStream


def build_messages(prompt: str, system: str | None = None, history: list[dict] | None = None) -> list[dict]:
    messages = [{"role": "system", "content": system}] if system else []
    messages += list(history or [])
    messages.append({"role": "user", "content": prompt})
    return messages


class ChatReference:
    def __init__(self, loaded: LoadedModel):
        self.loaded = loaded
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.device = next(self.model.parameters()).device
        eos = loaded.model.generation_config.eos_token_id
        eos = [eos] if isinstance(eos, int) else list(eos or [])
        if self.tokenizer.eos_token_id is not None:
            eos.append(self.tokenizer.eos_token_id)
        self.stop_ids = set(eos)
        from engine.families.rope import SINGLE, context_limit, longrope_switch

        self.context_length = context_limit(self.model.config)  # YaRN may extend it past max_position_embeddings

        # longrope (Phi-3.5, Phi-4-mini): past the original context transformers' generate recomputes the
        # whole history with the long factors, once; so does this decoder (see engine/families/rope.py)
        self.longrope_switch = longrope_switch(self.model.config, [SINGLE], 1 << 30)

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        for m in messages:
            if not str(m.get("content", "")).strip() and m.get("role") == "user":
                raise RequestError("The message is empty.")
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    @torch.inference_mode()
    def generate(
        self,
        prompt_ids: list[int],
        params: SamplingParams | None = None,
        on_token: Callable[[int, str], None] | None = None,
    ) -> ChatAnswer:
        params = (params or SamplingParams()).validate()
        if len(prompt_ids) >= self.context_length:
            raise RequestError(
                f"The prompt is {len(prompt_ids)} tokens, more than this model's context of {self.context_length}."
            )
        max_new = min(params.max_tokens, self.context_length - len(prompt_ids))
        picker = TokenPicker(params, prompt_ids)
        stream = TextStream(self.tokenizer, params.stop)
        t_start = time.perf_counter()
        out = self.model(input_ids=torch.tensor([prompt_ids], device=self.device), use_cache=True)
        cache, logits = out.cache, out.logits[0, -1]
        tokens: list[int] = []
        stamps: list[float] = []
        finish = "length"
        while len(tokens) < max_new:
            token = picker.pick(logits)
            if token in self.stop_ids:
                finish = "stop"
                break
            picker.observe(token)
            tokens.append(token)
            stamps.append(time.perf_counter())
            piece = stream.push(token)
            if on_token and piece:
                on_token(token, piece)
            if stream.stopped:
                finish = "stop"
                break
            if len(tokens) == max_new:
                break
            if self.longrope_switch is not None and len(prompt_ids) + len(tokens) == self.longrope_switch + 1:
                out = self.model(input_ids=torch.tensor([prompt_ids + tokens], device=self.device), use_cache=True)
            else:
                out = self.model(input_ids=torch.tensor([[token]], device=self.device), cache=cache, use_cache=True)
            cache, logits = out.cache, out.logits[0, -1]
        end = time.perf_counter()
        decode_s = (stamps[-1] - stamps[0]) if len(stamps) > 1 else 0.0
        stats = {
            "prompt_tokens": len(prompt_ids),
            "tokens": len(tokens),
            "seconds": round(end - t_start, 3),
            "time_to_first_token": round(stamps[0] - t_start, 3) if stamps else None,
            "tok_s": round((len(tokens) - 1) / decode_s, 1) if decode_s > 0 else 0.0,
        }
        if on_token and (rest := stream.flush()):
            on_token(tokens[-1], rest)
        text = stream.text if stream.stopped else self.tokenizer.decode(tokens, skip_special_tokens=True)
        return ChatAnswer(text=text, tokens=tokens, finish_reason=finish, stats=stats,
                          fitting=PromptFitting(prompt_tokens=len(prompt_ids)))
