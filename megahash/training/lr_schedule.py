"""Learning-rate schedule: linear warmup, then cosine / linear / WSD decay to ``min_lr`` over
``decay_steps`` ([Xue25] Table 4.9: peak 4e-4, warmup 2000, cosine), set by megatron-core's
``OptimizerParamScheduler`` (Megatron-LM's ``--lr-decay-iters``, ``--lr-warmup-iters``/``--lr-warmup-fraction``,
``--lr-decay-style`` with ``WSD``, ``--lr-wsd-decay-iters`` and ``--lr-wsd-decay-style``).

With ``s`` the 0-based optimizer step, ``W`` warmup steps, ``D`` decay steps (``train.decay_steps``,
0 = ``train.steps``), ratio ``r = (s - W) / (D - W)``, the LR of step ``s`` is:

- warmup (s < W): ``lr * (s + 1) / W``
- cosine: ``min + (lr - min) * 0.5 * (1 + cos(pi * r))``; linear: ``min + (lr - min) * (1 - r)``
- WSD (warmup-stable-decay, [Hu24] "MiniCPM"): ``lr`` until the last ``F * D`` steps of the
  decay length (``F`` = ``train.decay_fraction``), then linear / cosine / 1-sqrt from lr to min over them
- constant: ``lr``; past ``D`` every decaying schedule stays at ``min_lr``.

Megatron's scheduler gives the LR at its step count ``n``, warmup ``lr * n / W`` while ``n <= W``: step ``s``
runs at ``n = s + 1`` during warmup (its first step at ``lr / W``, not 0) and at ``n = s`` after it (step
``W`` at the peak, ``r = 0``). A decay length not beyond warmup (``D <= W``, which megatron refuses) ends the
decay with warmup: lengths ``W`` and ``W + 1``, ``n = s + 1`` from step ``W`` on (``min_lr``).
Decoupling ``D`` from ``train.steps`` means extending a run (more steps) does not reshape the curve.

Under a batch-size ramp (``train.batch_ramp``) ``n`` counts samples, as Megatron's does with a ramp: with
``c_s`` the samples consumed before step ``s`` (megahash/data/samples.py) the lengths are ``c_W`` and ``c_D``
and ``n`` is ``c_{s+1}`` during warmup, ``c_s`` after it (WSD anneals over the last ``F * c_D`` samples).
Warmup and decay still end at steps ``W`` and ``D``; without a ramp ``c_s = s G`` and this is the step form.

Muon's momentum warm-up (``train.muon.momentum_warmup_steps``) is set here as well, the momentum of step ``s``
on Muon's groups (``muon.momentum_at``), so it follows the optimizer step as the LR does.

Each parameter group keeps its own peak (``train.muon.lr`` for Muon's matrices; floor ``peak * min_lr / lr``)
and its own constant weight decay (megatron's ``start_wd = end_wd`` per group). DeepSpeed's engine calls
:meth:`Schedule.step` after every applied optimizer step and checkpoints :meth:`Schedule.state_dict`; a
resume runs its first step at the saved LRs and the config's schedule from the next (megatron's
``override_opt_param_scheduler``), as DeepSpeed's restored optimizer groups did with torch's ``LambdaLR``.
"""

from __future__ import annotations


def warmup_steps_of(train_cfg) -> int:
    """``train.warmup_fraction`` (of the decay length) when set, else ``train.warmup_steps``."""
    t = train_cfg
    frac = getattr(t, "warmup_fraction", 0.0) or 0.0
    if frac > 0:
        return int(round(frac * decay_steps_of(t)))
    return int(t.warmup_steps)


def decay_steps_of(train_cfg) -> int:
    return int(getattr(train_cfg, "decay_steps", 0) or train_cfg.steps)


def _samples(t, step: int) -> int:
    """``c_s``: samples consumed before step ``s`` under a ramp; ``s`` itself without one (the step form)."""
    if not getattr(t, "batch_ramp", None):
        return step
    from megahash.data.samples import consumed_samples

    return consumed_samples(t, step)


