"""The one batched decode step every model family goes through.

A step takes S sequences, each in its own cache slot, each with T_s new rows (1 while decoding,
a chunk of the prompt while prefilling, 1 + drafts while verifying), at per-row positions. Linear
layers run on the R = sum(T_s) real rows at once, so one read of the weights serves every
sequence; attention runs per sequence against that slot's KV cache with a per-row causal mask.
A family (Llama, Whisper, ...) writes only its layers and calls :func:`attend` for attention.

Attention gives a row the same result whatever shares its step: how many slots, how many rows
each (a prompt chunk, drafts being checked) or the longest history among them. PyTorch's fused
attention kernel changes its summation order with all three on some CPUs (measured: the same row
differs in its last bits), which would let batching change the tokens; :func:`attention_way`
measures which formulation keeps rows independent on this machine. Histories are padded to whole
blocks of :data:`ATTENTION_BLOCK` positions, masked positions weighing exactly 0.
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


ATTENTION_BLOCK = 64  # keys summed per partial product (whole blocks, whatever the history's length)
MIN_SLOT_LENGTH = 2048  # positions a slot is given at least (fewer only where the model handles fewer)


def round_up(n: int, block: int = ATTENTION_BLOCK) -> int:
    """``n`` rounded up to whole attention blocks."""
    return -(-n // block) * block


@dataclass
class StepBatch:
    """One step's rows. Everything attention needs per layer is computed once, here."""

    slots: torch.Tensor  # [S] cache slot of each sequence
    tokens: torch.Tensor  # [S, T] new token ids, padded on the right
    positions: torch.Tensor  # [S, T] absolute positions of those tokens
    lengths: torch.Tensor  # [S] real rows per sequence (1..T)
    valid: torch.Tensor  # [S, T] True for real rows
    uniform: bool  # every sequence has T real rows (no padding)
    first_slot: int | None  # the slots are first_slot, first_slot + 1, ... (a view, no gather)
    row_slots: torch.Tensor  # [R] slot of each real row
    row_positions: torch.Tensor  # [R] position of each real row
    kv_len: int  # cache positions any row attends to, rounded up to a whole attention block
    _windowed: dict = field(default_factory=dict)  # window -> its mask, made once per step; None: blocked
    # Rows whose cross-attention scores a family collects (Whisper's word alignment), as (slot, rows in R)
    # groups; None on the ordinary path, which then does nothing extra. The family fills ``attention``.
    attention_groups: list[tuple[int, torch.Tensor]] | None = None
    attention: list[torch.Tensor] | None = None
    # [R] uint8, 1 for rows of generated tokens (at or past their sequence's prompt length), 0 for prompt
    # rows; None where the builder did not say (all read as prompt rows). A family may run the two kinds
    # with different kernels (engine.native.int8_kernels): a row's kind is its own, never its batch's.
    generated: torch.Tensor | None = None

    @classmethod
    def build(cls, slots: list[int], rows: list[list[int]], starts: list[int], device="cpu",
              prompt_lengths: list[int] | None = None) -> "StepBatch":
        """``rows[s]`` are the new tokens of sequence s, the first at position ``starts[s]``; its rows at
        positions from ``prompt_lengths[s]`` on are generated tokens (see :attr:`generated`).
        Built from Python lists, a tensor per field (a decode step's batch is small, and each tensor
        operation costs microseconds); the attention mask is made when first asked for."""
        counts = [len(r) for r in rows]
        width = max(counts)
        uniform = min(counts) == width
        spans = [range(start, start + width) for start in starts]
        real = [(s, p) for slot, span, n in zip(slots, spans, counts) for s, p in zip([slot] * n, span[:n])]
        generated = None
        if prompt_lengths is not None:
            generated = torch.tensor([p >= length for span, n, length in zip(spans, counts, prompt_lengths)
                                      for p in span[:n]], dtype=torch.uint8, device=device)
        return cls(
            slots=torch.tensor(slots, dtype=torch.long, device=device),
            tokens=torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=torch.long, device=device),
            positions=torch.tensor([list(span) for span in spans], dtype=torch.long, device=device),
            lengths=torch.tensor(counts, dtype=torch.long, device=device),
            valid=torch.tensor([[j < n for j in range(width)] for n in counts], device=device),
            uniform=uniform,
            first_slot=slots[0] if slots == list(range(slots[0], slots[0] + len(slots))) else None,
            row_slots=torch.tensor([s for s, _ in real], dtype=torch.long, device=device),
            row_positions=torch.tensor([p for _, p in real], dtype=torch.long, device=device),
            kv_len=round_up(max(start + n for start, n in zip(starts, counts))),
            generated=generated,
        )

    @property
    def blocked(self) -> torch.Tensor:
        """[S, 1, T, kv_len] True where a row may not attend (later positions); made once, when first
        asked for (the fused C layers never ask)."""
        mask = self._windowed.get(None)
        if mask is None:
            keys = torch.arange(self.kv_len, device=self.positions.device)
            mask = self._windowed[None] = (keys[None, None, :] > self.positions[:, :, None])[:, None]
        return mask

    def window_blocked(self, window: int) -> torch.Tensor:
        """:attr:`blocked` for a sliding-window layer: also every position ``window`` or more behind the
        row (a row at position p sees p - window + 1 .. p). Made once per step for each window size."""
        mask = self._windowed.get(window)
        if mask is None:
            keys = torch.arange(self.kv_len, device=self.positions.device)
            far = keys[None, None, :] <= self.positions[:, :, None] - window  # [S, T, kv_len]
            mask = self._windowed[window] = self.blocked | far[:, None]
        return mask

    def flat(self, x: torch.Tensor) -> torch.Tensor:
        """[S, T, ...] -> [R, ...] keeping real rows only."""
        return x.reshape(-1, *x.shape[2:]) if self.uniform else x[self.valid]

    def last_rows(self) -> torch.Tensor:
        """Index in [R] of each sequence's last real row."""
        return torch.cumsum(self.lengths, 0) - 1


