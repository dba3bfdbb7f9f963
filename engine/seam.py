"""The one batched decode step every model family goes through.

A step takes S sequences, each in its own cache slot, each with T_s new rows (1 while decoding,
a chunk of the prompt while prefilling, 1 + drafts while verifying), at per-row positions. Linear
layers run on the R = sum(T_s) real rows at once, so one read of the weights serves every
sequence; attention runs per sequence against that slot's KV cache with a per-row causal mask.
A family (Llama, Whisper, ...) writes only its layers and calls :func:`attend` for attention.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class StepBatch:
    slots: torch.Tensor  # [S] cache slot of each sequence
    tokens: torch.Tensor  # [S, T] new token ids, padded on the right
    positions: torch.Tensor  # [S, T] absolute positions of those tokens
    lengths: torch.Tensor  # [S] real rows per sequence (1..T)

    @classmethod
    def build(cls, slots: list[int], rows: list[list[int]], starts: list[int], device="cpu") -> "StepBatch":
        """``rows[s]`` are the new tokens of sequence s, the first at position ``starts[s]``."""
        width = max(len(r) for r in rows)
        tokens = torch.zeros(len(rows), width, dtype=torch.long)
        for s, r in enumerate(rows):
            tokens[s, : len(r)] = torch.tensor(r, dtype=torch.long)
        lengths = torch.tensor([len(r) for r in rows], dtype=torch.long)
        positions = torch.tensor(starts, dtype=torch.long)[:, None] + torch.arange(width)[None, :]
        return cls(torch.tensor(slots, dtype=torch.long).to(device), tokens.to(device), positions.to(device),
                   lengths.to(device))

    @property
    def uniform(self) -> bool:
        return bool((self.lengths == self.tokens.shape[1]).all())

    @property
    def valid(self) -> torch.Tensor:  # [S, T]
        return torch.arange(self.tokens.shape[1], device=self.tokens.device)[None, :] < self.lengths[:, None]

    def flat(self, x: torch.Tensor) -> torch.Tensor:
        """[S, T, ...] -> [R, ...] keeping real rows only."""
        return x.reshape(-1, *x.shape[2:]) if self.uniform else x[self.valid]

    def last_rows(self) -> torch.Tensor:
        """Index in [R] of each sequence's last real row."""
        return torch.cumsum(self.lengths, 0) - 1


class SlotKVCache:
    """Preallocated keys and values: [layers, slots, kv_heads, max_len, head_dim] each."""

    def __init__(self, layers, slots, kv_heads, max_len, head_dim, dtype, device):
        shape = (layers, slots, kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.max_len = max_len

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2


def _slot_view(cache: torch.Tensor, slots: torch.Tensor, length: int) -> torch.Tensor:
    """cache[slots, :, :length] without a copy when the slots are a contiguous run."""
    first = int(slots[0])
    if torch.equal(slots, torch.arange(first, first + slots.numel(), device=slots.device)):
        return cache[first : first + slots.numel(), :, :length]
    return cache[:, :, :length].index_select(0, slots)  # copies only the live part


def _to_padded(rows: torch.Tensor, batch: StepBatch) -> torch.Tensor:
    """[R, H, D] -> [S, H, T, D] (zeros in padding)."""
    S, T = batch.tokens.shape
    if batch.uniform:
        return rows.reshape(S, T, *rows.shape[1:]).transpose(1, 2)
    padded = rows.new_zeros(S, T, *rows.shape[1:])
    padded[batch.valid] = rows
    return padded.transpose(1, 2)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: SlotKVCache, layer: int,
           batch: StepBatch) -> torch.Tensor:
    """Causal self-attention of the new rows over their slot's history.

    q: [R, H, D]; k, v: [R, Hkv, D] for the new rows, written into the cache first.
    Returns [R, H * D].
    """
    row_slots = batch.flat(batch.slots[:, None].expand_as(batch.tokens))
    row_pos = batch.flat(batch.positions)
    cache.k[layer, row_slots, :, row_pos] = k
    cache.v[layer, row_slots, :, row_pos] = v
    kv_len = int(batch.positions.max()) + 1
    keys = _slot_view(cache.k[layer], batch.slots, kv_len)
    values = _slot_view(cache.v[layer], batch.slots, kv_len)
    mask = torch.arange(kv_len, device=q.device)[None, None, :] <= batch.positions[:, :, None]  # [S, T, L]
    out = F.scaled_dot_product_attention(
        _to_padded(q, batch), keys, values, attn_mask=mask[:, None], enable_gqa=keys.shape[1] != q.shape[1]
    )  # [S, H, T, D]
    return batch.flat(out.transpose(1, 2)).flatten(1)


def attend_fixed(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, batch: StepBatch) -> torch.Tensor:
    """Attention of the new rows over a per-slot fixed memory (Whisper's encoder output).

    q: [R, H, D]; keys, values: [slots, H, M, D]. Returns [R, H * D].
    """
    k = _slot_view(keys, batch.slots, keys.shape[2])
    v = _slot_view(values, batch.slots, values.shape[2])
    out = F.scaled_dot_product_attention(_to_padded(q, batch), k, v)
    return batch.flat(out.transpose(1, 2)).flatten(1)


class BatchedDecoder(ABC):
    """A model family's decoder behind the seam: slots, a KV cache, and one batched step."""

    family: str
    vocab_size: int
    max_len: int  # positions per slot (prompt and output together)

    def __init__(self, width: int):
        self.width = width

    @abstractmethod
    def forward(self, batch: StepBatch, logit_rows: torch.Tensor | None = None) -> torch.Tensor:
        """Run one step; return logits [len(logit_rows), vocab] (all real rows when None)."""

    @property
    @abstractmethod
    def cache_bytes(self) -> int:
        """Memory held by this lane's caches, in bytes."""
