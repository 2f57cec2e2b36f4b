"""Samples consumed by the first ``s`` optimizer steps and the global batch of each step, a pure
function of the train config (``train.global_batch_size``, ``train.batch_ramp``: the ramp's arithmetic
is megahash/training/batch_ramp.py's docstring). The training loop, the checkpoint record, the LR
schedule in samples, ``import-hf`` and the model card of ``export-hf`` all count with it.
"""

from __future__ import annotations

_RAMPS: dict[
    tuple, dict
] = {}  # (START, INCREMENT, SAMPLES, G, micro batch) -> {"c": consumed before step s, "end": first step at G}


def ramp_on(t) -> bool:
    return bool(getattr(t, "batch_ramp", None))


def _calculator(t):
    """megatron-core's ramp calculator at one data-parallel rank (the batch does not depend on DP; the DP
    divisibility is checked with the world's size in ds_config.deepspeed_config)."""
    from megatron.core.num_microbatches_calculator import RampupBatchsizeNumMicroBatchesCalculator

    start, inc, samples = (int(v) for v in t.batch_ramp)
    return RampupBatchsizeNumMicroBatchesCalculator(
        t.global_batch_size,
        t.micro_batch_size,
        1,
        decrease_batch_size_if_needed=False,
        rank=1,  # rank 0 logs each change to megatron's logger; megahash logs the batch itself
        start_global_batch_size=start,
        batch_size_increment=inc,
        ramup_samples=samples,
    )


def _ramp(t, step: int) -> dict:
    """The ramp's steps so far: ``c[s]`` samples consumed before step ``s``, up to ``step`` or to ``end``,
    the first step that takes G (from there on every step does), once it is known."""
    key = (*(int(v) for v in t.batch_ramp), t.global_batch_size, t.micro_batch_size)
    ramp = _RAMPS.setdefault(key, {"c": [0], "end": None})
    c = ramp["c"]
    if ramp["end"] is not None or len(c) > step:
        return ramp
    calc = _calculator(t)
    while len(c) <= step:
        calc.update(c[-1], consistency_check=True)
        batch = calc.get_current_global_batch_size()
        if batch == t.global_batch_size:
            ramp["end"] = len(c) - 1
            break
        c.append(c[-1] + batch)
    return ramp


def consumed_samples(t, step: int) -> int:
    """Samples consumed by the first ``step`` optimizer steps: ``step x G`` without a ramp, else the sum of
    the ramp's batches (each the calculator's value at the samples consumed before its step)."""
    if not ramp_on(t):
        return step * t.global_batch_size
    ramp = _ramp(t, step)
    end = ramp["end"]
    if end is None or step <= end:
        return ramp["c"][step]
    return ramp["c"][end] + (step - end) * t.global_batch_size


def step_batch(t, step: int) -> int:
    """Global batch (sequences) of 0-based optimizer step ``step``."""
    return consumed_samples(t, step + 1) - consumed_samples(t, step)
