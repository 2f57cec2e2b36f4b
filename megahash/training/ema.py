"""``train.ema_decay``: an exponential moving average of the weights (Polyak averaging), as torchtitan,
timm and the Parameter Golf entries keep it.

After every optimizer step ``ema = d * ema + (1 - d) * w`` (fp32, two roundings: ``_foreach_mul_`` then
``_foreach_add_``), starting from the weights the run starts with, so after k steps

    ema_k = d^k w_0 + (1 - d) * sum_{i=1..k} d^(k-i) w_i                                    (closed form)

``train.ema_warmup=true`` uses timm's warmup correction (``ModelEmaV2``/``ModelEmaV3``'s
``min(d, (1 + n) / (10 + n))``, n = the optimizer steps before this one; torchtitan has none): the
decay of step k is d_k, and ema_k = (prod_j d_j) w_0 + sum_i (1 - d_i) (prod_{j>i} d_j) w_i. Without it
w_0 keeps a weight d^k, so choose d with 1/(1-d) well below the steps.
A skipped step (train.skip_nonfinite) still updates the average (towards unchanged weights).

Where it lives: over what each rank holds of every trainable parameter. Under ZeRO 0-2 that is the
module parameter (its tensor-parallel shard, complete on every data-parallel rank): the average costs
one fp32 copy of the rank's model, 4 bytes per parameter / TP size. Under ZeRO-3 it is the rank's
partition ``p.ds_tensor``: 4 bytes per parameter / (TP x DP size); saving, loading and validating gather
the partitions like the live weights' save does (``weights.gathered``).

Checkpoint: ``step_N/ema/``, a megatron dist checkpoint written from the model's own
``sharded_state_dict`` with the averages in place of the weights (so it loads at any TP size like
``model/``: evaluation and export read it with ``--weights ema``), then the live weights copied back
bit-exactly. Resume loads it the same way; a checkpoint without one (EMA switched on mid-run) starts
the average from the resumed weights.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from megahash.checkpoint.layout import EMA_DIR
from megahash.checkpoint.weights import gathered, load_weights, save_weights

ATTR = "_megahash_ema"  # the engine attribute the checkpoint hooks read


class WeightEMA:
    """The fp32 averages of ``module``'s trainable parameters (this rank's shards)."""

    def __init__(self, module: torch.nn.Module, decay: float, warmup: bool = False):
        self.decay, self.warmup = float(decay), bool(warmup)
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
        with torch.no_grad():
            for p, a in zip(self.params, self.avg):
                p.copy_(a)
        try:
            yield
        finally:
            with torch.no_grad():
                for p, w in zip(self.params, live):
                    p.copy_(w)

    @torch.no_grad()
    def take_from_module(self) -> None:
        """Read the averages back from the module's parameters (after loading ``ema/`` into them)."""
        for a, p in zip(self.avg, self.params):
            a.copy_(p.detach().float())


def install(engine, t) -> WeightEMA | None:
    """The run's average when ``train.ema_decay`` > 0 (kept on the engine for the checkpoint hooks)."""
    ema = WeightEMA(engine.module, t.ema_decay, t.ema_warmup) if t.ema_decay > 0 else None
    setattr(engine, ATTR, ema)
    return ema


def update(run) -> None:
    """After each optimizer step (``run.step``: the steps before it, restored on resume)."""
    if run.ema is not None:
        run.ema.update(run.step)


def save(engine, directory: Path, zero_stage: int, async_queue=None) -> None:
    """Collective: ``directory/ema/`` when the run keeps an average (the write is scheduled, or done,
    before the live weights are copied back: the asynchronous writer's fork is its snapshot)."""
    ema = getattr(engine, ATTR, None)
    if ema is None:
        return
    with ema.swapped_in():
        save_weights(engine.module, Path(directory) / EMA_DIR, zero_stage, async_queue)


def restore(run, ckpt: Path | None) -> None:
    """On resume: the average saved with ``ckpt``; without one, the resumed weights (rank 0 says so)."""
    ema = run.ema
    if ema is None or ckpt is None:
        return
    if not (Path(ckpt) / EMA_DIR).is_dir():
        ema.reset()
        if run.rank == 0:
            print(f"megahash: {ckpt} has no {EMA_DIR}/; the weight average starts from the resumed weights", flush=True)
        return
    with ema.swapped_in():
        with gathered(run.engine.module, run.cfg.train.zero_stage, modifier_rank=0):  # ZeRO-3: re-partitioned after
            load_weights(run.engine.module, Path(ckpt) / EMA_DIR)
        ema.take_from_module()


def metrics(run, loss_of, ppl: bool) -> dict:
    """Validation of the averaged weights: ``ema_loss`` (``ema_ppl`` with ``ppl``) from ``loss_of()``
    evaluated with the averages swapped in; a dict from ``loss_of`` gives ``ema_<key>`` per key."""
    if run.ema is None:
        return {}
    import math

    with run.ema.swapped_in():
        out = loss_of()
    out = out if isinstance(out, dict) else {"loss": out}
    res = {f"ema_{k}": v for k, v in out.items()}
    if ppl and "loss" in out:
        res["ema_ppl"] = math.exp(min(out["loss"], 50.0))
    return res
