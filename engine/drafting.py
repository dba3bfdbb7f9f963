"""Drafting: cheap guesses of each slot's next tokens, checked by the model in the lane's one step.

Each step the lane asks its drafter for up to ``depth`` tokens for every decoding slot at once,
feeds each slot its last token followed by its draft, and keeps the longest prefix the model
agrees with plus the model's own next token: k accepted drafts give k + 1 tokens from one forward
pass. Slots verify different numbers of rows in the same pass; none waits for another.

How deep each slot drafts is decided per step by :class:`DepthPlanner`: from the slot's own
acceptance per draft position (a moving average) and the measured cost of a step by row count,
it adds draft rows while the expected tokens per millisecond of the whole step still rises.

Drafters here:
- :class:`NgramDrafter` copies what followed the latest earlier occurrence of the context's last
  few tokens (prompt lookup): free, strong when an answer quotes its prompt or repeats itself.
- :class:`MTPDrafter` chains a small trained head on the model's own last hidden state
  (engine/mtp/; heads in resources/mtp/).
- :class:`DraftModelDrafter` runs a smaller chat model with the same tokenizer in its own slots.
- :class:`LookupThenMTPDrafter` (``auto`` where a head is shipped): lookup where it finds a match,
  else the head.
Every drafter proposes deterministically, which the sampling rule (engine.picking.check_draft)
relies on to keep sampled output distributed exactly as without drafting.
"""

from __future__ import annotations

import heapq

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch

# (the drafter's spelling and limits are checked in engine.api, which the command line reads before torch loads)
from engine.api import MAX_DEPTH
from engine.errors import CadenceError
PRIOR_ACCEPTANCE = 0.5  # a new slot's guess of its acceptance at each draft position
EMA = 0.25  # weight of the newest observation in the acceptance and cost averages
ROW_FLOOR = 0.01  # a draft row costs at least this share of its step
MIN_GAIN = 0.02  # a draft expected to add less than this many tokens is never worth its row
PATH_PAST_BEST = 16  # the planner looks this many draft rows past its best point, no further
RELAX = 0.05  # per step without drafts, a slot's acceptance moves this share back toward the lane's


# ------------------------------------------------------------------------------------------ counts
@dataclass
class DraftCounts:
    """Drafted and accepted tokens, overall and by draft position, for one sequence or one lane."""

    drafted: int = 0
    accepted: int = 0
    verifications: int = 0  # steps in which at least one draft token was checked
    drafted_at: list[int] = field(default_factory=lambda: [0] * MAX_DEPTH)
    accepted_at: list[int] = field(default_factory=lambda: [0] * MAX_DEPTH)
    last_depth: int = 0

    def add(self, drafted: int, accepted: int) -> None:
        self.last_depth = drafted
        if not drafted:
            return
        self.drafted += drafted
        self.accepted += accepted
        self.verifications += 1
        for i in range(drafted):
            self.drafted_at[i] += 1
            self.accepted_at[i] += i < accepted

    def merge(self, other: "DraftCounts") -> None:
        self.drafted += other.drafted
        self.accepted += other.accepted
        self.verifications += other.verifications
        for i in range(MAX_DEPTH):
            self.drafted_at[i] += other.drafted_at[i]
            self.accepted_at[i] += other.accepted_at[i]

    @property
    def acceptance(self) -> float | None:
        return round(self.accepted / self.drafted, 4) if self.drafted else None

    def raw(self) -> dict:
        """The counts themselves (for counters that only grow, such as a server's metrics)."""
        return {"drafted": self.drafted, "accepted": self.accepted, "verifications": self.verifications,
                "drafted_at": list(self.drafted_at), "accepted_at": list(self.accepted_at)}

    def to_json(self) -> dict:
        positions = [round(a / d, 3) for a, d in zip(self.accepted_at, self.drafted_at) if d]
        return {"drafted": self.drafted, "accepted": self.accepted, "acceptance": self.acceptance,
                # tokens per verifying step: its own token plus the accepted drafts
                "mean_acceptance_length": round(1 + self.accepted / self.verifications, 3) if self.verifications else None,
                "acceptance_by_position": positions, "depth": self.last_depth}


