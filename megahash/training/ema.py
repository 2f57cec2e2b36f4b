"""``train.ema.decay``: an exponential moving average of the weights (Polyak averaging), as torchtitan,
timm and the Parameter Golf entries keep it.

After every optimizer step ``ema = d * ema + (1 - d) * w`` (fp32, two roundings: ``_foreach_mul_`` then
``_foreach_add_``), starting from the weights the run starts with, so after k steps

    ema_k = d^k w_0 + (1 - d) * sum_{i=1..k} d^(k-i) w_i                                    (closed form)

``train.ema.warmup=true`` uses timm's warmup correction (``ModelEmaV2``/``ModelEmaV3``'s
``min(d, (1 + n) / (10 + n))``, n = the optimizer steps before this one; torchtitan has none): the
decay of step k is d_k, and ema_k = (prod_j d_j) w_0 + sum_i (1 - d_i) (prod_{j>i} d_j) w_i. Without it
w_0 keeps a weight d^k, so choose d with 1/(1-d) well below the steps.
A skipped step (train.step_guard.skip_nonfinite) still updates the average (towards unchanged weights).

Where it lives: over what each rank holds of every trainable parameter. Under ZeRO 0-2 that is the
module parameter (its tensor-parallel shard, complete on every data-parallel rank): the average costs
one fp32 copy of the rank's model, 4 bytes per parameter / TP size. Under ZeRO-3 it is the rank's
partition ``p.ds_tensor``: 4 bytes per parameter / (TP x DP size); saving, loading and validating gather
the partitions like the live weights' save does (``weights.gathered``). DeepSpeed keeps the parameters it
gathered for a forward pass (up to ``stage3_max_reuse_distance``) and reuses them at the next one, so the
swap releases them (``engine.empty_partition_cache``) on both sides: before, the averages' validation at 2
ranks reused the live weights gathered by the first pass (``ema_loss`` = ``loss``).

Checkpoint: ``step_N/ema/``, a megatron dist checkpoint written from the model's own
``sharded_state_dict`` with the averages in place of the weights (so it loads at any TP size like
``model/``: evaluation and export read it with ``--weights ema``), then the live weights copied back
bit-exactly. Resume loads it the same way; a checkpoint without one (EMA switched on mid-run) starts
the average from the resumed weights.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

import torch

from megahash.checkpoint.layout import EMA_DIR
from megahash.checkpoint.weights import gathered, load_weights, save_weights
from megahash.config_checks import ranged
from megahash.training.hooks import Hook


@dataclass
class Config:
    """``train.ema``: the weight average (docs/compact_models.md)."""

    decay: float = ranged(0.0, "[0, 1)", "decay of the weight average; 0 = off")
    warmup: bool = False  # timm's warmup correction: decay min(decay, (1 + n) / (10 + n)) after n steps


class WeightEMA(Hook):
    """The fp32 averages of ``module``'s trainable parameters (this rank's shards); the run's hook."""

    def __init__(self, module: torch.nn.Module, decay: float, warmup: bool = False, release=None):
        self.decay, self.warmup = float(decay), bool(warmup)
        self.release = release or (lambda: None)  # ZeRO-3: drops DeepSpeed's gathered copies (module docstring)
        # this rank's part: the parameter, or its ZeRO-3 partition
        self.params = [getattr(p, "ds_tensor", p) for p in module.parameters() if p.requires_grad]
        self.avg = [p.detach().float().clone() for p in self.params]

    def decay_at(self, n: int) -> float:
        """d, or with the warmup correction min(d, (1 + n) / (10 + n)) after n updates."""
        return min(self.decay, (1.0 + n) / (10.0 + n)) if self.warmup else self.decay

    @torch.no_grad()
    def update(self, n: int = 0) -> None:
        """ema = d_n * ema + (1 - d_n) * w (module docstring); ``n``: the optimizer steps before this one."""
        d = self.decay_at(n)
        torch._foreach_mul_(self.avg, d)
        torch._foreach_add_(self.avg, [p.detach().float() for p in self.params], alpha=1.0 - d)

    @torch.no_grad()
    def reset(self) -> None:
        for a, p in zip(self.avg, self.params):
            a.copy_(p.detach().float())

    @contextlib.contextmanager
    def swapped_in(self):
        """The averages in the module's parameters for the block; the live weights restored exactly after."""
        live = [p.detach().clone() for p in self.params]
        self.release()  # forward passes in the block gather the averages, not the live weights gathered before
        with torch.no_grad():
            for p, a in zip(self.params, self.avg):
                p.copy_(a)
        try:
            yield
        finally:
            with torch.no_grad():
                for p, w in zip(self.params, live):
                    p.copy_(w)
            self.release()  # and the next step's forward gathers the live weights, not the averages

    @torch.no_grad()
    def take_from_module(self) -> None:
        """Read the averages back from the module's parameters (after loading ``ema/`` into them)."""
        for a, p in zip(self.avg, self.params):
            a.copy_(p.detach().float())

    # ------------------------------------------------------------------ the hook

    def after_step(self, run) -> None:
        """After each optimizer step (``run.step``: the steps before it, restored on resume)."""
        self.update(run.step)

    def valid_metrics(self, run, evaluate) -> dict:
        """Validation of the averaged weights: ``ema_<key>`` per key of ``evaluate()`` (loss, ppl, bpb)
        evaluated with the averages swapped in."""
        with self.swapped_in():
            out = evaluate()
        return {f"ema_{k}": v for k, v in out.items()}

    def save_files(self, engine, folder: Path, zero_stage: int, async_queue=None) -> list[str]:
        """Collective: ``folder/ema/`` (the write is scheduled, or done, before the live weights are copied
        back: the asynchronous writer's fork is its snapshot)."""
        with self.swapped_in():
            save_weights(engine.module, Path(folder) / EMA_DIR, zero_stage, async_queue)
        return [EMA_DIR]

    def load_files(self, run, ckpt: Path) -> None:
        """On resume: the average saved with ``ckpt``; without one, the resumed weights (rank 0 says so)."""
        if not (Path(ckpt) / EMA_DIR).is_dir():
            self.reset()
            if run.rank == 0:
                print(
                    f"megahash: {ckpt} has no {EMA_DIR}/; the weight average starts from the resumed weights",
                    flush=True,
                )
            return
        with self.swapped_in():
            with gathered(run.engine.module, run.cfg.train.zero_stage, modifier_rank=0):  # ZeRO-3: re-partitioned
                load_weights(run.engine.module, Path(ckpt) / EMA_DIR)
            self.take_from_module()


def hook(run) -> WeightEMA | None:
    """The run's average when ``train.ema.decay`` > 0."""
    e = run.cfg.train.ema
    if e.decay <= 0:
        return None
    zero3 = run.engine.zero_optimization_stage() == 3
    return WeightEMA(run.engine.module, e.decay, e.warmup, run.engine.empty_partition_cache if zero3 else None)