class SlotKVCache:
    """Keys and values per layer: [slots, kv_heads, positions, head_dim] each, for up to ``max_len``
    positions per slot. Memory for positions is taken as histories grow (:meth:`reserve`, doubling,
    layer by layer, so growing never holds much more than the grown cache), from ``initial``
    positions (all of ``max_len`` when None): a long context costs memory only when it is used."""

    def __init__(self, layers, slots, kv_heads, max_len, head_dim, dtype, device, initial: int | None = None):
        self.limit = round_up(max_len)  # whole attention blocks
        positions = self.limit if initial is None else min(self.limit, round_up(max(initial, 1)))
        shape = (slots, kv_heads, positions, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.max_len = max_len
        self.device = torch.device(device)

    @property
    def positions(self) -> int:
        """Positions per slot held in memory now."""
        return self.k[0].shape[2]

    def reserve(self, length: int) -> None:
        """Hold at least ``length`` positions per slot (a step's kv_len; at most the limit)."""
        if length > self.k[0].shape[2]:
            self._grow(length)

    def _grow(self, length: int) -> None:
        if length > self.limit:
            raise ValueError(f"{length} positions asked of a cache of {self.max_len}")
        held = self.k[0].shape[2]
        positions = min(self.limit, max(round_up(length), 2 * held))
        for tensors in (self.k, self.v):
            for i, old in enumerate(tensors):
                new = old.new_zeros(*old.shape[:2], positions, old.shape[3])
                new[:, :, :held] = old
                tensors[i] = new  # the old layer is freed here

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)


def _slot_view(cache: torch.Tensor, batch: StepBatch, length: int) -> torch.Tensor:
    """cache[batch.slots, :, :length], without a copy when the slots are a contiguous run."""
    if batch.first_slot is not None:
        return cache[batch.first_slot : batch.first_slot + batch.slots.numel(), :, :length]
    return cache[:, :, :length].index_select(0, batch.slots)  # copies only the live part


def _to_padded(rows: torch.Tensor, batch: StepBatch) -> torch.Tensor:
    """[R, H, D] -> [S, H, T, D] (zeros in padding)."""
    S, T = batch.tokens.shape
    if batch.uniform:
        return rows.reshape(S, T, *rows.shape[1:]).transpose(1, 2)
    padded = rows.new_zeros(S, T, *rows.shape[1:])
    padded[batch.valid] = rows
    return padded.transpose(1, 2)