# ------------------------------------------------------------------------------------------ drafters
class Drafter(ABC):
    """Proposes draft tokens for many sequences at once."""

    name: str
    needs_hidden = False  # wants each sequence's last final-norm hidden state (seq.last_hidden)

    @abstractmethod
    def propose(self, seqs: list, depths: list[int]) -> list[list[int]]:
        """Up to ``depths[i]`` tokens to follow ``seqs[i]``'s context (prompt + tokens), for all at once."""

    def cost_levels(self, depth: int) -> int:
        """Sequential draft passes a depth needs (what the drafter's time grows with)."""
        return depth

    def observe(self, seq, hidden: torch.Tensor, tokens: list[int]) -> None:
        """After a step: the hidden states [n, d] of the rows that emitted ``tokens`` (called only for
        drafters that need hidden states, before the tokens join ``seq.tokens``)."""


class NgramDrafter(Drafter):
    """Prompt lookup: find the latest earlier occurrence of the context's last n tokens (n from
    ``max_n`` down to ``min_n``) and propose what followed it."""

    name = "ngram"

    def __init__(self, max_n: int = 4, min_n: int = 2):
        self.max_n, self.min_n = max_n, min_n

    def _index(self, seq, context: list[int]) -> dict:
        """Per sequence: n-gram -> the position after its latest occurrence, kept up to date incrementally."""
        state = seq.draft_state.setdefault("ngram", {"index": {}, "upto": 0})
        index, start = state["index"], state["upto"]
        # Entries for n-grams ending before the last token: lookups then always find an *earlier* occurrence.
        for end in range(max(start, 1), len(context)):
            for n in range(self.min_n, self.max_n + 1):
                if end >= n:
                    index[tuple(context[end - n:end])] = end
        state["upto"] = max(start, len(context))
        return index

    def propose(self, seqs, depths):
        drafts = []
        for seq, depth in zip(seqs, depths):
            context = seq.prompt + seq.tokens
            index = self._index(seq, context)
            draft: list[int] = []
            for n in range(self.max_n, self.min_n - 1, -1):
                if len(context) > n and (end := index.get(tuple(context[-n:]))) is not None:
                    draft = context[end:end + depth]
                    break
            drafts.append(draft)
        return drafts

    def cost_levels(self, depth: int) -> int:
        return 0


class MTPDrafter(Drafter):
    """A trained multi-token-prediction head run as a chain from each slot's last hidden state."""

    name = "mtp"
    needs_hidden = True

    def __init__(self, head, min_p: float = 0.0):
        self.head, self.min_p = head, min_p
        self.with_context = hasattr(head, "draft_cached")  # a context head keeps each sequence's past pairs

    def observe(self, seq, hidden, tokens):
        if self.with_context:
            from engine.mtp.context_head import HeadCache

            if not seq.tokens or "context" not in seq.draft_state:  # a new answer (or a window's next part)
                seq.draft_state["context"] = HeadCache()
            seq.draft_state["context"].add(hidden.detach().clone(), tokens)

    def propose(self, seqs, depths):
        if self.with_context:
            tokens, probs = self.head.draft_cached([s.draft_state["context"] for s in seqs], max(depths))
        else:
            hidden = torch.stack([s.last_hidden for s in seqs])
            last = torch.tensor([s.tokens[-1] for s in seqs], device=hidden.device)
            tokens, probs = self.head.draft(hidden, last, max(depths))
        tokens, probs = tokens.tolist(), probs.tolist()
        drafts = []
        for row, p, depth in zip(tokens, probs, depths):
            keep = depth
            if self.min_p > 0:  # stop at the first draft the head is unsure of
                keep = next((i for i in range(depth) if p[i] < self.min_p), depth)
            drafts.append(row[:keep])
        return drafts


