"""Skipping bad optimizer steps: ``train.skip_nonfinite``, the loss-spike rule (``train.spike_factor``,
``train.spike_window``) and ``train.max_skips``.

**Decision, every rank alike, before anything is applied.** At the gradient-accumulation boundary,
inside ``engine.step()`` and before DeepSpeed clips or steps (``engine._take_model_step``, wrapped on
the instance as :mod:`megahash.training.grad_norm` does), ONE all-reduce over the whole world sums
``[this rank's micro-batch losses, this rank's gradients-are-non-finite flag]``; every rank then sees
the same mean loss and the same flag and takes the same decision. A step is skipped when

- ``skip_nonfinite`` and the mean loss or the gradient norm is non-finite; the gradient part is
  checked on this rank's ``.grad`` where the engine steps torch's optimizer itself (ZeRO-0 in fp32;
  under tensor parallelism a rank sees only its shards, and the all-reduced flag makes a rank whose
  shards are finite skip too: tested, without it the ranks diverge);
  DeepSpeed's ZeRO 1-3 and bf16 optimizers compute the global gradient norm over the data- and
  tensor-parallel groups before they step and take their overflow path on a non-finite one (bf16
  ZeRO 1-2 only with ``check_grad_overflow``, which :func:`install` turns on): nothing applied, no
  LR step, ``engine.skipped_steps + 1``. That skip is counted here too;
- or the mean loss is a spike (:class:`SpikeRule`).

A skipped step takes DeepSpeed's own path (gradients zeroed, ZeRO buffers cleared, its step and
sample counters advanced) with the base optimizer's ``step`` a no-op and the LR scheduler detached
for the call: parameters and Adam's moments keep their bit pattern (ZeRO copies its unchanged fp32
partitions back), so a parameter never takes a non-finite value from a skipped step.

**Counters, as Megatron-LM's ``train_step`` does for an unsuccessful update**: the data position
advances (the batch is consumed, never retried: ``consumed_samples = step x global batch``, so a
resume and the sampler stay a pure function of the step) and the step counts towards
``train.steps``; the LR scheduler does NOT advance (Megatron calls ``opt_param_scheduler.step`` only
``if update_successful``, and DeepSpeed's overflow path likewise): the schedule counts applied updates,
so a skip delays the curve by one step instead of spending one of its steps on no update. DeepSpeed
checkpoints the scheduler and ``skipped_steps``, so a resume continues both. (flame's
``skip_nan_inf`` steps the scheduler anyway; megahash follows Megatron.)

After ``max_skips`` consecutive skips the run stops with one line (:class:`SkippedStepsError`, exit 2)
naming the step and its global sample indices. The spike window and the consecutive count are saved
in the checkpoint's state file (:func:`checkpoint_extra`, synchronous and asynchronous saves alike), so
a resume, at this layout or another, decides as the uninterrupted run.
"""

from __future__ import annotations

import contextlib
import math
import statistics
from collections import deque

import torch

from megahash.errors import MegahashError


class SkippedStepsError(MegahashError):
    """``train.max_skips`` consecutive optimizer steps were skipped."""


class SpikeRule:
    """Loss spikes: with ``k`` = ``train.spike_factor`` > 0 and ``W`` = ``train.spike_window``, the
    loss ``L_s`` of step ``s`` is a spike when the window is full and

        L_s > k * median(L_{a_1}, ..., L_{a_W})

    over the losses of the last ``W`` applied (not skipped) steps ``a_1 < ... < a_W < s`` (the median
    of an even count is the mean of the two middle values). Non-finite losses are no spikes (the
    non-finite rule owns them). Megatron's rerun state machine compares with the largest of the first
    100 losses (``is_unexpectedly_large``); a running median follows the falling loss and ignores outliers."""

    def __init__(self, factor: float, window: int):
        self.factor = float(factor)
        self.window: deque[float] = deque(maxlen=max(1, int(window)))

    def is_spike(self, loss: float) -> bool:
        if self.factor <= 0 or not math.isfinite(loss) or len(self.window) < self.window.maxlen:
            return False
        return loss > self.factor * statistics.median(self.window)

    def record(self, loss: float) -> None:
        """The loss of an applied step enters the window."""
        if self.factor > 0 and math.isfinite(loss):
            self.window.append(loss)


