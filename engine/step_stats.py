"""What one decode step did (a line of the step log, CADENCE_STEP_STATS) and a lane's running totals of them."""

from __future__ import annotations

from dataclasses import dataclass, field


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
    draft_ms: float = 0.0  # the drafter's proposals for this step
    drafted: dict[int, int] = field(default_factory=dict)  # slot -> draft tokens checked
    accepted: dict[int, int] = field(default_factory=dict)  # slot -> of which accepted

    def to_json(self) -> dict:
        return {"lane": self.lane, "step": self.step, "width": self.width, "slots": self.slots, "rows": self.rows,
                "prefill_rows": self.prefill_rows, "step_ms": round(self.step_ms, 3),
                "prepare_ms": round(self.prepare_ms, 3), "preparing": self.preparing, "waiting": self.waiting,
                "tokens": {str(k): v for k, v in self.tokens.items()},
                "context": {str(k): v for k, v in self.context.items()}, "draft_ms": round(self.draft_ms, 3),
                "drafted": {str(k): v for k, v in self.drafted.items()},
                "accepted": {str(k): v for k, v in self.accepted.items()}}


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
    draft_ms_total: float = 0.0

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
        self.draft_ms_total += record.draft_ms

    def to_json(self) -> dict:
        n = max(self.steps, 1)
        return {"steps": self.steps, "tokens": self.tokens, "rows": self.rows,
                "mean_busy_slots": round(self.busy_slot_steps / n, 3),
                "mean_step_ms": round(self.step_ms_total / n, 3), "max_step_ms": round(self.step_ms_max, 3),
                "last_step_ms": round(self.last_step_ms, 3), "prepare_ms_total": round(self.prepare_ms_total, 3),
                "max_prepare_ms": round(self.prepare_ms_max, 3), "draft_ms_total": round(self.draft_ms_total, 3)}
