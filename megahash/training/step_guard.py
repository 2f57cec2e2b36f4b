"""The bad-step guard of every run: non-finite steps (refused before the update; ``train.skip_nonfinite``
skips them instead of stopping), the loss-spike rule (``train.spike_factor``, ``train.spike_window``) and
``train.max_skips``.

**Decision, every rank alike, before anything is applied.** At the gradient-accumulation boundary,
inside ``engine.step()`` and before the optimizer steps (``engine._take_model_step``, wrapped on the
instance as :mod:`megahash.training.grad_norm` does), ONE all-reduce over the whole world sums
``[this rank's micro-batch losses, a gradient-norm-is-non-finite flag]``; every rank then sees the same
mean loss and the same flag and takes the same decision. A step is refused when

- the mean loss or the gradient norm is non-finite. The gradient norm is the one the step computes
  anyway: where the engine steps torch's optimizer itself (ZeRO-0 in fp32, Muon included) the decision
  waits for DeepSpeed's clipping norm (kept by :func:`megahash.training.grad_norm.keep_zero0_grad_norm`,
  global over the data- and tensor-parallel ranks) and is taken as the optimizer is called, so it costs
  no pass over the gradients; DeepSpeed's ZeRO 1-3 and bf16 optimizers compute the global norm before
  they step and take their overflow path on a non-finite one (bf16 ZeRO 1-2 only with
  ``check_grad_overflow``, which :func:`install` turns on): nothing applied, counted here too. Under
  tensor parallelism a rank sees only its shards: the all-reduced flag makes every rank refuse (tested);
- or the mean loss is a spike (:class:`SpikeRule`): skipped.

A refused step takes DeepSpeed's own path (gradients zeroed, ZeRO buffers cleared, its step and
sample counters advanced) with the base optimizer's ``step`` a no-op and the LR scheduler detached
for the call: parameters and Adam's moments keep their bit pattern (ZeRO copies its unchanged fp32
partitions back), so a parameter never takes a non-finite value. Then, with ``train.skip_nonfinite``
off (the default), the run stops (:meth:`StepGuard.nonfinite_error`: one line, exit 2) with the
newest checkpoint as it was; on, the step is skipped and training goes on. The cost of the check:
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


class NonFiniteStepError(MegahashError):
    """A step's loss or gradient norm was non-finite (``train.skip_nonfinite`` off): refused, run stopped."""


NONFINITE = ("non-finite loss", "non-finite gradient norm")  # the reasons that stop a run without skip_nonfinite


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
                if not _applied(engine):  # DeepSpeed's optimizer found a non-finite global gradient norm
                    self.reason = NONFINITE[1]
                return
            with _nothing_applied(engine):
                original(lr_kwargs)
        # a refused step that DeepSpeed stepped (a no-op): counted as its overflow path counts one
        if self.reason is not None and _applied(engine):
            engine._step_applied = False
            engine.skipped_steps += 1

    def _decided_at_optimizer_step(self, original, lr_kwargs) -> str | None:
        """ZeRO-0 (the engine steps torch's optimizer): ``original`` with the base optimizer's ``step``
        deciding first, on DeepSpeed's clipping norm of this step (megahash.training.grad_norm); a refusal
        makes it a no-op and detaches the LR scheduler for the rest of the call."""
        engine = self.engine
        reasons = []

        def deciding_step(real_step, *args, **kwargs):
            norm = getattr(engine, "_megahash_grad_norm", None)
            reasons.append(self.decide(norm if norm is not None else _local_grad_norm(engine)))
            if reasons[0] is None:
                return real_step(*args, **kwargs)
            engine.lr_scheduler = None
            return None

        with _optimizer_step(engine, deciding_step):
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
        """The last step was refused as non-finite and ``train.skip_nonfinite`` is off: the run stops."""
        return not self.skip_nonfinite and self.reason in NONFINITE

    def nonfinite_error(self, step: int, samples: tuple[int, int], lr: float, newest) -> NonFiniteStepError:
        """The one line of a :attr:`stopping` run: the step, its global samples ``samples`` (as in
        :meth:`stop_if_stuck`), the LR and the newest checkpoint ``newest`` (None: none yet)."""
        first, last = samples[0], samples[1] - 1
        kept = f"the newest checkpoint, {newest}, is as it was" if newest else "no checkpoint was written yet"
        return NonFiniteStepError(
            f"step {step}: {self.reason} (loss {self.mean_loss:.4g} at lr {lr:.4g}, global samples {first}-{last}); "
            f"the update was not applied and the run stopped: {kept}; lower train.lr, inspect those samples, "
            f"or set train.skip_nonfinite=true to skip such steps"
        )

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


def _local_grad_norm(engine):
    """This rank's gradient norm (an engine without megahash.training.grad_norm's kept norm; one pass)."""
    grads = [p.grad for p in engine.module.parameters() if p.grad is not None]
    return torch.nn.utils.get_total_norm(grads) if grads else None


def _applied(engine) -> bool:
    """Whether DeepSpeed's last ``_take_model_step`` applied its update (not its overflow path)."""
    return getattr(engine, "_step_applied", not getattr(engine.optimizer, "overflow", False))


@contextlib.contextmanager
def _optimizer_step(engine, step):
    """During the call: the base optimizer's ``step(*args)`` is ``step(its own step, *args)``; the engine's
    LR scheduler is put back afterwards (a refused step detaches it)."""
    base = engine.basic_optimizer if engine.basic_optimizer is not None else engine.optimizer
    own = vars(base).get("step")  # an instance-level ``step`` (a wrapper some library put there) is kept
    real, scheduler = base.step, engine.lr_scheduler
    base.step = lambda *args, **kwargs: step(real, *args, **kwargs)
    try:
        yield
    finally:
        engine.lr_scheduler = scheduler
        if own is not None:
            base.step = own
        else:
            del base.step


@contextlib.contextmanager
def _nothing_applied(engine):
    """During the call: the base optimizer's ``step`` does nothing and the engine has no LR scheduler."""
    with _optimizer_step(engine, lambda real, *args, **kwargs: None):
        engine.lr_scheduler = None
        yield


def install(engine, train_cfg) -> StepGuard:
    """The run's guard (every run: non-finite steps are refused before the update), wrapping
    ``engine.backward`` (to see the losses) and ``engine._take_model_step`` on the instance."""
    t = train_cfg
    guard = StepGuard(engine, t)
    if engine.bfloat16_enabled() and hasattr(engine.optimizer, "check_grad_overflow"):
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
