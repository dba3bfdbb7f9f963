"""Held-out acceptance of an MTP head: greedy drafting and verification replayed over held-out
sequences, exactly as the engine would see it: draft ``depth`` tokens, accept the longest prefix
equal to the model's greedy tokens, move on by ``accepted + 1``."""

from __future__ import annotations


import torch

from engine.mtp.data import SeqData
from engine.mtp.head import MTPHead
from engine.mtp.recipe import DEPTH

MIN_PS = (0.3, 0.5)  # confidence cuts whose acceptance is also reported


# ---------------------------------------------------------------------------- acceptance
@torch.no_grad()
def all_chains(head: MTPHead, data: SeqData, depth: int, fast: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The head's greedy chain from every position: drafted full-vocabulary ids [N, depth] and probabilities."""
    if hasattr(head, "forward_window"):
        return context_chains(head, data, depth)
    picks, probs = [], []
    for b in range(0, data.emitted.numel(), 2048):
        p, q = head.chain(data.hidden[b : b + 2048], data.emitted[b : b + 2048], depth, fast=fast)
        picks.append(head.vocab_ids[p])
        probs.append(q)
    return torch.cat(picks), torch.cat(probs)


@torch.no_grad()
def context_logits(head, data: SeqData, depth: int) -> list[torch.Tensor]:
    """A context head's logits at every position [N, K] for chain steps 1..depth, each sequence from its
    start; step j > 1 is fed the model's own greedy tokens (the drafts that would have been accepted),
    which is all replay needs: a chain is only followed while its drafts are right."""
    out = [[] for _ in range(depth)]
    start = 0
    G = data.greedy
    for n in data.lengths.tolist():
        rows = torch.arange(start, start + n)
        chain = [G[torch.clamp(rows + j, max=start + n - 1)][None] for j in range(1, depth)]
        us = head.forward_window(data.hidden[rows][None].to(head.fc.dtype), data.emitted[rows][None], depth, chain)
        for j, u in enumerate(us):
            out[j].append(head.logits(u[0]).float())
        start += n
    return [torch.cat(o) for o in out]


def context_chains(head, data: SeqData, depth: int) -> tuple[torch.Tensor, torch.Tensor]:
    picks, probs = [], []
    for logits in context_logits(head, data, depth):
        best, index = torch.softmax(logits, -1).max(-1)
        picks.append(head.vocab_ids[index])
        probs.append(best)
    return torch.stack(picks, 1), torch.stack(probs, 1)


def replay(drafts: torch.Tensor, probs: torch.Tensor, data: SeqData, depth: int, min_p: float = 0.0) -> dict:
    """Greedy drafting and verification replayed over each sequence, as the engine runs it: from position i
    draft up to ``depth`` tokens (stopping before one whose probability is below ``min_p``), accept the
    longest prefix equal to the model's greedy tokens, continue at i + accepted + 1."""
    G = data.greedy.tolist()
    D, P = drafts[:, :depth].tolist(), probs[:, :depth].tolist()
    steps = drafted = accepted = drafts_made = 0
    at_pos = [0] * depth
    start = 0
    for n in data.lengths.tolist():
        i = 0
        while i < n - 1:
            k_max = min(depth, n - 1 - i)
            row, prow = D[start + i], P[start + i]
            k_draft = 0
            while k_draft < k_max and prow[k_draft] >= min_p:
                k_draft += 1
            k = 0
            while k < k_draft and row[k] == G[start + i + 1 + k]:
                at_pos[k] += 1
                k += 1
            steps += 1
            drafted += k_draft
            accepted += k
            drafts_made += k_draft > 0
            i += k + 1
        start += n
    return {"depth": depth, "min_p": min_p, "steps": steps, "drafts": drafts_made, "drafted": drafted,
            "accepted": accepted, "rate": accepted / drafted if drafted else 0.0,
            "mean_acceptance_length": 1 + accepted / drafts_made if drafts_made else 1.0,
            "tokens_per_step": (steps + accepted) / steps if steps else 1.0,
            "per_position": [a / drafts_made if drafts_made else 0.0 for a in at_pos]}


@torch.no_grad()
def calibrate(head: MTPHead, data: SeqData, depth: int = DEPTH) -> tuple[float, dict]:
    """The temperature that makes the head's confidence in its drafts honest on ``data`` (least squared error
    between the drafted token's probability and whether the model's greedy token equals it; step k counts
    only where steps 1..k-1 were right, as in drafting), and the error before and after."""
    grid = [round(0.5 + 0.1 * i, 2) for i in range(31)]  # 0.5 .. 3.5
    errors = torch.zeros(len(grid), dtype=torch.float64)
    rem = data.remaining
    count = 0
    was = head.temperature.clone()
    head.temperature.fill_(1.0)
    N = data.emitted.numel()

    def score(logits: torch.Tensor, right: torch.Tensor, alive: torch.Tensor) -> int:
        if not bool(alive.any()):
            return 0
        z = logits[alive] - logits[alive].max(-1, keepdim=True).values
        for g, t in enumerate(grid):
            p = 1.0 / torch.exp(z / t).sum(-1)
            errors[g] += float(((p - right[alive].float()) ** 2).sum())
        return int(alive.sum())

    if hasattr(head, "forward_window"):  # a context head: every step's logits at once, chains fed greedy tokens
        idx = torch.arange(N)
        alive = rem >= 1
        for k, logits in enumerate(context_logits(head, data, depth), start=1):
            right = (head.vocab_ids[logits.argmax(-1)] == data.greedy[torch.clamp(idx + k, max=N - 1)]) & alive
            count += score(logits, right, alive)
            alive = right & (rem >= k + 1)
    else:  # a chain head: its own chain, 2048 positions at a time
        for b in range(0, N, 2048):
            idx = torch.arange(b, min(N, b + 2048))
            h, tok = data.hidden[idx], data.emitted[idx]
            alive = rem[idx] >= 1
            for k in range(1, depth + 1):
                h = head.step(h, tok)
                logits = head.logits(h).float()
                best = logits.argmax(-1)
                tok = head.vocab_ids[best]
                right = (tok == data.greedy[torch.clamp(idx + k, max=N - 1)]) & alive
                count += score(logits, right, alive)
                alive = right & (rem[idx] >= k + 1)
    head.temperature.copy_(was)
    best = int(errors.argmin())
    return grid[best], {"brier_at_1": round(float(errors[grid.index(1.0)]) / max(count, 1), 4),
                        "brier": round(float(errors[best]) / max(count, 1), 4), "temperature": grid[best]}


def _subset(data: SeqData, limit: int | None) -> SeqData:
    if limit is None or int(data.lengths.sum()) <= limit:
        return data
    keep = int(torch.searchsorted(torch.cumsum(data.lengths, 0), torch.tensor(limit)).item()) + 1
    n = int(data.lengths[:keep].sum())
    return SeqData(data.hidden[:n], data.emitted[:n], data.greedy[:n], data.lengths[:keep], data.texts[:keep])


def measure(head: MTPHead, data: SeqData, depth: int = DEPTH, min_p: float = 0.0, limit: int | None = None,
            fast: bool = False) -> dict:
    data = _subset(data, limit)
    drafts, probs = all_chains(head, data, depth, fast)
    return replay(drafts, probs, data, depth, min_p)


def acceptance_table(head: MTPHead, data: SeqData, fast: bool = False) -> dict:
    """Held-out acceptance at depths 1..DEPTH, and at DEPTH drafting only while the head's probability is at
    least each of MIN_PS."""
    drafts, probs = all_chains(head, data, DEPTH, fast)
    table = {f"depth{d}": replay(drafts, probs, data, d) for d in range(1, DEPTH + 1)}
    for min_p in MIN_PS:
        table[f"depth{DEPTH}_min_p{min_p}"] = replay(drafts, probs, data, DEPTH, min_p)
    at = torch.nonzero(data.remaining >= 1).flatten()  # the first draft at every position, not only replayed ones
    table["first_draft_all_positions"] = float((drafts[at, 0] == data.greedy[at + 1]).float().mean()) if len(at) else 0.0
    table["positions"] = int(data.lengths.sum())
    table["sequences"] = int(len(data.lengths))
    return table


def format_table(table: dict) -> str:
    lines = ["drafting               rate   mean length  tokens/step  per position"]
    for key, m in table.items():
        if not isinstance(m, dict):
            continue
        name = f"depth {m['depth']}" + (f", min p {m['min_p']}" if m["min_p"] else "")
        lines.append(f"{name:<20} {m['rate']:7.1%} {m['mean_acceptance_length']:12.2f} {m['tokens_per_step']:12.2f}  "
                     + " ".join(f"{p:.2f}" for p in m["per_position"]))
    return "\n".join(lines)