class StepGuard:
    """The decision and bookkeeping of one run (built by :func:`install`)."""

    def __init__(self, engine, train_cfg):
        t = train_cfg
        self.engine = engine
        self.skip_nonfinite = bool(t.skip_nonfinite)
        self.spike = SpikeRule(t.spike_factor, t.spike_window)
        self.max_skips = int(t.max_skips)
        self.gas = engine.gradient_accumulation_steps()
        # DeepSpeed's ZeRO and bf16 optimizers carry an ``overflow`` flag and check the global norm themselves
        self.check_grads = not hasattr(engine.optimizer, "overflow")
        self._loss = None  # this rank's summed micro-batch losses of the step (a tensor: no host sync)
        self.mean_loss = float("nan")  # the step's loss, mean over data-parallel ranks and micro-batches
        self.reason: str | None = None  # why the last step was skipped (None: applied)
        self.consecutive = 0

    # ------------------------------------------------------------------ inside engine.backward / step

    def observe(self, loss: torch.Tensor) -> None:
        l = loss.detach().double()
        self._loss = l if self._loss is None else self._loss + l

    def decide(self) -> str | None:
        """The skip reason of this step (None: apply it), the same on every rank: one all-reduce (sum)
        over the world of [losses, non-finite-gradient flag]; tensor-parallel ranks hold the same loss,
        so the world mean is the data-parallel mean."""
        dev = self.engine.device
        loss = self._loss if self._loss is not None else torch.zeros((), dtype=torch.float64, device=dev)
        self._loss = None
        t = torch.stack([loss.to(dev), self._local_grads_nonfinite().to(dev, torch.float64)])
        world = 1
        if torch.distributed.is_initialized():
            torch.distributed.all_reduce(t)
            world = torch.distributed.get_world_size()
        total, bad_grads = t.tolist()
        self.mean_loss = total / (world * self.gas)
        if self.skip_nonfinite and not math.isfinite(self.mean_loss):
            return "non-finite loss"
        if self.skip_nonfinite and bad_grads > 0:
            return "non-finite gradient norm"
        if self.spike.is_spike(self.mean_loss):
            return f"loss spike: {self.mean_loss:.4g} > {self.spike.factor:g} x median {statistics.median(self.spike.window):.4g}"
        return None

    def _local_grads_nonfinite(self) -> torch.Tensor:
        """1 where this rank's gradients (already reduced over data-parallel ranks) hold a non-finite
        value; only where the engine steps torch's optimizer itself, else 0 (see the module docstring)."""
        if not (self.check_grads and self.skip_nonfinite):
            return torch.zeros(())
        grads = [p.grad for p in self.engine.module.parameters() if p.grad is not None]
        if not grads:
            return torch.zeros(())
        return (~torch.isfinite(torch.nn.utils.get_total_norm(grads))).double()

    def take_model_step(self, original, lr_kwargs=None):
        """``engine._take_model_step`` with the decision first; a skip takes DeepSpeed's own path with
        nothing applied."""
        engine = self.engine
        self.reason = self.decide()
        if self.reason is None:
            original(lr_kwargs)
            if not _applied(engine):  # DeepSpeed's optimizer found a non-finite global gradient norm
                self.reason = "non-finite gradient norm"
            return
        with _nothing_applied(engine):
            original(lr_kwargs)
        if _applied(engine):  # DeepSpeed stepped (a no-op): count the skip as its overflow path does
            engine._step_applied = False
            engine.skipped_steps += 1

    def state_dict(self) -> dict:
        return {"window": list(self.spike.window), "consecutive": self.consecutive}

    def load_state_dict(self, state: dict) -> None:
        self.spike.window.extend(float(x) for x in state.get("window", ()))
        self.consecutive = int(state.get("consecutive", 0))

    # ------------------------------------------------------------------------- after the step (trainer)

    def account(self, step: int, metrics: dict, progress) -> bool:
        """Add ``skipped`` (0/1) and ``skipped_steps`` (in all, DeepSpeed's count, restored on resume)
        to the step's metrics; rank 0 prints one line for a skipped step. True if it was skipped."""
        skipped = self.reason is not None
        metrics["skipped"] = int(skipped)
        metrics["skipped_steps"] = int(self.engine.skipped_steps)
        if not skipped:
            self.consecutive = 0
            self.spike.record(self.mean_loss)
            return False
        self.consecutive += 1
        progress.write(
            f"megahash: step {step} skipped ({self.reason}): no update on any rank, LR schedule held; "
            f"{self.consecutive} consecutive, {self.engine.skipped_steps} in all"
        )
        return True

    def stop_if_stuck(self, step: int, samples: tuple[int, int]) -> None:
        """After ``max_skips`` consecutive skips: one line naming the step and its global sample indices
        ``samples`` = (consumed before the step, consumed after it; megahash.data.samples.consumed_samples)."""
        if not self.max_skips or self.consecutive < self.max_skips:
            return
        first, last = samples[0], samples[1] - 1
        raise SkippedStepsError(
            f"{self.consecutive} consecutive optimizer steps skipped (train.max_skips={self.max_skips}); the last, "
            f"step {step} ({self.reason}), read global samples {first}-{last} of the train dataset; lower train.lr, "
            f"inspect those samples, or raise train.max_skips"
        )


