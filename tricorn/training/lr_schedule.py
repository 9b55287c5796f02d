"""Learning-rate schedule (Megatron's): linear warm-up, then linear/cosine decay to min_lr, then constant."""

from __future__ import annotations

import math

from tricorn.config import TrainingConfig


def learning_rate(t: TrainingConfig, iteration: int) -> float:
    """LR used for the optimizer step of `iteration` (1-based)."""
    if t.lr_warmup_iters > 0 and iteration <= t.lr_warmup_iters:
        return t.lr * iteration / t.lr_warmup_iters
    if t.lr_decay_style == "constant":
        return t.lr
    decay_iters = t.lr_decay_iters or t.train_iters
    span = max(decay_iters - t.lr_warmup_iters, 1)
    progress = min(max(iteration - t.lr_warmup_iters, 0) / span, 1.0)
    if t.lr_decay_style == "linear":
        coeff = 1.0 - progress
    else:
        coeff = 0.5 * (math.cos(math.pi * progress) + 1.0)
    return t.min_lr + coeff * (t.lr - t.min_lr)
