"""Learning-rate schedule: linear warmup then cosine / linear decay to ``min_lr`` (thesis Table 4.9:
peak 4e-4, warmup 2000, cosine)."""
from __future__ import annotations

import math


def lr_at(step: int, lr: float, min_lr: float, warmup: int, total: int, decay: str) -> float:
    """LR for optimizer step ``step`` (0-based)."""
    if warmup > 0 and step < warmup:
        return lr * (step + 1) / warmup
    if decay == "constant" or total <= warmup:
        return lr
    frac = min(1.0, (step - warmup) / max(1, total - warmup))
    if decay == "linear":
        return lr - (lr - min_lr) * frac
    return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * frac))


def lambda_for(train_cfg):
    """Multiplier function for ``torch.optim.lr_scheduler.LambdaLR`` (base LR = train.lr)."""
    t = train_cfg
    return lambda step: lr_at(step, t.lr, t.min_lr, t.warmup_steps, t.steps, t.decay) / t.lr
