"""Writing a draft head's file: safetensors weights and metadata (shared by every head design)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from engine.errors import CadenceError

FORMAT = "cadence-mtp"
FORMAT_VERSION = 1


def save_head(head, params: tuple[str, ...], path: str | Path, dtype: torch.dtype = torch.float16) -> Path:
    """Write a head as safetensors (weights in ``dtype``; metadata: model, sizes, config, recipe, acceptance)."""
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {name: getattr(head, name).detach().to("cpu", dtype).contiguous() for name in params}
    tensors["vocab_ids"] = head.vocab_ids.detach().cpu().contiguous()
    tensors["temperature"] = head.temperature.detach().to("cpu", torch.float32).contiguous()
    metadata = {"format": FORMAT, "format_version": str(FORMAT_VERSION), "model": head.model,
                "hidden": str(head.hidden), "vocab_size": str(head.vocab_size), "config": json.dumps(head.config())}
    metadata.update({k: v if isinstance(v, str) else json.dumps(v) for k, v in head.meta.items()})
    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp), metadata=metadata)
    tmp.chmod(0o644)  # a file to ship and share, whatever mode the writer chose
    tmp.replace(path)
    return path


def attach_matrices(head, embed: torch.Tensor, lm_head: torch.Tensor) -> None:
    """Give a head the model's frozen token embedding and output matrix [V, d] (checked against the
    head's sizes; the head moves to their device and dtype) and its draft-vocabulary output rows."""
    for what, m in (("token embedding", embed), ("output matrix", lm_head)):
        if tuple(m.shape) != (head.vocab_size, head.hidden):
            raise CadenceError(f"The draft head for {head.model} expects a {what} of {head.vocab_size} x "
                               f"{head.hidden}, but this model's is {' x '.join(map(str, m.shape))}.")
    embed, lm_head = embed.detach(), lm_head.detach()
    if head.norm_h.device != embed.device or head.norm_h.dtype != embed.dtype:
        head.to(embed.device, embed.dtype)
        head.vocab_ids = head.vocab_ids.to(embed.device)
    head.embed = embed
    head.out_rows = lm_head[head.vocab_ids].contiguous()
    head._fast = None
