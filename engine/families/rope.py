"""Rotary position tables of decoder-only chat models, and how many positions a model handles.

The tables are the loaded transformers model's own (``model.rotary_emb``), computed once for every
position a slot may reach, so every rope variant transformers implements (plain, linear, Llama 3,
YaRN, partial rotary dimensions, a second base for sliding-window layers) comes out as the model
computes it. Two variants change with the sequence's length in transformers:

- ``longrope`` (Phi-3.5, Phi-4-mini) uses its short factors while a sequence fits the original
  context and its long factors, at every position, once it is longer: transformers' Phi-3
  recomputes the whole history with the long factors when a sequence first passes the original
  context. A decoder does the same (engine/families/decoder.py); :func:`longrope_switch` says
  where, and a table holds the short factors' positions, then the long factors' (see
  :func:`rope_table`).
- ``dynamic`` (NTK) rescales with the length: the context stays at ``max_position_embeddings``,
  within which it is the plain table.
"""

from __future__ import annotations

import torch

SINGLE = "default"  # the key of a model's one table (models with one rope for every layer)


def rope_parameters(config, kind: str = SINGLE) -> dict:
    """The rope settings of one kind of layer (``SINGLE`` or a layer type such as 'sliding_attention')."""
    params = getattr(config, "rope_parameters", None) or {}
    if kind != SINGLE and isinstance(params.get(kind), dict):
        return params[kind]
    return params


def context_limit(config, kinds: list[str] = (SINGLE,)) -> int:
    """Positions the model handles: ``max_position_embeddings``, or more where YaRN scaling extends
    the original context by its factor beyond it (Qwen2.5's long-context recipe)."""
    limit = int(config.max_position_embeddings)
    for kind in kinds:
        params = rope_parameters(config, kind)
        if params.get("rope_type") == "yarn" and params.get("factor"):
            original = params.get("original_max_position_embeddings") or limit
            limit = max(limit, int(original * params["factor"]))
    return limit


def longrope_switch(config, kinds: list[str], length: int) -> int | None:
    """The position from which a sequence uses longrope's long factors (the original context), when
    a slot of ``length`` positions can pass it; None when no layer uses longrope or it cannot."""
    for kind in kinds:
        params = rope_parameters(config, kind)
        if params.get("rope_type") == "longrope":
            original = int(params.get("original_max_position_embeddings") or length)
            if length > original:
                return original
    return None


@torch.inference_mode()
def rope_table(model, kind: str, length: int, dtype: torch.dtype,
               switch: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [length, rotary dims] for positions 0 .. length - 1, as ``model`` computes them in
    one call. With a longrope ``switch``: [switch + length, rotary dims], the short factors'
    positions 0 .. switch - 1 first, then the long factors' positions 0 .. length - 1 (a row at
    position p of a sequence past the switch reads row switch + p)."""
    rotary = model.model.rotary_emb
    probe = model.model.embed_tokens.weight[:1][None]  # the dtype and device the model computes them in
    extra = () if kind == SINGLE else (kind,)

    def table(end: int) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = rotary(probe, torch.arange(end, device=probe.device)[None], *extra)
        return cos[0].to(dtype), sin[0].to(dtype)

    if switch is None:
        return table(length)
    (short_cos, short_sin), (long_cos, long_sin) = table(switch), table(length)  # length > switch: long
    return torch.cat([short_cos, long_cos]), torch.cat([short_sin, long_sin])