class LookupThenMTPDrafter(Drafter):
    """What ``auto`` uses where a head exists: the context's own continuation when the n-gram lookup
    finds one (a quote, a list being repeated: often long and right), else the MTP head."""

    name = "ngram+mtp"
    needs_hidden = True

    def __init__(self, lookup: NgramDrafter, mtp: MTPDrafter):
        self.lookup, self.mtp = lookup, mtp

    def observe(self, seq, hidden, tokens):
        self.mtp.observe(seq, hidden, tokens)

    def propose(self, seqs, depths):
        drafts = self.lookup.propose(seqs, depths)
        rest = [i for i, d in enumerate(drafts) if not d]
        if rest:
            for i, d in zip(rest, self.mtp.propose([seqs[i] for i in rest], [depths[i] for i in rest])):
                drafts[i] = d
        return drafts


class DraftModelDrafter(Drafter):
    """A smaller model with the same tokenizer, decoding greedily in slots of its own."""

    def __init__(self, name: str, decoder):
        self.name = f"draft:{name}"
        self.decoder = decoder

    def propose(self, seqs, depths):
        from engine.seam import StepBatch

        context = [s.prompt + s.tokens for s in seqs]
        # Each sequence's cache in the draft model holds its context up to `fed`; drafts past the
        # context are overwritten next time, so rejected ones cost nothing to undo.
        fed = [s.draft_state.get("draft_fed", 0) for s in seqs]
        rows = [c[f:] for c, f in zip(context, fed)]
        drafts: list[list[int]] = [[] for _ in seqs]
        # no drafts past the draft model's own slot length (it may hold fewer positions than the model)
        depths = [min(d, self.decoder.max_len - len(c) - 1) for d, c in zip(depths, context)]
        live = fed_now = [i for i in range(len(seqs)) if depths[i] > 0]
        for level in range(max(depths, default=0)):
            batch = StepBatch.build([seqs[i].slot for i in live], [rows[i] for i in live], [fed[i] for i in live],
                                    device=self.decoder.device)
            logits = self.decoder.forward(batch, batch.last_rows())
            picks = logits.argmax(-1).tolist()
            nxt = []
            for i, token in zip(live, picks):
                fed[i] += len(rows[i])
                drafts[i].append(token)
                rows[i] = [token]
                if len(drafts[i]) < depths[i]:
                    nxt.append(i)
            live = nxt
            if not live:
                break
        for i in fed_now:  # their context is cached now; the drafts after it are not trusted
            seqs[i].draft_state["draft_fed"] = len(context[i])
        return drafts


def same_tokenizer(a, b) -> bool:
    """Two tokenizers map every text to the same ids (same vocabulary and special tokens)."""
    try:
        return a.get_vocab() == b.get_vocab() and a.all_special_ids == b.all_special_ids
    except AttributeError:
        return False


