"""Training a context head (:mod:`engine.mtp.context_head`) on :class:`~engine.mtp.data.SeqData`.

Each batch is ``recipe.batch // WINDOW_ROWS`` windows of consecutive positions of training
sequences (chosen from the seed and the step number, so a resumed run ends where an uninterrupted
one would). At every position ``t`` of a window the head reads the pairs up to ``t`` and learns:

- the model's own next distribution (soft cross-entropy over the draft vocabulary to the softmax of
  the model's output matrix at ``h_{t+1}``: free, since ``h_{t+1}`` is in the data),
- the model's next hidden state ``h_{t+1}`` (smooth-L1 regression, weighted by ``FEATURE_WEIGHT``),
- chain step 2 (TRAIN_DEPTH) fed the model's greedy token, where the data's next token is that greedy
  token (on corpus text the model's greedy choice is not always what was fed next, and then the
  later steps have no target), weighted ``STEP_WEIGHT ** (j - 1)``.

Gaussian noise on the input hidden states (``recipe.noise`` of their RMS) makes the chain robust to
its own predicted states.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from engine.mtp.context_head import ContextHead, flat_linear
from engine.mtp.data import SeqData
from engine.mtp.optim import apply_gradients, cosine_lr
from engine.mtp.progress import quiet
from engine.mtp.recipe import Recipe

TRAIN_DEPTH = 2  # chain steps trained (later ones reuse step 2's weights: one layer serves every step)
FEATURE_WEIGHT = 10.0
STEP_WEIGHT = 0.7
WINDOW_ROWS = 128  # positions per training window


def _windows(data: SeqData, starts: torch.Tensor, eligible: torch.Tensor, count: int, g: torch.Generator):
    """Row indices [count, L + 1] of windows of up to L + 1 consecutive positions (L <= WINDOW_ROWS) and
    which of them are real [count, L + 1] (a short sequence's window is padded at its end)."""
    seqs = eligible[torch.randint(len(eligible), (count,), generator=g)]
    lens = data.lengths[seqs]
    L = min(WINDOW_ROWS, int(lens.max()) - 1)
    offsets = (torch.rand(count, generator=g) * (lens - L).clamp_min(0).float()).long()
    steps = torch.arange(L + 1)
    real = steps[None] < (lens - offsets)[:, None]
    rows = (starts[seqs] + offsets)[:, None] + torch.minimum(steps[None], (lens - offsets - 1)[:, None])
    return rows, real


def context_loss(head: ContextHead, data: SeqData, idx: torch.Tensor, real: torch.Tensor, depth: int, noise: float):
    """Loss and first-step accuracy of the head on windows ``idx`` [B, L + 1] (``real``: not padding)."""
    H, X, G = data.hidden[idx], data.emitted[idx], data.greedy[idx]
    h_in = H[:, :-1]
    if noise:
        h_in = h_in + noise * h_in.pow(2).mean(-1, keepdim=True).sqrt() * torch.randn_like(h_in)
    L = h_in.shape[1]
    padded = torch.cat([G, G[:, -1:].expand(-1, depth)], 1)  # chain tokens past the window's end: no target
    chain = [padded[:, 1 + j : 1 + j + L] for j in range(depth - 1)]
    us = head.forward_window(h_in, X[:, :-1], depth, chain)
    total, weights, acc = 0.0, 0.0, 0.0
    valid = real[:, 1:]  # the target position is real
    for j, u in enumerate(us):
        span = L - j  # positions whose step-j target exists in the window
        if span <= 0:
            break
        if j:  # the target is real and the chain's tokens were the ones fed
            valid = valid[:, :span] & real[:, 1 + j : 1 + j + span] & (X[:, j : j + span] == G[:, j : j + span])
        target = H[:, 1 + j : 1 + j + span]
        with torch.no_grad():
            soft = torch.softmax(flat_linear(target, head.out_rows), -1)
        logits = head.logits(u[:, :span])
        ce = -(soft * torch.log_softmax(logits, -1)).sum(-1)
        w = STEP_WEIGHT ** j
        m = valid.float()
        total = total + w * (ce * m).sum() / m.sum().clamp_min(1)
        weights += w
        if j == 0:
            feature = F.smooth_l1_loss(u[:, :span], target, reduction="none").mean(-1)
            total = total + FEATURE_WEIGHT * (feature * m).sum() / m.sum().clamp_min(1)
            right = (head.vocab_ids[logits.argmax(-1)] == G[:, 1 : 1 + span]).float()
            acc = float((right * m).sum() / m.sum().clamp_min(1))
    return total / weights, acc


def _lr(recipe: Recipe, step: int, steps: int) -> float:
    return cosine_lr(recipe.lr, recipe.warmup, step, steps, 0.05)


def optimizer(head: ContextHead, recipe: Recipe) -> torch.optim.Optimizer:
    matrices = [p for p in head.parameters() if p.dim() == 2]
    vectors = [p for p in head.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": matrices, "weight_decay": recipe.weight_decay},
                              {"params": vectors, "weight_decay": 0.0}], lr=recipe.lr, betas=(0.9, 0.95))


def train_context_head(head: ContextHead, train: SeqData, recipe: Recipe, seed: int, steps: int, start: int = 0,
                       opt: torch.optim.Optimizer | None = None, progress=quiet, evaluate=None, checkpoint=None,
                       stop_after: int | None = None) -> ContextHead:
    """Train ``head`` (bound to the model's matrices) from step ``start`` to ``steps``. ``evaluate(head)``
    -> a note shown every ``recipe.eval_every`` steps; ``checkpoint(head, opt, step)`` every
    ``recipe.checkpoint_every``."""
    head.train().requires_grad_(True)
    head._fast = None  # drafting kernels are made from the trained weights at the end
    opt = opt or optimizer(head, recipe)
    starts = torch.cumsum(train.lengths, 0) - train.lengths
    eligible = torch.nonzero(train.lengths > 8).flatten()
    per_batch = max(1, recipe.batch // WINDOW_ROWS)
    loss_avg, t0 = None, time.perf_counter()
    for step in range(start, steps):
        if stop_after is not None and step >= stop_after:
            break
        g = torch.Generator().manual_seed(seed * 1_000_003 + step)
        idx, real = _windows(train, starts, eligible, per_batch, g)
        for group in opt.param_groups:
            group["lr"] = _lr(recipe, step, steps)
        torch.manual_seed(seed * 1_000_003 + step)
        loss, acc = context_loss(head, train, idx, real, TRAIN_DEPTH, recipe.noise)
        loss_avg = apply_gradients(head, opt, loss, loss_avg)
        done = step + 1
        note = ""
        if evaluate is not None and (done % recipe.eval_every == 0 or done == steps):
            head.eval()
            note = ", " + evaluate(head)
            head.train()
        rate = (done - start) / (time.perf_counter() - t0)
        progress(f"step {done}/{steps}: loss {loss_avg:.3f}, first-draft batch accuracy {acc:.2f} "
                 f"({rate:.1f} steps/s){note}", force=bool(note))
        if checkpoint is not None and (done % recipe.checkpoint_every == 0 or done == steps):
            checkpoint(head, opt, done)
    head.eval().requires_grad_(False)
    return head.prepare()
