"""What every head's training loop shares: the learning-rate schedule and one optimizer step."""

from __future__ import annotations

import math

import torch


def cosine_lr(lr: float, warmup: int, step: int, steps: int, floor: float) -> float:
    """Linear warm-up over ``warmup`` steps, then a cosine decay from ``lr`` to ``floor * lr``."""
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return lr * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def apply_gradients(head: torch.nn.Module, opt: torch.optim.Optimizer, loss: torch.Tensor,
                    loss_avg: float | None) -> float:
    """Backward, clip at 1, step; returns the running mean of the loss."""
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
    opt.step()
    value = float(loss.detach())
    return value if loss_avg is None else 0.95 * loss_avg + 0.05 * value
