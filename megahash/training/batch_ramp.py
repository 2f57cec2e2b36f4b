"""Batch-size ramp (``train.batch_ramp`` = [START, INCREMENT, SAMPLES], Megatron's ``--rampup-batch-size``)
and the consumed-sample count of every step.

The global batch of a step is megatron-core's ``RampupBatchsizeNumMicroBatchesCalculator`` at the samples
consumed before it: with ``n = (G - START) / INCREMENT`` increments (``G`` = ``train.global_batch_size``),
``batch(c) = START + INCREMENT * int(c / (SAMPLES / n))`` while ``c <= SAMPLES``, then ``G``. Every batch is
a multiple of micro_batch_size x data-parallel size (config_checks.check_batch_ramp), so a step runs
``batch / (micro_batch_size x DP)`` micro-batches: DeepSpeed's gradient accumulation steps
(``engine.set_train_batch_size``: engine_patches.set_batch), the micro-batch itself never changes.

:func:`megahash.data.samples.consumed_samples` is the one place the samples consumed by the first ``s`` steps come from (``s x G``
without a ramp): the loader's start, the logged ``consumed_samples``/``consumed_tokens``, the checkpoint's
record, DeepSpeed's sample counter on an elastic resume and the LR schedule in samples
(megahash/training/lr_schedule.py). It is a pure function of the train config, so a resume at step ``s``
reads exactly the samples the uninterrupted run would.
"""

from __future__ import annotations

from megahash.data.samples import consumed_samples, ramp_on, step_batch
from megahash.errors import CheckpointError
from megahash.training import engine_patches
from megahash.training.hooks import Hook


def ramp_metrics(t, step: int) -> dict:
    """What the step log adds under a ramp: ``global_batch``, the sequences of 0-based step ``step``."""
    return {"global_batch": step_batch(t, step)} if ramp_on(t) else {}


class BatchRamp(Hook):
    """The ramp in the training loop: each step's global batch given to DeepSpeed, and logged."""

    def before_step(self, run) -> None:
        """The global batch of step ``run.step`` (0-based) as ``run.gas`` accumulation steps."""
        run.gas = engine_patches.set_batch(run.engine, step_batch(run.cfg.train, run.step))

    def step_metrics(self, run, metrics: dict) -> None:
        metrics.update(ramp_metrics(run.cfg.train, run.step - 1))


def hook(run) -> BatchRamp | None:
    return BatchRamp() if ramp_on(run.cfg.train) else None


def check_resume(ckpt, state: dict, cfg) -> None:
    """A checkpoint's recorded consumed samples must be this config's at its step (another
    ``train.global_batch_size``, another ramp, a ramp on or off): otherwise the data would continue
    elsewhere (``step x G`` skips or repeats samples) and so would a schedule in samples. One line."""
    if state.get("weights_only") or "consumed_samples" not in state:
        return
    step, saved = int(state.get("step", 0)), int(state["consumed_samples"])
    now = consumed_samples(cfg.train, step)
    if saved == now:
        return
    ramp = f" and train.batch_ramp={list(cfg.train.batch_ramp)}" if ramp_on(cfg.train) or _saved_ramp(ckpt) else ""
    raise CheckpointError(
        f"checkpoint {ckpt} consumed {saved} samples in {step} steps, but train.global_batch_size="
        f"{cfg.train.global_batch_size}{ramp} give {now}: resume with "
        f"the batch settings it was saved with (its resolved_config.yaml), or train.resume=none"
    )


def _saved_ramp(ckpt) -> bool:
    import yaml

    from megahash import safe_yaml

    path = ckpt / "resolved_config.yaml"
    try:
        return bool(safe_yaml.load(path.read_text(), str(path))["train"].get("batch_ramp"))
    except (OSError, KeyError, TypeError, AttributeError, yaml.YAMLError):
        return False