def build_drafter(choice: str, model: str, loaded, decoder, device, width: int, min_p: float = 0.0):
    """The drafter a lane uses, or (None, why not). Never raises for a missing head; a draft model
    that cannot serve this model (another tokenizer or family) is refused with one sentence."""
    if choice == "off":
        return None, "off"
    if choice in ("auto", "mtp"):
        try:
            from engine.mtp.head import load_head
        except ImportError:
            load_head = None
        head = load_head(model) if load_head is not None else None
        if head is not None:
            embed, lm_head = decoder.output_embeddings()
            mtp = MTPDrafter(head.bind(embed, lm_head), min_p=min_p)
            return (mtp if choice == "mtp" else LookupThenMTPDrafter(NgramDrafter(), mtp)), "on"
        if choice == "mtp":
            return None, f"off: no MTP head for {model} (train one with `cadence train-mtp --model {model}`)"
        return NgramDrafter(), "on"
    if choice == "ngram":
        return NgramDrafter(), "on"
    name = choice.split(":", 1)[1]
    from engine.families import decoder_class
    from engine.loading import load

    if decoder.family != "chat":
        raise CadenceError(f"A draft model can only serve chat models; {model} is a {decoder.family} model "
                           f"(use --drafter mtp or ngram).")
    try:
        draft = load(name, family="chat", device=device)
    except CadenceError as exc:
        raise CadenceError(f"The draft model {name} cannot draft for {model}: {exc}") from None
    if not same_tokenizer(draft.tokenizer, loaded.tokenizer):
        raise CadenceError(f"The draft model {name} uses a different tokenizer from {model}; "
                           f"pick a smaller model of the same family.")
    try:
        draft_decoder = decoder_class(draft)(draft, precision=decoder.precision)
    except CadenceError as exc:
        raise CadenceError(f"The draft model {name} cannot draft for {model}: {exc}") from None
    draft_decoder.max_len = min(draft_decoder.context_limit, decoder.max_len)
    draft_decoder.allocate(width)
    return DraftModelDrafter(name, draft_decoder), "on"


# ------------------------------------------------------------------------------------------ depth
class StepCost:
    """Milliseconds of one step by its busy slots and rows, from the calibration curves: ``step_ms``
    (one row per slot) interpolated over slots and extended linearly past its end, plus each row
    beyond the slots' first at what ``verify_ms`` (two rows per slot) showed one costs at that width.
    Without ``verify_ms`` a row costs what a slot does. Both parts are scaled by how the real steps
    compare: ``scale`` from steps without extra rows, ``row_scale`` from the rest (ragged drafts pad
    every slot to the deepest one in attention, which two even rows per slot do not show)."""

    def __init__(self, widths: list[int], step_ms: list[float], verify_ms: list[float] | None = None):
        self.widths, self.ms = list(widths), list(step_ms)
        self.verify_ms = list(verify_ms) if verify_ms and len(verify_ms) == len(widths) else None
        self.scale = 1.0
        self.row_scale = 1.0
        self.draft_ms = 0.0  # one sequential draft pass (the drafter's own cost per level)

    @staticmethod
    def _along(widths: list[int], ms: list[float], n: float) -> float:
        if len(widths) == 1 or n <= widths[0]:
            return ms[0] * (n / widths[0] if len(widths) == 1 else 1.0)
        i = next((i for i in range(1, len(widths)) if n <= widths[i]), len(widths) - 1)
        slope = (ms[i] - ms[i - 1]) / (widths[i] - widths[i - 1])
        return ms[i - 1] + slope * (n - widths[i - 1])

    def row_ms(self, slots: int) -> float:
        """What one more row (a draft) adds to a step of ``slots`` busy slots; never less than
        ROW_FLOOR of the step (a noisy calibration must not make rows look free for good)."""
        slots = max(slots, 1)
        if self.verify_ms is None:
            row = self._along(self.widths, self.ms, slots + 1) - self._along(self.widths, self.ms, slots)
        else:
            extra = [(v - m) / w for w, m, v in zip(self.widths, self.ms, self.verify_ms)]
            row = self._along(self.widths, extra, slots)
        return max(row, ROW_FLOOR * self._along(self.widths, self.ms, slots))

    def predict(self, slots: int, rows: int) -> float:
        slots = max(slots, 1)
        extra = max(rows - slots, 0) * self.row_ms(slots) * self.row_scale
        return (self._along(self.widths, self.ms, slots) + extra) * self.scale

    def observe(self, slots: int, rows: int, step_ms: float, draft_ms: float | None = None, levels: int = 0) -> None:
        slots = max(slots, 1)
        base = self._along(self.widths, self.ms, slots)
        extra = (rows - slots) * self.row_ms(slots)
        if rows <= slots or extra <= 0:
            if base > 0:
                self.scale += EMA * (step_ms / base - self.scale)
        else:  # what the extra rows cost this time, against what the curve says
            implied = (step_ms / self.scale - base) / extra
            self.row_scale += EMA * (min(max(implied, 0.25), 8.0) - self.row_scale)
        if draft_ms is not None and levels:
            self.draft_ms += EMA * (draft_ms / levels - self.draft_ms)