def _applied(engine) -> bool:
    """Whether DeepSpeed's last ``_take_model_step`` applied its update (not its overflow path)."""
    return getattr(engine, "_step_applied", not getattr(engine.optimizer, "overflow", False))


@contextlib.contextmanager
def _nothing_applied(engine):
    """During the call: the base optimizer's ``step`` does nothing and the engine has no LR scheduler."""
    base = engine.basic_optimizer if engine.basic_optimizer is not None else engine.optimizer
    own = vars(base).get("step")  # an instance-level ``step`` (a wrapper some library put there) is kept
    scheduler = engine.lr_scheduler
    base.step = lambda *args, **kwargs: None
    engine.lr_scheduler = None
    try:
        yield
    finally:
        engine.lr_scheduler = scheduler
        if own is not None:
            base.step = own
        else:
            del base.step


def install(engine, train_cfg) -> StepGuard | None:
    """The run's guard, wrapping ``engine.backward`` (to see the losses) and ``engine._take_model_step``
    on the instance; None (nothing wrapped) when ``skip_nonfinite`` is off and ``spike_factor`` is 0."""
    t = train_cfg
    if not t.skip_nonfinite and not t.spike_factor:
        return None
    guard = StepGuard(engine, t)
    if t.skip_nonfinite and engine.bfloat16_enabled() and hasattr(engine.optimizer, "check_grad_overflow"):
        engine.optimizer.check_grad_overflow = True  # bf16 ZeRO 1-2 would otherwise clip with a NaN norm
    backward, take_step = engine.backward, engine._take_model_step

    def guarded_backward(loss, *args, **kwargs):
        guard.observe(loss)
        return backward(loss, *args, **kwargs)

    engine.backward = guarded_backward
    engine._take_model_step = lambda lr_kwargs=None: guard.take_model_step(take_step, lr_kwargs)
    return guard


def checkpoint_extra(guard: StepGuard | None) -> dict:
    """What a checkpoint's state file (``megahash_state.json``, the same on every rank) keeps of the
    guard: the spike window and the consecutive count, so a resume at any layout, from a synchronous
    or an asynchronous save, decides as the uninterrupted run would."""
    return {_STATE_KEY: guard.state_dict()} if guard is not None else {}


def restore(guard: StepGuard | None, state: dict) -> None:
    """The guard's state from a checkpoint's state file (nothing when it was saved without one)."""
    if guard is not None and _STATE_KEY in state:
        guard.load_state_dict(state[_STATE_KEY])


_STATE_KEY = "step_guard"