def _scores(q: torch.Tensor, keys: torch.Tensor, scale: float | None, softcap: float | None,
            pad: int = 1) -> torch.Tensor:
    """q . keys * scale ([S, Hkv, G * T rounded up to a multiple of ``pad``, L]; rows past G * T are
    zero queries), soft-capped (cap * tanh(x / cap)) where the model does."""
    S, H, T, D = q.shape
    Hkv = keys.shape[1]
    rows = q.reshape(S, Hkv, H // Hkv * T, D)
    if rows.shape[2] % pad:  # every product then has a row count its library sums alike for every row
        rows = torch.cat([rows, rows.new_zeros(S, Hkv, pad - rows.shape[2] % pad, D)], dim=2)
    scores = torch.matmul(rows, keys.transpose(-1, -2)).mul_(D ** -0.5 if scale is None else scale)
    if softcap is not None:
        scores = torch.tanh(scores.div_(softcap)).mul_(softcap)
    return scores


def _masked_weights(q: torch.Tensor, keys: torch.Tensor, blocked: torch.Tensor | None, scale: float | None,
                    softcap: float | None, pad: int) -> torch.Tensor:
    """softmax over the history of each row's scores, masked positions weighing 0: [S, Hkv, rows, L]
    (the padding rows' weights are computed too, and ignored)."""
    S, H, T, _ = q.shape
    Hkv, L = keys.shape[1], keys.shape[2]
    scores = _scores(q, keys, scale, softcap, pad)
    if blocked is not None:
        scores[:, :, : H // Hkv * T].view(S, Hkv, H // Hkv, T, L).masked_fill_(blocked[:, :, None], float("-inf"))
    return torch.softmax(scores, dim=-1)


def _plain(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, blocked: torch.Tensor | None,
           scale: float | None = None, softcap: float | None = None, pad: int = 1) -> torch.Tensor:
    """Attention as two matrix products and a softmax over the padded history (masked positions weigh 0).
    ``pad``: the products' rows (G * T per slot and key head) rounded up to a multiple of it."""
    S, H, T, D = q.shape
    Hkv = keys.shape[1]
    out = torch.matmul(_masked_weights(q, keys, blocked, scale, softcap, pad), values)
    return out[:, :, : H // Hkv * T].reshape(S, H, T, D)


def _blocked(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, blocked: torch.Tensor | None,
             scale: float | None = None, softcap: float | None = None, pad: int = 1) -> torch.Tensor:
    """As :func:`_plain`, but the products with the values summed block by block, each a fixed-size
    matrix product (for a library whose summation order follows the history's length)."""
    S, H, T, D = q.shape
    Hkv, L = keys.shape[1], keys.shape[2]
    blocks = L // ATTENTION_BLOCK
    weights = _masked_weights(q, keys, blocked, scale, softcap, pad)
    rows = weights.shape[2]
    weights = weights.view(S, Hkv, rows, blocks, ATTENTION_BLOCK).transpose(2, 3)
    parts = torch.matmul(weights, values.view(S, Hkv, blocks, ATTENTION_BLOCK, D))  # [S, Hkv, blocks, rows, D]
    out = parts.sum(dim=2)  # in order: a shorter history's extra blocks add exact zeros
    return out[:, :, : H // Hkv * T].reshape(S, H, T, D)


def _fused(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, blocked: torch.Tensor | None,
           scale: float | None = None, softcap: float | None = None) -> torch.Tensor:
    """PyTorch's fused attention kernel (it has no soft-capping: :func:`attention` never sends it any)."""
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=None if blocked is None else ~blocked,
                                          enable_gqa=keys.shape[1] != q.shape[1], scale=scale)


def _row_by_row(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, blocked: torch.Tensor | None,
                scale: float | None = None, softcap: float | None = None,
                lengths: torch.Tensor | None = None) -> torch.Tensor:
    """As :func:`_plain`, one new row of every slot at a time: every product has the same rows (one per
    query head of a key head) whatever the step holds, so nothing is padded. A decode step reads the
    keys once. ``lengths``: each slot's new rows (the rest of ``q`` is padding); a later row's pass
    then reads only the keys of the slots that have one (each slot's own, where they are few: a
    prompt joining beside decoding slots costs its own memory's passes, not every slot's)."""
    S, T = q.shape[0], q.shape[2]

    def rows(t: int, slots: slice = slice(None)) -> torch.Tensor:
        mask = blocked if blocked is None or blocked.shape[2] == 1 else blocked[:, :, t : t + 1]
        if mask is not None and mask.shape[0] > 1:
            mask = mask[slots]
        return _plain(q[slots, :, t : t + 1], keys[slots], values[slots], mask, scale, softcap)

    if T == 1:
        return rows(0)
    counts = lengths.tolist() if lengths is not None else [T] * S
    out = None
    for t in range(T):
        live = [i for i, n in enumerate(counts) if n > t]
        if len(live) > S // 2:
            part = rows(t)
            out = part.new_zeros(*part.shape[:2], T, part.shape[3]) if out is None else out
            out[:, :, t : t + 1] = part
        else:
            for i in live:
                part = rows(t, slice(i, i + 1))
                out = part.new_zeros(S, part.shape[1], T, part.shape[3]) if out is None else out
                out[i : i + 1, :, t : t + 1] = part
    return out


ATTENTION_ROWS = (4, 8, 16)  # row multiples tried when a product's row count changes its sums (cheapest first)
_WAYS = {"plain": _plain, "blocked": _blocked, "fused": _fused, "row-by-row": _row_by_row}
for _rows in ATTENTION_ROWS:
    _WAYS[f"plain/{_rows}"] = functools.partial(_plain, pad=_rows)
    _WAYS[f"blocked/{_rows}"] = functools.partial(_blocked, pad=_rows)
_ATTENTION_WAY: dict[tuple, str] = {}  # (device type, dtype, fixed) -> the way this machine keeps rows independent


@torch.inference_mode()
def attention_way(device: torch.device, dtype: torch.dtype, fixed_memory: bool = False) -> str:
    """The cheapest way to compute attention on this machine that gives a row the same result whatever
    shares its step (how many slots, how many rows each, the longest history among them): measured
    once per process on random data at several batch shapes, like the matrix products' row rule.
    PyTorch's fused kernel changes its summation order with all three on some CPUs; some BLAS
    libraries sum a matrix product's row differently by how many rows it has (an AMD EPYC's: 1 row
    against 2-3 against 4 and more), which padding the rows to a multiple of 4-16 settles. Fused is
    kept only where nothing else holds (and on GPUs, which are not checked here). ``fixed_memory``:
    for keys whose length never changes (Whisper's encoder memory), so only the rows and slots that
    share a step are varied: a dtype whose sums follow the history's length may still hold there."""
    key = (device.type, dtype, fixed_memory)
    if key in _ATTENTION_WAY:
        return _ATTENTION_WAY[key]
    if device.type != "cpu":
        _ATTENTION_WAY[key] = "fused"
        return "fused"
    g = torch.Generator().manual_seed(0)
    H, D, T, S = 6, 64, 5, 9
    longest = 4 * ATTENTION_BLOCK
    q = torch.randn(S, H, T, D, generator=g).to(dtype)
    # grouped heads (3 query heads a key head: a product has 3 rows a step row) and one key head per
    # query head (Whisper's: one row, where a BLAS may take another path, as it did on an Intel Xeon)
    kvs = [tuple(torch.randn(S, Hkv, longest, D, generator=g).to(dtype) for _ in range(2)) for Hkv in (2, H)]
    ends = torch.randint(T, ATTENTION_BLOCK + T, (S,), generator=g)
    blocked = ~(torch.arange(longest)[None, None, :] <= (ends[:, None] - T + torch.arange(T)[None, :])[:, :, None])[:, None]
    chosen = "fused"
    short = longest if fixed_memory else ATTENTION_BLOCK * 2
    if fixed_memory:  # every row sees the whole memory but its padding (the last positions)
        blocked = (torch.arange(longest) >= longest - 5)[None, None, None, :].expand(S, 1, T, longest)
    # cheapest first; row by row only over a fixed memory (a history grows with every row anyway)
    for way in [w for w in _WAYS if w != "fused" and (fixed_memory or w != "row-by-row")]:
        fn = _WAYS[way]

        def holds(k: torch.Tensor, v: torch.Tensor) -> bool:
            alone = [fn(q[i : i + 1, :, j : j + 1], k[i : i + 1, :, :short], v[i : i + 1, :, :short],
                        blocked[i : i + 1, :, j : j + 1, :short]) for i, j in ((0, 0), (S - 1, T - 1))]
            return all(torch.equal(out[:1, :, :1], alone[0]) and (s < S or t < T or torch.equal(out[-1:, :, -1:], alone[1]))
                       for s in (1, 2, S) for t in (1, 2, T) for n in sorted({short, longest})
                       for out in [fn(q[:s, :, :t], k[:s, :, :n], v[:s, :, :n], blocked[:s, :, :t, :n])])

        if all(holds(k, v) for k, v in kvs):
            chosen = way
            break
    _ATTENTION_WAY[key] = chosen
    return chosen


def attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, blocked: torch.Tensor | None,
              scale: float | None = None, softcap: float | None = None, fixed_memory: bool = False,
              lengths: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(q . keys * scale) . values for every slot: q [S, H, T, D]; keys, values [S, Hkv, L, D]
    (Hkv divides H: query head h reads key head h // (H / Hkv)); blocked [S, 1, T, L] True where a row
    may not attend, or None (it may attend everywhere); scale 1 / sqrt(D) unless given; ``softcap``:
    scores become cap * tanh(score / cap) before the mask (Gemma). Returns [S, H, T, D], computed the
    way :func:`attention_way` found keeps each row's result independent of the rest of the batch
    (``fixed_memory``: keys whose length never changes, see there; ``lengths``: each slot's new rows,
    which the row-by-row way uses to skip padding)."""
    way = attention_way(q.device, q.dtype, fixed_memory) if keys.shape[2] % ATTENTION_BLOCK == 0 else "fused"
    if softcap is not None and way == "fused":
        way = "plain"
    if way == "row-by-row":
        return _row_by_row(q, keys, values, blocked, scale, softcap, lengths)
    return _WAYS[way](q, keys, values, blocked, scale, softcap)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: SlotKVCache, layer: int,
           batch: StepBatch, blocked: torch.Tensor | None = None, scale: float | None = None,
           softcap: float | None = None) -> torch.Tensor:
    """Causal self-attention of the new rows over their slot's history.

    q: [R, H, D]; k, v: [R, Hkv, D] for the new rows, written into the cache first (all in the
    cache's dtype from here on); ``blocked``: the step's mask for this layer (``batch.blocked``
    unless given, e.g. :meth:`StepBatch.window_blocked`); ``scale``, ``softcap``: see :func:`attention`.
    Returns [R, H * D] in the cache's dtype.
    """
    layer_k, layer_v = cache.k[layer], cache.v[layer]
    layer_k[batch.row_slots, :, batch.row_positions] = k.to(layer_k.dtype)
    layer_v[batch.row_slots, :, batch.row_positions] = v.to(layer_v.dtype)
    keys = _slot_view(layer_k, batch, batch.kv_len)
    values = _slot_view(layer_v, batch, batch.kv_len)
    out = attention(_to_padded(q.to(keys.dtype), batch), keys, values,
                    batch.blocked if blocked is None else blocked, scale, softcap)  # [S, H, T, D]
    return batch.flat(out.transpose(1, 2)).flatten(1)


def attend_fixed(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, batch: StepBatch,
                 blocked: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of the new rows over a per-slot fixed memory (Whisper's encoder output).

    q: [R, H, D]; keys, values: [slots, H, M, D]; blocked: [1, 1, 1, M] True for padding positions
    past the memory's end (None: none). Returns [R, H * D].
    """
    k = _slot_view(keys, batch, keys.shape[2])
    v = _slot_view(values, batch, values.shape[2])
    out = attention(_to_padded(q.to(k.dtype), batch), k, v, blocked, fixed_memory=True, lengths=batch.lengths)
    return batch.flat(out.transpose(1, 2)).flatten(1)


class BatchedDecoder(ABC):
    """A model family's decoder behind the seam: slots, a KV cache, and one batched step.

    The weights are prepared once; :meth:`allocate` (re)builds the per-slot memory for a width,
    so calibration can time several widths without preparing the weights again.
    """

    family: str  # the kind of model: "chat" or "whisper"
    architecture: str  # the layers it runs: "llama", "qwen3", "whisper", ...
    vocab_size: int
    max_len: int  # positions per slot (prompt and output together), at most context_limit
    context_limit: int  # the most positions the model itself handles
    width: int = 0

    def allocate(self, width: int, max_len: int | None = None) -> None:
        """Give the decoder ``width`` slots of ``max_len`` positions (the model's limit by default)."""
        self.width = width
        self._allocate(width, max_len or self.max_len)

    @abstractmethod
    def _allocate(self, width: int, max_len: int) -> None:
        """Build the caches (and any other per-slot memory) for ``width`` slots."""

    @abstractmethod
    def forward(self, batch: StepBatch, logit_rows: torch.Tensor | None = None, with_hidden: bool = False):
        """Run one step; return logits [len(logit_rows), vocab] (all real rows when None). With
        ``with_hidden``, return (logits, hidden): the final-norm hidden states of those rows, the
        vectors the output layer saw (what MTP draft heads start from)."""

    @abstractmethod
    def output_embeddings(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The token embedding [V, d] and output matrix [V, d] (draft heads reuse both, frozen)."""

    @property
    @abstractmethod
    def cache_bytes(self) -> int:
        """Memory held by this lane's caches, in bytes."""

    @property
    def device(self) -> torch.device:
        return self.cache.device

    @abstractmethod
    def slot_bytes_at(self, length: int) -> int:
        """Memory one slot needs at ``length`` positions, in bytes (bounds the width and the length)."""

    @property
    def slot_bytes(self) -> int:
        """Memory one slot needs at :attr:`max_len` positions, in bytes."""
        return self.slot_bytes_at(self.max_len)