class DepthPlanner:
    """Draft depths per slot for one step, maximizing the step's expected tokens per millisecond."""

    def __init__(self, cost: StepCost, drafter: Drafter, fixed_depth: int | None = None):
        self.cost, self.drafter, self.fixed_depth = cost, drafter, fixed_depth
        self.considered = 0  # steps with a slot that could draft
        self.declined = 0  # of those, steps where no draft was expected to pay for its row

    def report(self) -> dict:
        """How often drafting was worth its cost here: {'considered': steps, 'declined': steps}, and a
        sentence for people when it never was."""
        out = {"considered": self.considered, "declined": self.declined}
        if self.considered and self.declined == self.considered:
            out["note"] = (f"in {self.considered} steps weighed here, no draft was expected to repay the time "
                           f"it adds to a step")
        return out

    def plan(self, seqs: list, base_rows: int, room: list[int], slots: int | None = None) -> list[int]:
        """``room[i]``: the most drafts seqs[i] may take (tokens left, cache left); ``base_rows``: the
        step's rows before drafts, over ``slots`` busy slots (len(seqs) when not given)."""
        if self.fixed_depth is not None:
            return [min(self.fixed_depth, r) for r in room]
        slots = slots or len(seqs)
        depths = [0] * len(seqs)
        tokens = float(slots)  # every busy slot makes a token this step, drafts or not
        rows, deepest = base_rows, 0

        def step_ms(rows: int, deepest: int) -> float:
            return self.cost.predict(slots, rows) + self.cost.draft_ms * self.drafter.cost_levels(deepest)

        # Add the likeliest next draft row, one at a time, and keep the best point on that path: the
        # drafter's own pass is a fixed cost that only several drafts together repay, so the path goes
        # on past a first loss, until the next draft is nearly worthless or too far past the best.
        best, path, best_len = tokens / step_ms(rows, 0), [], 0
        heap = [(-s.accept_ema[0], i) for i, s in enumerate(seqs) if room[i] > 0]
        heapq.heapify(heap)  # each slot's next draft, likeliest first (only the drafted slot's changes)
        while heap and len(path) - best_len < PATH_PAST_BEST:
            gain, i = heapq.heappop(heap)
            gain = -gain  # the chance that this draft is reached and accepted
            if gain < MIN_GAIN:
                break
            depths[i] += 1
            path.append(i)
            tokens, rows, deepest = tokens + gain, rows + 1, max(deepest, depths[i])
            if depths[i] < room[i]:
                heapq.heappush(heap, (-(gain * seqs[i].accept_ema[depths[i]]), i))
            rate = tokens / step_ms(rows, deepest)
            if rate > best:
                best, best_len = rate, len(path)
        chosen = [0] * len(seqs)
        for i in path[:best_len]:
            chosen[i] += 1
        if any(r > 0 for r in room):
            self.considered += 1
            self.declined += best_len == 0
        return chosen


def relax_acceptance(ema: list[float], prior: list[float]) -> None:
    """A slot that is not drafting learns nothing new about its drafts; let its averages drift back
    toward the lane's record, so it tries again now and then instead of never drafting after a bad
    patch (a quote or a list may start later in the answer)."""
    for i, p in enumerate(prior):
        ema[i] += RELAX * (p - ema[i])


def update_acceptance(ema: list[float], drafted: int, accepted: int) -> None:
    """Move a slot's acceptance-by-position averages toward what this step showed."""
    for i in range(min(drafted, accepted + 1)):
        ema[i] += EMA * ((1.0 if i < accepted else 0.0) - ema[i])
