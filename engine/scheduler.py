"""Lanes and slots: continuous batching of many sequences through one model's batched decoder.

A lane owns one model's :class:`~engine.seam.BatchedDecoder` with ``width`` slots. Sequences wait
in a queue, join a free slot at any step, prefill their prompt in chunks alongside the running
slots' decode rows, and leave when finished or cancelled. Each step is one forward pass.

Work a sequence needs before its prompt (Whisper: encoding its window) is a generator the lane
advances before a step. While another lane is busy (a chat streaming), one piece per step, so a
joining window stalls the running slots by one encoder layer, not a whole encoder; with the engine
to itself, every joining window in full, up to about PREPARE_BUDGET_MS (the budget is checked
between windows), so the slots then decode at full width. The time it takes is in the step record.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from dataclasses import dataclass, field
from itertools import islice
from typing import TYPE_CHECKING, Callable, Iterator

import torch

from engine.drafting import (
    MAX_DEPTH,
    PRIOR_ACCEPTANCE,
    DepthPlanner,
    DraftCounts,
    Drafter,
    relax_acceptance,
    update_acceptance,
)
from engine.errors import record_fault
from engine.picking import TokenPicker
from engine.sampling import SamplingParams
from engine.seam import BatchedDecoder, StepBatch
from engine.step_stats import LaneCounters, StepRecord

if TYPE_CHECKING:
    from engine.whisper.window import WindowState

log = logging.getLogger(__name__)

PREFILL_CHUNK = 64  # prompt rows a joining sequence feeds per step, so running slots keep moving
PREFILL_BUDGET = 512  # prompt rows a whole step feeds (beyond one chunk): many joining at once take turns
PREPARE_BUDGET_MS = 1000.0  # a lane alone prepares joining sequences for up to this long before a step


@dataclass(eq=False)
class Sequence:
    """One stream of tokens in one slot: a chat answer, or one Whisper window."""

    prompt: list[int]
    max_new_tokens: int
    stop_ids: set[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    suppress: torch.Tensor | None = None  # ids never emitted
    begin_suppress: torch.Tensor | None = None  # ids not emitted as the first token
    # Masks a row's logits given the tokens generated so far (Whisper's time-token rules), in place.
    rules: Callable[[torch.Tensor, list[int]], object] | None = None
    on_token: Callable[["Sequence", int], bool | None] | None = None  # returns True to stop here
    on_finish: Callable[["Sequence"], None] | None = None
    # Called with the slot on joining; may return a generator of work pieces to run before the prompt.
    prepare: Callable[["Sequence", int], Iterator | None] | None = None
    window: WindowState | None = None  # a Whisper window's own state
    # Called instead of finishing (not on cancel); True when it gave the sequence more to do in its slot.
    follow_on: Callable[["Sequence", str], bool] | None = None
    urgent: bool = False  # joins before every sequence that is not (a live recording's windows)
    handle: object | None = None  # the request this sequence belongs to
    index: int = 0  # its place within that request (Whisper: the window number)
    size: float = 0.0  # expected work (Whisper: frames of audio in the window), for the joining order
    passed_over: int = 0  # times a larger sequence behind it joined first
    # state
    slot: int = -1
    preparing: Iterator | None = None  # unfinished preparation work
    fed: int = 0  # tokens already in the cache
    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    cancelled: bool = False
    t_submit: float = field(default_factory=time.perf_counter)
    t_join: float | None = None
    stamps: list[float] = field(default_factory=list)
    picker: TokenPicker | None = None
    # drafting
    draft_state: dict = field(default_factory=dict)  # the drafter's own memory of this sequence
    last_hidden: torch.Tensor | None = None  # final-norm hidden state of the row that chose tokens[-1]
    hidden_rows: list[torch.Tensor] | None = None  # kept when a list: the hidden state behind each token chosen
    accept_ema: list[float] = field(default_factory=lambda: [PRIOR_ACCEPTANCE] * MAX_DEPTH)
    draft_counts: DraftCounts = field(default_factory=DraftCounts)

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
            "drafting": self.draft_counts.to_json(),
        }


class Lane:
    def __init__(self, decoder: BatchedDecoder, name: str = "", on_step: Callable[[StepRecord], None] | None = None,
                 drafter: Drafter | None = None, planner: DepthPlanner | None = None, drafting_state: str = "off"):
        self.decoder = decoder
        self.name = name
        self.width = decoder.width
        self.slots: list[Sequence | None] = [None] * self.width
        self.waiting: deque[Sequence] = deque()
        self.counters = LaneCounters()
        self.on_step = on_step
        self.drafter = drafter
        self.planner = planner
        self.drafting_state = "off" if drafter is None and drafting_state == "on" else drafting_state
        self.draft_counts = DraftCounts()
        # Who holds a slot free for urgent sequences (live recordings): while anyone does, other sequences
        # leave the last free slot alone, so a recording's next window starts at once instead of waiting
        # for a file's window to end (seconds, at full width).
        self.slot_holders: set[object] = set()

    def hold_slot(self, holder: object) -> None:
        self.slot_holders.add(holder)

    def release_slot(self, holder: object) -> None:
        self.slot_holders.discard(holder)

    @property
    def steps(self) -> int:
        return self.counters.steps

    def drafting_off(self, reason: str) -> None:
        """Stop drafting on this lane (it keeps serving, one token per step); the log and status say why."""
        log.warning("Drafting is off on lane %s: %s.", self.name, reason)
        self.drafter = None
        self.planner = None
        self.drafting_state = f"off: {reason}"

    # ------------------------------------------------------------------ queue
    def add(self, seq: Sequence) -> None:
        if len(seq.prompt) + seq.max_new_tokens > self.decoder.max_len:
            seq.max_new_tokens = max(0, self.decoder.max_len - len(seq.prompt))
        if seq.urgent:  # after the urgent ones already waiting, before everything else
            at = next((i for i, s in enumerate(self.waiting) if not s.urgent), len(self.waiting))
            self.waiting.insert(at, seq)
        else:
            self.waiting.append(seq)

    def cancel(self, seq: Sequence) -> None:
        seq.cancelled = True

    @property
    def busy(self) -> bool:
        return bool(self.waiting) or any(s is not None for s in self.slots)

    def _finish(self, seq: Sequence, reason: str) -> None:
        if seq.follow_on is not None and reason != "cancelled" and seq.slot >= 0 and self.slots[seq.slot] is seq:
            follow_on, seq.follow_on = seq.follow_on, None
            if follow_on(seq, reason):  # it goes on in its slot (Whisper: aligning its words)
                return
        seq.finish_reason = reason
        seq.preparing = None
        if seq.slot >= 0 and self.slots[seq.slot] is seq:
            self.slots[seq.slot] = None
        if seq.on_finish:
            seq.on_finish(seq)

    def _next_waiting(self) -> "Sequence":
        """The sequence to join next: the largest among the first ``width`` waiting (arrival order
        among equals), unless the first has been passed over ``width`` times already. At the end of
        a batch the long windows then start before the short ones (instead of one long window
        decoding alone at the end), while no sequence waits more than ``width`` extra turns and files
        still finish roughly in the order they came."""
        head = self.waiting[0]
        if head.passed_over >= self.width or head.urgent:
            return self.waiting.popleft()
        ahead = list(islice(self.waiting, self.width))
        pick = max(ahead, key=lambda s: s.size)  # the first of the largest
        for s in ahead:
            if s is pick:
                break
            s.passed_over += 1
        self.waiting.remove(pick)
        return pick

    def _admit(self) -> None:
        while self.waiting and None in self.slots:
            if (self.slot_holders and self.width > 1 and not self.waiting[0].urgent
                    and self.slots.count(None) == 1):  # the last free slot is held for urgent work
                return
            seq = self._next_waiting()
            if seq.cancelled:
                self._finish(seq, "cancelled")
                continue
            seq.slot = self.slots.index(None)
            seq.t_join = time.perf_counter()
            seq.accept_ema = self._acceptance_prior()
            self.slots[seq.slot] = seq
            if seq.prepare:
                seq.preparing = seq.prepare(seq, seq.slot)
            if seq.max_new_tokens == 0:
                self._finish(seq, "length")

    def _prepare(self, shared: bool) -> None:
        """Advance joining sequences' preparation (Whisper: encode the window into the slot).

        With the engine to itself, the lane prepares every joining sequence before the step, up to
        PREPARE_BUDGET_MS: the slots then decode at full width sooner, fewer steps run half empty,
        and the encoder's large activations do not evict the decoder's weights and memory from the
        processor's cache between steps (measured: 10-15% off a batch of files). When another lane
        is busy (a chat streaming), one piece per step while others decode, so its tokens keep
        flowing; with nobody decoding, until one is ready. The same while an urgent sequence (a live
        recording's window) decodes: its captions are not held up by files' windows joining. Urgent
        sequences are prepared first."""
        pending = sorted((s for s in self.slots if s is not None and s.preparing is not None), key=lambda s: not s.urgent)
        if not pending:
            return
        shared = shared or any(s is not None and s.urgent and s.preparing is None for s in self.slots)
        someone_decoding = len(pending) < sum(s is not None for s in self.slots)
        start = time.perf_counter()
        for seq in pending:
            while seq.preparing is not None:
                try:
                    next(seq.preparing)
                except StopIteration:
                    seq.preparing = None
                if someone_decoding and shared:
                    return
            someone_decoding = True  # this one is ready now and will decode in this step
            if not shared and (time.perf_counter() - start) * 1000 >= PREPARE_BUDGET_MS:
                return

    # ------------------------------------------------------------------ drafting
    def _acceptance_prior(self) -> list[float]:
        """What a joining sequence expects at each draft position: the lane's record so far."""
        c = self.draft_counts
        return [c.accepted_at[i] / c.drafted_at[i] if c.drafted_at[i] >= 20 else PRIOR_ACCEPTANCE
                for i in range(MAX_DEPTH)]

    def _draft(self, active: list[Sequence]) -> tuple[dict[int, list[int]], float, int]:
        """Drafts for this step's decoding slots (slot -> tokens), the drafter's ms, its sequential passes."""
        if self.drafter is None:
            return {}, 0.0, 0
        base_rows = sum(len(s.next_rows()) for s in active)
        candidates, room = [], []
        for s in active:
            left = min(MAX_DEPTH, s.max_new_tokens - len(s.tokens) - 1)
            if not s.prefilling and s.tokens and left > 0 and (s.last_hidden is not None or not self.drafter.needs_hidden):
                candidates.append(s)
                room.append(left)
        if not candidates:
            return {}, 0.0, 0
        depths = self.planner.plan(candidates, base_rows, room, slots=len(active))
        chosen = [(s, d) for s, d in zip(candidates, depths) if d > 0]
        if len(chosen) < len(candidates):
            prior = self._acceptance_prior()
            for s, d in zip(candidates, depths):
                if d == 0:
                    relax_acceptance(s.accept_ema, prior)
        if not chosen:
            return {}, 0.0, 0
        t0 = time.perf_counter()
        try:
            proposals = self.drafter.propose([s for s, _ in chosen], [d for _, d in chosen])
        except Exception as exc:  # a drafter never fails a request: drafting stops, decoding goes on
            self.drafting_off(f"the {self.drafter.name} drafter failed ({exc.__class__.__name__}: {exc}); "
                              f"details are in {record_fault(exc)}")
            return {}, 0.0, 0
        ms = (time.perf_counter() - t0) * 1000
        drafts = {s.slot: [int(t) for t in p[:d]] for (s, d), p in zip(chosen, proposals) if len(p)}
        return drafts, ms, self.drafter.cost_levels(max(d for _, d in chosen))

    # ------------------------------------------------------------------ step
    def _mask(self, seq: Sequence, logits: torch.Tensor, emitted: list[int]) -> torch.Tensor:
        """What may follow the sequence's tokens and ``emitted`` (this step's, before this row):
        suppression, then the sequence's rules."""
        if seq.suppress is not None:
            logits[seq.suppress] = -float("inf")
        if seq.begin_suppress is not None and not seq.tokens and not emitted:
            logits[seq.begin_suppress] = -float("inf")
        if seq.rules is not None:
            seq.rules(logits, seq.tokens + emitted)
        return logits

    def _verify(self, seq: Sequence, rows: torch.Tensor, draft: list[int]) -> tuple[list[int], int]:
        """Tokens this step gives ``seq`` from its logit rows (the row after its last token, then one
        per draft token), and how many drafts were accepted: each position is decided exactly as
        without drafting, given the tokens before it; the first disagreement ends the step."""
        emitted, accepted = [], 0
        for i, row in enumerate(rows):
            row = self._mask(seq, row, emitted)
            if i < len(draft):
                token, kept = seq.picker.check(row, draft[i])
            else:
                token, kept = seq.picker.pick(row), False
            if seq.window is not None:
                logprob = float(torch.log_softmax(row, -1)[token])
                seq.window.logprob_sum += logprob
                if seq.window.token_probs is not None:
                    seq.window.token_probs.append(math.exp(logprob))
            seq.picker.observe(token)
            emitted.append(token)
            if not kept:
                break
            accepted += 1
        return emitted, accepted

    @torch.inference_mode()
    def step(self, shared: bool = False) -> StepRecord | None:
        """Admit waiting sequences, advance their preparation, draft, run one forward pass over every
        ready slot, emit tokens. ``shared``: another lane is busy on the same engine thread."""
        for seq in list(s for s in self.slots if s is not None and s.cancelled):
            self._finish(seq, "cancelled")
        self._admit()
        t_prepare = time.perf_counter()
        self._prepare(shared)
        prepare_ms = (time.perf_counter() - t_prepare) * 1000
        active = self._within_prefill_budget([s for s in self.slots if s is not None and s.preparing is None])
        if not active:
            return None
        drafts, draft_ms, levels = self._draft(active)
        try:
            return self._run(active, drafts, prepare_ms, draft_ms, levels)
        except torch.OutOfMemoryError:
            if not drafts:
                raise
            self.drafting_off("the device ran out of memory while verifying drafts")
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            return self._run(active, {}, prepare_ms, 0.0, 0)

    @staticmethod
    def _within_prefill_budget(ready: list[Sequence]) -> list[Sequence]:
        """The ready sequences that take part in this step: every decoding one, and prompts as far as
        PREFILL_BUDGET rows go (at least one), earliest joined first; the others wait a step in their
        slots, so a crowd of prompts arriving together does not stall the running slots for seconds."""
        budget, chosen = PREFILL_BUDGET, set()
        for seq in sorted((s for s in ready if s.prefilling), key=lambda s: s.t_join or 0.0):
            rows = min(PREFILL_CHUNK, len(seq.prompt) - seq.fed)
            if chosen and rows > budget:
                break
            chosen.add(id(seq))
            budget -= rows
        return [s for s in ready if not s.prefilling or id(s) in chosen]

    def _run(self, active: list[Sequence], drafts: dict[int, list[int]], prepare_ms: float, draft_ms: float,
             levels: int) -> StepRecord:
        rows = [s.next_rows() + drafts.get(s.slot, []) for s in active]
        prefill_rows = sum(len(r) for s, r in zip(active, rows) if s.prefilling)
        batch = StepBatch.build([s.slot for s in active], rows, [s.fed for s in active], device=self.decoder.device,
                                prompt_lengths=[len(s.prompt) for s in active])
        # Logits for each sequence's last row, every row of a draft being checked, and a probe row where asked.
        wanted, owners, offset, aligning = [], [], 0, []
        for seq, r in zip(active, rows):
            if seq.window is not None and seq.window.aligning:
                aligning.append(seq)
                batch.attention_groups = (batch.attention_groups or []) + [
                    (seq.slot, torch.arange(offset, offset + len(r), device=batch.tokens.device))]
            probe = seq.window.probe_row if seq.window is not None else None
            if probe is not None and seq.fed <= probe < seq.fed + len(r):
                wanted.append(offset + probe - seq.fed)
                owners.append((seq, None, 1))
            checked = len(drafts.get(seq.slot, ()))
            wanted.extend(range(offset + len(r) - 1 - checked, offset + len(r)))
            owners.append((seq, len(r), checked + 1))
            offset += len(r)
        drafter_hidden = self.drafter is not None and self.drafter.needs_hidden
        with_hidden = drafter_hidden or any(seq.hidden_rows is not None for seq in active)
        t0 = time.perf_counter()
        # every row, in order (one stream decoding, or every slot's single row): no selection to make
        rows_t = None if wanted == list(range(offset)) else torch.tensor(wanted, device=batch.tokens.device)
        logits, hidden = self.decoder.forward(batch, rows_t, with_hidden=True) if with_hidden else \
            (self.decoder.forward(batch, rows_t), None)
        logits = logits.cpu()  # token choice runs on the CPU, per sequence, with its own generator
        for seq, scores in zip(aligning, batch.attention or []):
            seq.window.attention.append(scores.cpu())
        now = time.perf_counter()
        emitted: dict[int, int] = {}
        drafted: dict[int, int] = {}
        accepted_by_slot: dict[int, int] = {}
        at = 0
        for seq, fed_rows, n in owners:
            first, at = at, at + n
            if fed_rows is None:
                seq.window.probe_logits = logits[first].clone()
                continue
            if seq.prefilling:
                seq.fed += fed_rows
                if seq.prefilling:
                    continue
                if seq.window is not None and seq.window.aligning:  # its prompt was all it had to read
                    self._finish(seq, "stop")
                    continue
                tokens, accepted = self._verify(seq, logits[first:at], [])
            else:
                draft = drafts.get(seq.slot, [])
                tokens, accepted = self._verify(seq, logits[first:at], draft)
                seq.fed += 1 + accepted  # the last token and the accepted drafts are in the cache now
                if draft:
                    drafted[seq.slot], accepted_by_slot[seq.slot] = len(draft), accepted
                    seq.draft_counts.add(len(draft), accepted)
                    self.draft_counts.add(len(draft), accepted)
                    update_acceptance(seq.accept_ema, len(draft), accepted)
            if drafter_hidden:
                seq.last_hidden = hidden[first + len(tokens) - 1]
                self.drafter.observe(seq, hidden[first : first + len(tokens)], tokens)
            kept = hidden[first : first + len(tokens)].clone() if seq.hidden_rows is not None else None
            for j, token in enumerate(tokens):
                if kept is not None:  # the row behind each token taken, a stop token's included
                    seq.hidden_rows.append(kept[j])
                if token in seq.stop_ids:
                    self._finish(seq, "stop")
                    break
                seq.tokens.append(token)
                seq.stamps.append(now)
                emitted[seq.slot] = emitted.get(seq.slot, 0) + 1
                if seq.on_token and seq.on_token(seq, token):
                    self._finish(seq, "stop")
                    break
                if len(seq.tokens) >= seq.max_new_tokens:
                    self._finish(seq, "length")
                    break
        step_ms = (time.perf_counter() - t0) * 1000
        if self.planner is not None and not prefill_rows:  # prompt chunks cost otherwise than drafts
            self.planner.cost.observe(len(active), offset, step_ms, draft_ms if levels else None, levels)
        record = StepRecord(
            lane=self.name, step=self.counters.steps, width=self.width, slots=len(active), rows=offset,
            prefill_rows=prefill_rows, step_ms=step_ms, prepare_ms=prepare_ms,
            preparing=sum(1 for s in self.slots if s is not None and s.preparing is not None),
            waiting=len(self.waiting), tokens=emitted, context={s.slot: s.fed for s in active},
            draft_ms=draft_ms, drafted=drafted, accepted=accepted_by_slot)
        self.counters.add(record)
        if self.on_step:
            self.on_step(record)
        return record

    def run_until_idle(self) -> None:
        while self.busy:
            self.step()
