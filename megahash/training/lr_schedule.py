"""Learning-rate schedule: linear warmup, then cosine / linear / WSD decay to ``min_lr`` over
``decay_steps`` ([Xue25] Table 4.9: peak 4e-4, warmup 2000, cosine).

The closed forms are Megatron-LM's ``OptimizerParamScheduler`` (``--lr-decay-iters``,
``--lr-warmup-iters``/``--lr-warmup-fraction``, ``--lr-decay-style WSD`` with ``--lr-wsd-decay-iters``
and ``--lr-wsd-decay-style``), with ``s`` the 0-based optimizer step, ``W`` warmup steps,
``D`` decay steps (``train.decay_steps``, 0 = ``train.steps``), ratio ``r = (s - W) / (D - W)``:

- warmup (s < W): ``lr * (s + 1) / W``
- cosine: ``min + (lr - min) * 0.5 * (1 + cos(pi * r))``; linear: ``min + (lr - min) * (1 - r)``
- WSD (warmup-stable-decay, [Hu24] "MiniCPM"): ``lr`` until the last ``F * D`` steps of the
  decay length (``F`` = ``train.decay_fraction``), then linear / cosine / 1-sqrt from lr to min over them
- constant: ``lr``; past ``D`` every decaying schedule stays at ``min_lr``.

Decoupling ``D`` from ``train.steps`` means extending a run (more steps) does not reshape the curve.

Under a batch-size ramp (``train.batch_ramp``) the schedule runs in samples, as Megatron's does with a
ramp (sample-based lengths, advanced by each step's batch): with ``c_s`` the samples consumed before step
``s`` (megahash/training/batch_ramp.py), the lengths are the samples of the first ``W`` and ``D`` steps,
``c_W`` and ``c_D``; warmup (``s < W``) is ``lr * c_{s+1} / c_W``, after it the formulas above with
``s -> c_s``, ``W -> c_W``, ``D -> c_D`` (WSD anneals over the last ``F * c_D`` samples). Warmup and decay
still end at steps ``W`` and ``D``; without a ramp ``c_s = s G`` and this is the step form.
"""
from __future__ import annotations

import math


def warmup_steps_of(train_cfg) -> int:
    """``train.warmup_fraction`` (of the decay length) when set, else ``train.warmup_steps``."""
    t = train_cfg
    frac = getattr(t, "warmup_fraction", 0.0) or 0.0
    if frac > 0:
        return int(round(frac * decay_steps_of(t)))
    return int(t.warmup_steps)


def decay_steps_of(train_cfg) -> int:
    return int(getattr(train_cfg, "decay_steps", 0) or train_cfg.steps)


def _anneal(ratio: float, style: str) -> float:
    """Coefficient in [0, 1] going 1 -> 0 as ``ratio`` goes 0 -> 1."""
    ratio = min(1.0, max(0.0, ratio))
    if style == "linear":
        return 1.0 - ratio
    if style == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * ratio))
    if style == "1-sqrt":
        return 1.0 - math.sqrt(ratio)
    raise ValueError(f"unknown decay style {style!r}")


def lr_at(step: int, lr: float, min_lr: float, warmup: int, total: int, decay: str,
          decay_fraction: float = 0.1, wsd_style: str = "linear") -> float:
    """LR for optimizer step ``step`` (0-based); ``total`` is the decay length D."""
    if warmup > 0 and step < warmup:
        return lr * (step + 1) / warmup
    if decay == "constant":
        return lr
    if step >= total:
        return min_lr
    if decay == "wsd":
        n_decay = max(1, int(round(decay_fraction * total)))
        start = total - n_decay
        if step < start:
            return lr
        return min_lr + (lr - min_lr) * _anneal((step - start) / n_decay, wsd_style)
    if total <= warmup:
        return lr
    ratio = (step - warmup) / (total - warmup)
    return min_lr + (lr - min_lr) * _anneal(ratio, decay)


def lr_for_step(train_cfg, step: int) -> float:
    """LR of 0-based optimizer step ``step`` under the config's schedule (in samples under a batch ramp)."""
    t = train_cfg
    if getattr(t, "batch_ramp", None):
        return _lr_in_samples(t, step)
    return lr_at(step, t.lr, t.min_lr, warmup_steps_of(t), decay_steps_of(t), t.decay,
                 getattr(t, "decay_fraction", 0.1), getattr(t, "wsd_decay_style", "linear"))


def _lr_in_samples(t, step: int) -> float:
    """The schedule in samples (module docstring): warmup ``lr * c_{s+1} / c_W``, then ``s -> c_s``,
    ``W -> c_W``, ``D -> c_D``."""
    from megahash.training.batch_ramp import consumed_samples

    warmup = warmup_steps_of(t)
    c_w, c_d = consumed_samples(t, warmup), consumed_samples(t, decay_steps_of(t))
    if step < warmup:
        return t.lr * consumed_samples(t, step + 1) / c_w
    return lr_at(consumed_samples(t, step), t.lr, t.min_lr, c_w, c_d, t.decay,
                 getattr(t, "decay_fraction", 0.1), getattr(t, "wsd_decay_style", "linear"))


def lambda_for(train_cfg):
    """Multiplier function for ``torch.optim.lr_scheduler.LambdaLR`` (base LR = train.lr)."""
    t = train_cfg
    if t.lr == 0:
        return lambda step: 0.0
    return lambda step: lr_for_step(t, step) / t.lr