class Schedule:
    """The LR scheduler DeepSpeed steps: megatron-core's ``OptimizerParamScheduler`` at the count of each
    optimizer step (module docstring)."""

    def __init__(self, optimizer, train_cfg):
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        t = self.t = train_cfg
        self.warmup = warmup_steps_of(t)
        c_w, c_d = _samples(t, self.warmup), _samples(t, decay_steps_of(t))
        self.ends_in_warmup = c_d <= c_w
        decay_len = c_w + 1 if self.ends_in_warmup else c_d
        for group in optimizer.param_groups:  # each group's own peak and weight decay
            if group["lr"] != t.lr:
                group.setdefault("max_lr", group["lr"])
                group.setdefault("min_lr", group["lr"] * t.min_lr / t.lr if t.lr else 0.0)
            group.setdefault("start_wd", group.get("weight_decay", 0.0))
            group.setdefault("end_wd", group["start_wd"])
        self.megatron = OptimizerParamScheduler(
            optimizer,
            init_lr=0.0,
            max_lr=t.lr,
            min_lr=t.min_lr,
            lr_warmup_steps=c_w,
            lr_decay_steps=decay_len,
            lr_decay_style="WSD" if t.decay == "wsd" else t.decay,
            start_wd=t.weight_decay,
            end_wd=t.weight_decay,
            wd_incr_steps=decay_len,
            wd_incr_style="constant",
            use_checkpoint_opt_param_scheduler=False,
            override_opt_param_scheduler=True,
            wsd_decay_steps=max(1, int(round(t.decay_fraction * c_d))),
            lr_wsd_decay_style={"1-sqrt": "minus_sqrt"}.get(t.wsd_decay_style, t.wsd_decay_style),
        )
        self.go_to(0)

    def count(self, step: int) -> int:
        """Megatron's step count ``n`` of 0-based optimizer step ``step`` (module docstring)."""
        if step < self.warmup:
            return _samples(self.t, step + 1)
        return _samples(self.t, step) + (1 if self.ends_in_warmup else 0)

    def go_to(self, step: int) -> None:
        """Set every group's LR (and weight decay) to those of optimizer step ``step``; Muon's groups their
        settings too (``train.muon``, the momentum warm-up's momentum: megahash/training/muon.py,
        ``group_settings``), so a resumed optimizer follows this run's config."""
        self.last_step = step
        self.megatron.step(self.count(step) - self.megatron.num_steps)
        groups = [g for g in self.megatron.optimizer.param_groups if g.get("use_muon")]
        if groups:
            from megahash.training.muon import group_settings

            settings = group_settings(self.t.muon, step)
            for group in groups:
                group.update(settings)

    def step(self) -> None:
        """After an applied optimizer step: the LR of the next one."""
        self.go_to(self.last_step + 1)

    def state_dict(self) -> dict:
        """megatron's state, the step and each group's LR for it."""
        return {
            **self.megatron.state_dict(),
            "last_step": self.last_step,
            "lrs": [g["lr"] for g in self.megatron.optimizer.param_groups],
        }

    def load_state_dict(self, state: dict) -> None:
        """The saved step at the saved LRs; this config's schedule from the next step on (megatron's
        ``override_opt_param_scheduler``: a run extended past a decay over train.steps bends to the new
        length). Checkpoints of the releases before this scheduler hold torch's ``LambdaLR`` state (its
        step count ``last_epoch`` and LRs ``_last_lr``): the same resume."""
        if "last_step" in state:
            self.megatron.num_steps = 0  # megatron's load adds the saved count to a fresh scheduler's
            self.megatron.load_state_dict(state)
        self.go_to(int(state["last_step"] if "last_step" in state else state["last_epoch"]))
        for group, lr in zip(self.megatron.optimizer.param_groups, state.get("lrs", state.get("_last_lr", []))):
            group["lr"] = lr


def lr_for_step(train_cfg, step: int) -> float:
    """LR of 0-based optimizer step ``step`` under the config's schedule (in samples under a batch ramp)."""
    import types

    group = {"lr": train_cfg.lr, "weight_decay": 0.0}
    Schedule(types.SimpleNamespace(param_groups=[group]), train_cfg).go_to(step)
    return group["lr"]


def lambda_for(train_cfg):
    """Multiplier function for ``torch.optim.lr_scheduler.LambdaLR`` (base LR = train.lr): a plain torch
    loop on this schedule (tests and benchmarks comparing with one)."""
    t = train_cfg
    if t.lr == 0:
        return lambda step: 0.0
    return lambda step: lr_for_step(t, step) / t.lr
