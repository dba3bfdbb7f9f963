"""Lanes and slots: continuous batching of many sequences through one model's batched decoder.

A lane owns one model's :class:`~engine.seam.BatchedDecoder` with ``width`` slots. Sequences wait
in a queue, join a free slot at any step, prefill their prompt in chunks alongside the running
slots' decode rows, and leave when finished or cancelled. Each step is one forward pass.

Work a sequence needs before its prompt (Whisper: encoding its 30-s window) is a generator the
lane advances one piece per step while other slots decode, so a joining window stalls the
running ones by one encoder layer, not a whole encoder; the time it takes is in the step record.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Iterator

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
    # Called with the slot on joining; may return a generator of work pieces to run before the prompt.
    prepare: Callable[["Sequence", int], Iterator | None] | None = None
    probe_row: int | None = None  # a prompt row whose logits are kept (Whisper's no-speech check)
    track_logprob: bool = False  # sum the chosen tokens' log-probabilities (Whisper's quality check)
    handle: object | None = None  # the request this sequence belongs to
    index: int = 0  # its place within that request (Whisper: the window number)
    # state
    slot: int = -1
    preparing: Iterator | None = None  # unfinished preparation work
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
    """What one step did; one line of the step log (CADENCE_STEP_STATS)."""

    lane: str
    step: int
    width: int
    slots: int  # sequences in this forward pass
    rows: int  # rows in this forward pass (decode rows + prompt chunks)
    prefill_rows: int  # of which prompt rows
    step_ms: float  # the forward pass and the token choices
    prepare_ms: float  # joining sequences' preparation run in this step (Whisper's encoder)
    preparing: int  # sequences still preparing after this step
    waiting: int  # sequences queued for a slot
    tokens: dict[int, int]  # slot -> tokens emitted
    context: dict[int, int]  # slot -> positions in its cache

    def to_json(self) -> dict:
        return {"lane": self.lane, "step": self.step, "width": self.width, "slots": self.slots, "rows": self.rows,
                "prefill_rows": self.prefill_rows, "step_ms": round(self.step_ms, 3),
                "prepare_ms": round(self.prepare_ms, 3), "preparing": self.preparing, "waiting": self.waiting,
                "tokens": {str(k): v for k, v in self.tokens.items()},
                "context": {str(k): v for k, v in self.context.items()}}


@dataclass
class LaneCounters:
    """Running totals for a lane, cheap to read from any thread."""

    steps: int = 0
    busy_slot_steps: int = 0  # sum over steps of sequences in the forward pass
    rows: int = 0
    tokens: int = 0
    step_ms_total: float = 0.0
    step_ms_max: float = 0.0
    prepare_ms_total: float = 0.0
    prepare_ms_max: float = 0.0
    last_step_ms: float = 0.0

    def add(self, record: StepRecord) -> None:
        self.steps += 1
        self.busy_slot_steps += record.slots
        self.rows += record.rows
        self.tokens += sum(record.tokens.values())
        self.step_ms_total += record.step_ms
        self.step_ms_max = max(self.step_ms_max, record.step_ms)
        self.prepare_ms_total += record.prepare_ms
        self.prepare_ms_max = max(self.prepare_ms_max, record.prepare_ms)
        self.last_step_ms = record.step_ms

    def to_json(self) -> dict:
        n = max(self.steps, 1)
        return {"steps": self.steps, "tokens": self.tokens, "rows": self.rows,
                "mean_busy_slots": round(self.busy_slot_steps / n, 3),
                "mean_step_ms": round(self.step_ms_total / n, 3), "max_step_ms": round(self.step_ms_max, 3),
                "last_step_ms": round(self.last_step_ms, 3), "prepare_ms_total": round(self.prepare_ms_total, 3),
                "max_prepare_ms": round(self.prepare_ms_max, 3)}


class Lane:
    def __init__(self, decoder: BatchedDecoder, name: str = "", on_step: Callable[[StepRecord], None] | None = None):
        self.decoder = decoder
        self.name = name
        self.width = decoder.width
        self.slots: list[Sequence | None] = [None] * self.width
        self.waiting: deque[Sequence] = deque()
        self.counters = LaneCounters()
        self.on_step = on_step

    @property
    def steps(self) -> int:
        return self.counters.steps

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
        seq.preparing = None
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
            self.slots[seq.slot] = seq
            if seq.prepare:
                seq.preparing = seq.prepare(seq, seq.slot)
            if seq.max_new_tokens == 0:
                self._finish(seq, "length")

    def _prepare(self) -> None:
        """Advance joining sequences' preparation: one piece while others decode, else until one is ready."""
        pending = [s for s in self.slots if s is not None and s.preparing is not None]
        if not pending:
            return
        someone_decoding = len(pending) < sum(s is not None for s in self.slots)
        for seq in pending:
            while seq.preparing is not None:
                try:
                    next(seq.preparing)
                except StopIteration:
                    seq.preparing = None
                if someone_decoding:
                    return
            someone_decoding = True  # this one is ready now and will decode in this step
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
        """Admit waiting sequences, advance their preparation, run one forward pass over every
        ready slot, emit tokens."""
        for seq in list(s for s in self.slots if s is not None and s.cancelled):
            self._finish(seq, "cancelled")
        self._admit()
        t_prepare = time.perf_counter()
        self._prepare()
        prepare_ms = (time.perf_counter() - t_prepare) * 1000
        active = [s for s in self.slots if s is not None and s.preparing is None]
        if not active:
            return None
        rows = [s.next_rows() for s in active]
        prefill_rows = sum(len(r) for s, r in zip(active, rows) if s.prefilling)
        batch = StepBatch.build([s.slot for s in active], rows, [s.fed for s in active], device=self.decoder.device)
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
        # Token choice runs on the CPU, per sequence, with its own generator (one copy per step).
        logits = self.decoder.forward(batch, torch.tensor(wanted, device=batch.tokens.device)).cpu()
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
        record = StepRecord(
            lane=self.name, step=self.counters.steps, width=self.width, slots=len(active), rows=offset,
            prefill_rows=prefill_rows,
            step_ms=(time.perf_counter() - t0) * 1000, prepare_ms=prepare_ms,
            preparing=sum(1 for s in self.slots if s is not None and s.preparing is not None),
            waiting=len(self.waiting), tokens=emitted, context={s.slot: s.fed for s in active})
        self.counters.add(record)
        if self.on_step:
            self.on_step(record)
        return record

    def run_until_idle(self) -> None:
        while self.busy:
            self.step()
