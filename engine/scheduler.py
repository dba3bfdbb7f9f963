"""Lanes and slots: continuous batching of many sequences through one model's batched decoder.

A lane owns one model's :class:`~engine.seam.BatchedDecoder` with ``width`` slots. Sequences wait
in a queue, join a free slot at any step, prefill their prompt in chunks alongside the running
slots' decode rows, and leave when finished or cancelled. Each step is one forward pass.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import torch

from engine.sampling import SamplingParams, TokenPicker
from engine.seam import BatchedDecoder, StepBatch

PREFILL_CHUNK = 64  # prompt rows a joining sequence feeds per step, so running slots keep moving


@dataclass(eq=False)
class Sequence:
    """One stream of tokens in one slot: a chat answer, or one Whisper window."""

    prompt: list[int]
    max_new_tokens: int
    stop_ids: set[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    suppress: torch.Tensor | None = None  # ids never emitted
    begin_suppress: torch.Tensor | None = None  # ids not emitted as the first token
    on_token: Callable[["Sequence", int], bool | None] | None = None  # returns True to stop here
    on_finish: Callable[["Sequence"], None] | None = None
    prepare: Callable[["Sequence", int], None] | None = None  # called with the slot on joining
    probe_row: int | None = None  # a prompt row whose logits are kept (Whisper's no-speech check)
    track_logprob: bool = False  # sum the chosen tokens' log-probabilities (Whisper's quality check)
    handle: object | None = None  # the request this sequence belongs to
    index: int = 0  # its place within that request (Whisper: the window number)
    # state
    slot: int = -1
    fed: int = 0  # tokens already in the cache
    tokens: list[int] = field(default_factory=list)
    probe_logits: torch.Tensor | None = None
    logprob_sum: float = 0.0
    finish_reason: str | None = None
    cancelled: bool = False
    t_submit: float = field(default_factory=time.perf_counter)
    t_join: float | None = None
    stamps: list[float] = field(default_factory=list)
    picker: TokenPicker | None = None

    def __post_init__(self):
        self.picker = TokenPicker(self.params, self.prompt)

    @property
    def prefilling(self) -> bool:
        return self.fed < len(self.prompt)

    def next_rows(self) -> list[int]:
        if self.prefilling:
            return self.prompt[self.fed : self.fed + PREFILL_CHUNK]
        return [self.tokens[-1]]

    def timings(self) -> dict:
        """From this sequence's own timestamps, so they stay true under concurrency."""
        first, last = (self.stamps[0], self.stamps[-1]) if self.stamps else (None, None)
        decode_s = (last - first) if first is not None else 0.0
        end = last if last is not None else time.perf_counter()
        return {
            "queue_wait": round((self.t_join or end) - self.t_submit, 4),
            "time_to_first_token": round(first - self.t_submit, 4) if first is not None else None,
            "decode_tok_s": round((len(self.stamps) - 1) / decode_s, 2) if decode_s > 0 else None,
            "end_to_end": round(end - self.t_submit, 4),
            "tokens": len(self.tokens),
        }


@dataclass
class StepRecord:
    rows: int
    slots: int
    step_ms: float
    per_slot_tokens: dict[int, int]
    context: dict[int, int]


class Lane:
    def __init__(self, decoder: BatchedDecoder, name: str = ""):
        self.decoder = decoder
        self.name = name
        self.width = decoder.width
        self.slots: list[Sequence | None] = [None] * self.width
        self.waiting: deque[Sequence] = deque()
        self.steps = 0

    # ------------------------------------------------------------------ queue
    def add(self, seq: Sequence) -> None:
        if len(seq.prompt) + seq.max_new_tokens > self.decoder.max_len:
            seq.max_new_tokens = max(0, self.decoder.max_len - len(seq.prompt))
        self.waiting.append(seq)

    def cancel(self, seq: Sequence) -> None:
        seq.cancelled = True

    @property
    def busy(self) -> bool:
        return bool(self.waiting) or any(s is not None for s in self.slots)

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.finish_reason = reason
        if seq.slot >= 0 and self.slots[seq.slot] is seq:
            self.slots[seq.slot] = None
        if seq.on_finish:
            seq.on_finish(seq)

    def _admit(self) -> None:
        while self.waiting and None in self.slots:
            seq = self.waiting.popleft()
            if seq.cancelled:
                self._finish(seq, "cancelled")
                continue
            seq.slot = self.slots.index(None)
            seq.t_join = time.perf_counter()
            if seq.prepare:
                seq.prepare(seq, seq.slot)
            self.slots[seq.slot] = seq
            if seq.max_new_tokens == 0:
                self._finish(seq, "length")

    # ------------------------------------------------------------------ step
    def _choose(self, seq: Sequence, logits: torch.Tensor) -> int:
        if seq.suppress is not None:
            logits[seq.suppress] = -float("inf")
        if not seq.tokens and seq.begin_suppress is not None:
            logits[seq.begin_suppress] = -float("inf")
        token = seq.picker.pick(logits)
        if seq.track_logprob:
            seq.logprob_sum += float(torch.log_softmax(logits, -1)[token])
        seq.picker.observe(token)
        return token

    @torch.inference_mode()
    def step(self) -> StepRecord | None:
        """Admit waiting sequences, run one forward pass over every busy slot, emit tokens."""
        for seq in list(s for s in self.slots if s is not None and s.cancelled):
            self._finish(seq, "cancelled")
        self._admit()
        active = [s for s in self.slots if s is not None]
        if not active:
            return None
        rows = [s.next_rows() for s in active]
        batch = StepBatch.build([s.slot for s in active], rows, [s.fed for s in active],
                                device=self.decoder.cache.k.device)
        # Logits are computed only for each sequence's last row (plus a probe row where asked).
        wanted, owners, offset = [], [], 0
        for seq, r in zip(active, rows):
            if seq.probe_row is not None and seq.fed <= seq.probe_row < seq.fed + len(r):
                wanted.append(offset + seq.probe_row - seq.fed)
                owners.append((seq, None))
            offset += len(r)
            wanted.append(offset - 1)
            owners.append((seq, len(r)))
        t0 = time.perf_counter()
        logits = self.decoder.forward(batch, torch.tensor(wanted, device=batch.tokens.device))
        now = time.perf_counter()
        emitted: dict[int, int] = {}
        for (seq, fed_rows), row in zip(owners, logits):
            if fed_rows is None:
                seq.probe_logits = row.clone()
                continue
            seq.fed += fed_rows
            if seq.prefilling:
                continue
            token = self._choose(seq, row)
            if token in seq.stop_ids:
                self._finish(seq, "stop")
                continue
            seq.tokens.append(token)
            seq.stamps.append(now)
            emitted[seq.slot] = 1
            if seq.on_token and seq.on_token(seq, token):
                self._finish(seq, "stop")
            elif len(seq.tokens) >= seq.max_new_tokens:
                self._finish(seq, "length")
        self.steps += 1
        return StepRecord(rows=offset, slots=len(active), step_ms=(now - t0) * 1000,
                          per_slot_tokens=emitted, context={s.slot: s.fed for s in active})

    def run_until_idle(self) -> None:
        while self.busy:
            self.step()
