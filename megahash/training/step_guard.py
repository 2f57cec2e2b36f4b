"""The bad-step guard of every run: non-finite steps (refused before the update;
``train.step_guard.skip_nonfinite`` skips them instead of stopping), the loss-spike rule
(``train.step_guard.spike_factor``, ``spike_window``) and ``train.step_guard.max_skips``.

**Decision, every rank alike, before anything is applied.** At the gradient-accumulation boundary,
inside ``engine.step()`` and before the optimizer steps (``engine._take_model_step``, wrapped on the
instance by :func:`megahash.training.engine_patches.guard_steps`), ONE all-reduce over the whole world sums
``[this rank's micro-batch losses, a gradient-norm-is-non-finite flag]``; every rank then sees the same
mean loss and the same flag and takes the same decision. A step is refused when

- the mean loss or the gradient norm is non-finite. The gradient norm is the one the step computes
  anyway: where the engine steps torch's optimizer itself (ZeRO-0 in fp32, Muon included) the decision
  waits for DeepSpeed's clipping norm (kept by :func:`megahash.training.engine_patches.keep_grad_norm`,
  global over the data- and tensor-parallel ranks) and is taken as the optimizer is called, so it costs
  no pass over the gradients; DeepSpeed's ZeRO 1-3 and bf16 optimizers compute the global norm before
  they step and take their overflow path on a non-finite one (bf16 ZeRO 1-2 only with
  ``check_grad_overflow``, which :func:`~megahash.training.engine_patches.guard_steps` turns on): nothing applied, counted here too. Under
  tensor parallelism a rank sees only its shards: the all-reduced flag makes every rank refuse (tested);
- or the mean loss is a spike (:class:`SpikeRule`): skipped.

A refused step takes DeepSpeed's own path (gradients zeroed, ZeRO buffers cleared, its step and
sample counters advanced) with the base optimizer's ``step`` a no-op and the LR scheduler detached
for the call: parameters and Adam's moments keep their bit pattern (ZeRO copies its unchanged fp32
partitions back), so a parameter never takes a non-finite value. Then, with ``train.step_guard.skip_nonfinite``
off (the default), the run stops (:meth:`StepGuard.nonfinite_error`: one line, exit 2) with the
newest checkpoint as it was (a background save in flight, of an earlier step, published first); on, the
step is skipped and training goes on. The cost of the check:
the all-reduce of two numbers and one host sync a step (``benchmarks/bench_step_guard.py``).

**Counters of a skipped step, as Megatron-LM's ``train_step`` does for an unsuccessful update**: the
data position advances (the batch is consumed, never retried: ``consumed_samples = step x global
batch``, so a resume and the sampler stay a pure function of the step) and the step counts towards
``train.steps``; the LR scheduler does NOT advance (Megatron calls ``opt_param_scheduler.step`` only
``if update_successful``, and DeepSpeed's overflow path likewise): the schedule counts applied updates,
so a skip delays the curve by one step instead of spending one of its steps on no update. DeepSpeed
checkpoints the scheduler and ``skipped_steps``, so a resume continues both. (flame's
``skip_nan_inf`` steps the scheduler anyway; megahash follows Megatron.)

After ``max_skips`` consecutive skips the run stops with one line (:class:`SkippedStepsError`, exit 2)
naming the step and its global sample indices. The spike window and the consecutive count are saved
in the checkpoint's state file (the hook's ``state_dict``, key ``step_guard``, synchronous and asynchronous
saves alike), so a resume, at this layout or another, decides as the uninterrupted run.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass

import torch

from megahash.config_checks import ranged
from megahash.errors import ConfigError, MegahashError
from megahash.training import engine_patches
from megahash.training.hooks import Hook


@dataclass
class Config:
    """``train.step_guard``: what a bad step is and what the run does about it."""

    skip_nonfinite: bool = False  # a non-finite step is skipped (training goes on) instead of stopping the run
    # a loss above spike_factor x the median loss of the last spike_window applied steps is skipped; 0 = no rule
    spike_factor: float = ranged(0.0, "[0, inf)", "skip a loss above this x the running median; 0 = off")
    spike_window: int = ranged(100, "[1, inf)", "losses in the spike rule's running median")
    max_skips: int = ranged(10, "[0, inf)", "consecutive skipped steps that stop the run; 0 = never")

    def check(self, cfg) -> None:
        if 0 < self.spike_factor <= 1:
            raise ConfigError(
                f"train.step_guard.spike_factor={self.spike_factor} must be 0 (off) or > 1 (a spike is a loss "
                f"above that many times the running median)"
            )


class SkippedStepsError(MegahashError):
    """``train.step_guard.max_skips`` consecutive optimizer steps were skipped."""


class NonFiniteStepError(MegahashError):
    """A step's loss or gradient norm was non-finite (``train.step_guard.skip_nonfinite`` off): refused, run stopped."""


