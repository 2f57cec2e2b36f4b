"""Sequence-length warm-up (``train.seq_warmup``; docs/compact_models.md): the first ``steps`` optimizer steps
train on the first L(s) tokens of each sample, L rising linearly from ``start`` to ``data.seq_length``.

The schedule is DeepSpeed's curriculum learning with the ``seqlen`` metric, ``fixed_linear`` schedule [Li22]
(``deepspeed.runtime.data_pipeline.curriculum_scheduler.CurriculumScheduler``, called here, not rewritten)
at 0-based optimizer step s:

    x = floor(start + (S - start) s / W);   L(s) = min(S, max(start, x - x mod m))    (s < W)
    L(s) = S                                                                           (s >= W)

with S = ``data.seq_length``, W = ``steps``, m = ``multiple`` (DeepSpeed's ``difficulty_step``: 8 for tensor
cores; ``start`` is a multiple of it). Step 0 trains at ``start`` (DeepSpeed's data sampler evaluates its
schedule at 1-based curriculum steps, so its first step is one increment above; megahash starts where its other
warm-ups start, at step 0). The batch is truncated to its first L tokens as Megatron-DeepSpeed's ``pretrain_gpt.py`` truncates it
(``tokens[:, :curriculum_seqlen]``, labels, loss mask, position ids alike): every field of a micro-batch is
[b, s, ...] and cut along s (megahash/training/trainer.py ``truncated``). Document ids and positions of packed
documents are prefix sums of the tokens (megahash/data/documents.py), so the prefix of each is exactly what the
truncated tokens would give. The samples read are unchanged (the loader, ``consumed_samples``, the LR schedule in
samples and a resume move as without the warm-up; the rest of each sample is not trained on), and L is a pure
function of the step, so a resume continues it bit-exactly.

Tokens: ``consumed_tokens`` stays what the loader read (samples x ``data.seq_length``, the one counter of the
validation records and the plots' token axis); the step log adds ``seq_length`` (the step's L) and
``trained_tokens`` (sum over the steps so far of their batch x L: Megatron-DeepSpeed's ``consumed_train_tokens``
under curriculum learning), and ``tokens_per_s`` counts the tokens trained on.

[Li22] C. Li, M. Zhang, Y. He, "The Stability-Efficiency Dilemma: Investigating Sequence Length Warmup for
Training GPT Models", NeurIPS 2022 (arXiv:2108.06084).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from megahash.config_checks import ranged
from megahash.errors import ConfigError
from megahash.training.hooks import Hook


@dataclass
class Config:
    """``train.seq_warmup``: ``steps`` > 0 trains the first ``steps`` optimizer steps on sequences rising
    linearly from ``start`` tokens to ``data.seq_length``, every length a multiple of ``multiple``
    (DeepSpeed's seqlen curriculum, ``fixed_linear``; module docstring)."""

    steps: int = ranged(0, "[0, inf)", "optimizer steps of the sequence-length warm-up (0: none)")
    start: int = ranged(64, "[1, inf)", "sequence length at the first step of the warm-up")
    multiple: int = ranged(8, "[1, inf)", "every warm-up length is a multiple of this (DeepSpeed's difficulty_step)")

    def check(self, cfg) -> None:
        """One line where the warm-up cannot run: a start above ``data.seq_length`` or not a multiple of
        ``multiple``; under sequence parallelism a ``multiple`` that the tensor-parallel size does not divide
        (each rank holds L / TP positions)."""
        if self.steps == 0:
            return
        s, p = cfg.data.seq_length, cfg.parallel
        if self.start > s:
            raise ConfigError(
                f"train.seq_warmup.start={self.start} exceeds data.seq_length={s}; lower the start "
                f"or set train.seq_warmup.steps=0"
            )
        if self.start % self.multiple:
            raise ConfigError(
                f"train.seq_warmup.start={self.start} is not a multiple of train.seq_warmup.multiple={self.multiple}; "
                f"pick a start among {self.multiple * max(1, self.start // self.multiple)} and "
                f"{self.multiple * (self.start // self.multiple + 1)}"
            )
        if p.sequence and self.multiple % p.tensor:
            raise ConfigError(
                f"train.seq_warmup.multiple={self.multiple} must be a multiple of parallel.tensor={p.tensor} under "
                f"sequence parallelism (each rank holds length / {p.tensor} positions); set it to "
                f"{math.lcm(self.multiple, p.tensor)}"
            )


def length_at(w: Config, seq_length: int, step: int) -> int:
    """Tokens per sequence at 0-based optimizer step ``step`` (module docstring): DeepSpeed's ``fixed_linear``
    seqlen difficulty at ``step`` during the warm-up (``start`` at step 0), ``seq_length`` from step ``steps``."""
    if step >= w.steps:
        return seq_length
    return int(_scheduler(w.start, seq_length, w.steps, w.multiple).get_difficulty(step))


@functools.cache
def _scheduler(start: int, seq_length: int, steps: int, multiple: int):
    """DeepSpeed's scheduler of one warm-up (its difficulty is a pure function of the step it is given)."""
    from deepspeed.runtime.data_pipeline.curriculum_scheduler import CurriculumScheduler

    return CurriculumScheduler(
        {
            "min_difficulty": start,
            "max_difficulty": seq_length,
            "schedule_type": "fixed_linear",
            "schedule_config": {"total_curriculum_step": steps, "difficulty_step": multiple},
        }
    )


class SeqWarmup(Hook):
    """The warm-up in the training loop: each step's length as ``run.seq_length`` (the trainer truncates the
    micro-batches to it), and the step's length and the tokens trained on in its log."""

    def __init__(self):
        self._done, self._trained = 0, 0  # trained tokens of the first _done steps (advanced, never stored)

    def before_step(self, run) -> None:
        run.seq_length = length_at(run.cfg.train.seq_warmup, run.cfg.data.seq_length, run.step)

    def micro_batch(self, run):
        """A step shorter than ``data.seq_length`` runs compiled layers (``train.compile``) eagerly: they compile with
        static shapes (``trainer.compile_layers``), so each warm-up length would be a graph of every layer, compiled
        at its first step, and past dynamo's recompile limit the layers stayed eager for the rest of the run, the
        full length included. The warm-up's short steps are its cheap ones; the full length compiles once."""
        import contextlib

        from megahash.accelerator import policy

        if run.seq_length >= run.cfg.data.seq_length or not policy.compile_layers(run.cfg.train.compile):
            return contextlib.nullcontext()
        import torch

        return torch.compiler.set_stance("force_eager")

    def step_metrics(self, run, metrics: dict) -> None:
        metrics["seq_length"] = length_at(run.cfg.train.seq_warmup, run.cfg.data.seq_length, run.step - 1)
        metrics["trained_tokens"] = self.trained_tokens(run.cfg, run.step)

    def trained_tokens(self, cfg, step: int) -> int:
        """Tokens trained on by the first ``step`` steps: sum of batch(s) x L(s) (a function of the step)."""
        from megahash.data.samples import step_batch

        if step < self._done:
            self._done, self._trained = 0, 0
        w = cfg.train.seq_warmup
        while self._done < step:
            self._trained += step_batch(cfg.train, self._done) * length_at(w, cfg.data.seq_length, self._done)
            self._done += 1
        return self._trained


def hook(run) -> SeqWarmup | None:
    return SeqWarmup() if run.cfg.train.seq_warmup.steps > 0 else None