NONFINITE = ("non-finite loss", "non-finite gradient norm")  # the reasons that stop a run without skip_nonfinite


class SpikeRule:
    """Loss spikes: with ``k`` = ``spike_factor`` > 0 and ``W`` = ``spike_window`` (``train.step_guard``), the
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


class StepGuard(Hook):
    """The decision and bookkeeping of one run (its hook: :func:`hook`); ``cfg`` its ``train.step_guard``."""

    def __init__(self, engine, cfg: Config):
        t = cfg
        self.engine = engine
        self.skip_nonfinite = bool(t.skip_nonfinite)
        self.spike = SpikeRule(t.spike_factor, t.spike_window)
        self.max_skips = int(t.max_skips)
        self.gas = engine.gradient_accumulation_steps()
        # DeepSpeed's ZeRO and bf16 optimizers carry an ``overflow`` flag and check the global norm themselves
        self.check_grads = not hasattr(engine.optimizer, "overflow")
        self._loss = None  # this rank's summed micro-batch losses of the step (a tensor: no host sync)
        self.mean_loss = float("nan")  # the step's loss, mean over data-parallel ranks and micro-batches
        self.reason: str | None = None  # why the last step was refused (None: applied)
        self.consecutive = 0

    # ------------------------------------------------------------------ inside engine.backward / step

    def observe(self, loss: torch.Tensor) -> None:
        l = loss.detach().double()
        self._loss = l if self._loss is None else self._loss + l

    def decide(self, grad_norm=None) -> str | None:
        """The refusal reason of this step (None: apply it), the same on every rank: one all-reduce (sum)
        over the world of [losses, ``grad_norm`` is non-finite] (``grad_norm``: a number or tensor, None:
        the optimizer checks its own norm); tensor-parallel ranks hold the same loss, so the world mean is
        the data-parallel mean. One host sync."""
        dev = self.engine.device
        loss = self._loss if self._loss is not None else torch.zeros((), dtype=torch.float64, device=dev)
        self._loss = None
        if grad_norm is None:
            bad = torch.zeros((), dtype=torch.float64, device=dev)
        else:
            bad = (~torch.isfinite(torch.as_tensor(grad_norm, device=dev))).any().to(torch.float64)
        t = torch.stack([loss.to(dev), bad])
        world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        if world > 1:
            torch.distributed.all_reduce(t)
        total, bad_grads = t.tolist()
        self.mean_loss = total / (world * self.gas)
        if not math.isfinite(self.mean_loss):
            return NONFINITE[0]
        if bad_grads > 0:
            return NONFINITE[1]
        if self.spike.is_spike(self.mean_loss):
            return f"loss spike: {self.mean_loss:.4g} > {self.spike.factor:g} x median {statistics.median(self.spike.window):.4g}"
        return None

    def take_model_step(self, original, lr_kwargs=None):
        """``engine._take_model_step`` with the decision first; a refused step takes DeepSpeed's own path
        with nothing applied."""
        engine = self.engine
        if self.check_grads:
            self.reason = self._decided_at_optimizer_step(original, lr_kwargs)
        else:
            self.reason = self.decide()
            if self.reason is None:
                original(lr_kwargs)
                if not engine_patches.applied(engine):  # DeepSpeed's optimizer found a non-finite gradient norm
                    self.reason = NONFINITE[1]
                return
            with engine_patches.nothing_applied(engine):
                original(lr_kwargs)
        # a refused step that DeepSpeed stepped (a no-op): counted as its overflow path counts one
        if self.reason is not None and engine_patches.applied(engine):
            engine_patches.count_refused(engine)

    def _decided_at_optimizer_step(self, original, lr_kwargs) -> str | None:
        """ZeRO-0 (the engine steps torch's optimizer): ``original`` with the base optimizer's ``step``
        deciding first, on DeepSpeed's clipping norm of this step (engine_patches.keep_grad_norm); a refusal
        makes it a no-op and detaches the LR scheduler for the rest of the call."""
        engine = self.engine
        reasons = []

        def deciding_step(real_step, *args, **kwargs):
            norm = engine_patches.kept_grad_norm(engine)
            reasons.append(self.decide(norm if norm is not None else _local_grad_norm(engine)))
            if reasons[0] is None:
                return real_step(*args, **kwargs)
            engine_patches.detach_scheduler(engine)
            return None

        with engine_patches.optimizer_step(engine, deciding_step):
            original(lr_kwargs)
        return reasons[0] if reasons else self.decide()  # (not called: nothing was applied)

    def state_dict(self) -> dict:
        return {"window": list(self.spike.window), "consecutive": self.consecutive}

    def load_state_dict(self, state: dict) -> None:
        self.spike.window.extend(float(x) for x in state.get("window", ()))
        self.consecutive = int(state.get("consecutive", 0))

    # ------------------------------------------------------------------------- after the step (trainer)

    def account(self, step: int, metrics: dict, progress) -> bool:
        """Add ``skipped`` (0/1) and ``skipped_steps`` (in all, DeepSpeed's count, restored on resume)
        to the step's metrics of a run that skips steps (``skip_nonfinite`` or the spike rule); rank 0
        prints one line for a skipped step. True if it was skipped."""
        skipped = self.reason is not None
        if self.skip_nonfinite or self.spike.factor > 0:
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

    @property
    def stopping(self) -> bool:
        """The last step was refused as non-finite and ``train.step_guard.skip_nonfinite`` is off: the run stops."""
        return not self.skip_nonfinite and self.reason in NONFINITE

    def nonfinite_error(self, step: int, samples: tuple[int, int], lr: float, newest) -> NonFiniteStepError:
        """The one line of a :attr:`stopping` run: the step, its global samples ``samples`` (as in
        :meth:`stop_if_stuck`), the LR and the newest checkpoint ``newest`` (None: none yet)."""
        first, last = samples[0], samples[1] - 1
        kept = f"the newest checkpoint, {newest}, is as it was" if newest else "no checkpoint was written yet"
        return NonFiniteStepError(
            f"step {step}: {self.reason} (loss {self.mean_loss:.4g} at lr {lr:.4g}, global samples {first}-{last}); "
            f"the update was not applied and the run stopped: {kept}; lower train.lr, inspect those samples, "
            f"or set train.step_guard.skip_nonfinite=true to skip such steps"
        )

    def stop_if_stuck(self, step: int, samples: tuple[int, int]) -> None:
        """After ``max_skips`` consecutive skips: one line naming the step and its global sample indices
        ``samples`` = (consumed before the step, consumed after it; megahash.data.samples.consumed_samples)."""
        if not self.max_skips or self.consecutive < self.max_skips:
            return
        first, last = samples[0], samples[1] - 1
        raise SkippedStepsError(
            f"{self.consecutive} consecutive optimizer steps skipped (train.step_guard.max_skips={self.max_skips}); the last, "
            f"step {step} ({self.reason}), read global samples {first}-{last} of the train dataset; lower train.lr, "
            f"inspect those samples, or raise train.step_guard.max_skips"
        )


def _local_grad_norm(engine):
    """This rank's gradient norm (an engine without megahash.training.grad_norm's kept norm; one pass)."""
    grads = [p.grad for p in engine.module.parameters() if p.grad is not None]
    return torch.nn.utils.get_total_norm(grads) if grads else None


class _Hook(StepGuard):
    """The guard in the training loop: a refused non-finite step stops the run before it counts; a
    skipped one is accounted for and shown with the step's metrics."""

    def after_step(self, run) -> None:
        """A non-finite step the guard refused with ``skip_nonfinite`` off (every rank alike): a background
        save in flight (of an earlier, finite step) is published first, then one line naming the newest
        checkpoint."""
        if not self.stopping:
            return
        from megahash.training.checkpoint import find_resume

        run.saver.flush()
        step, lr = run.step + 1, float(run.engine.get_lr()[0])  # a refused step left the LR where it was
        samples = (run.consumed(step - 1), run.consumed(step))
        raise self.nonfinite_error(step, samples, lr, find_resume(run.save_dir))

    def step_metrics(self, run, metrics: dict) -> None:
        if self.account(run.step, metrics, run.progress):
            run.echo = True  # a skipped step's line is always shown
            self.stop_if_stuck(run.step, (run.consumed(run.step - 1), run.consumed(run.step)))


def install(engine, cfg: Config, cls: type[StepGuard] = StepGuard) -> StepGuard:
    """A guard of ``engine`` (``cfg``: ``train.step_guard``) wrapping its ``backward`` and ``_take_model_step``
    (megahash/training/engine_patches.py)."""
    guard = cls(engine, cfg)
    engine_patches.guard_steps(engine, guard.observe, guard.take_model_step)
    return guard


def hook(run) -> StepGuard:
    """Every run's guard (non-finite steps are refused before the update)."""
    return install(run.engine, run.cfg.train.step_guard, _Hook)
