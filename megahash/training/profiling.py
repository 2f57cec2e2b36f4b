"""Profiling the training step: the trainer's own set-up and step, with per-phase timers and
``torch.profiler``.

    python -m megahash.training.profiling --config configs/quickstart.yaml [--steps 10] [--warmup 3]
                                          [--torch-profile] [key=value ...]

:class:`TrainHarness` builds what ``trainer.train`` builds (megatron-core datasets over the shards,
the model, the DeepSpeed engine of ``build_engine``, the objective, the resumable loader) without
checkpoints or logging sinks, and runs steps with ``trainer.train_step`` (what ``megahash/pretrain.py``
runs) or phase by phase (:meth:`TrainHarness.phased_step`: data, forward, backward, optimizer step,
logging values) for the breakdown. ``benchmarks/bench_vs_transformers.py`` times ``step``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict

import torch

from megahash.arguments import ArgumentParser
from megahash.training.profile_steps import PHASES, phase_table  # the phases of the trainer's step


class PhaseTimer:
    """Seconds per named phase, one list entry per step (``clock``: ``time.perf_counter`` for wall
    time, ``time.process_time`` for this process's CPU time, steadier on a shared machine)."""

    def __init__(self, clock=time.perf_counter):
        self.clock = clock
        self.times: dict[str, list[float]] = defaultdict(list)
        self._t = None
        self._cur: dict[str, float] = {}

    def start(self) -> None:
        self._cur = dict.fromkeys(PHASES, 0.0)
        self._t = self.clock()

    def lap(self, phase: str) -> None:
        now = self.clock()
        self._cur[phase] += now - self._t
        self._t = now

    def stop(self) -> None:
        for k, v in self._cur.items():
            self.times[k].append(v)
        self.times["step"].append(sum(self._cur.values()))

    def medians(self) -> dict[str, float]:
        return {k: statistics.median(v) for k, v in self.times.items() if v}

    def table(self) -> str:
        return phase_table(self.medians(), "median ms")


class TrainHarness:
    """The trainer's objects for one rank-local run (call inside an initialised process group)."""

    def __init__(self, cfg, steps: int):
        from megatron.core import parallel_state

        from megahash.accelerator import host_allocator, policy, rng
        from megahash.data.dataset import build_datasets, make_loader
        from megahash.models.megatron_model import build_model
        from megahash.objectives import build_objective
        from megahash.training.trainer import build_engine

        t = cfg.train
        host_allocator.tune_host_allocator()  # as trainer.train
        self.cfg = cfg
        dp_size = parallel_state.get_data_parallel_world_size()
        self.dp_rank = parallel_state.get_data_parallel_rank()
        self.data = build_datasets(
            cfg, train_samples=steps * t.global_batch_size, valid_samples=0, cache_dir=cfg.data.cache_dir or None
        )
        rng.seed_all(t.seed)
        self.model = build_model(cfg, self.data.vocab_size, policy.param_dtype(t.precision))
        if policy.compile_layers(t.compile):  # as trainer.train
            from megahash.training.trainer import compile_layers

            compile_layers(self.model)
        self.engine, self.scheduler = build_engine(cfg, self.model, dp_size)
        from megahash.training import step_guard

        self.guard = step_guard.install(
            self.engine, t.step_guard
        )  # as trainer.train: the non-finite check of every step
        self.objective = build_objective(cfg, self.data)
        self.loader = make_loader(self.data.train, 0, t.micro_batch_size, self.dp_rank, dp_size, cfg.data.num_workers)
        self.batches = iter(self.loader)
        self.gas = self.engine.gradient_accumulation_steps()
        self.step_no = 0
        self.tokens_per_step = t.global_batch_size * cfg.data.seq_length

    @property
    def num_params(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    def step(self) -> float:
        """One optimizer step exactly as ``trainer.train`` runs it (plus the per-step metrics it
        reads: LR, grad norm); returns the loss."""
        from megahash.training.trainer import _dp_mean, _grad_norm, scheduler_lr, train_step

        self.objective.set_step(self.step_no, self.dp_rank)
        loss_sum, _wait = train_step(self.engine, self.batches, self.objective, self.gas)
        self.step_no += 1
        loss = _dp_mean(loss_sum / self.gas)
        scheduler_lr(self.engine), _grad_norm(self.engine)
        return loss

    def phased_step(self, timer: PhaseTimer) -> float:
        """The same step with a timer lap after each phase (no overlap between phases on CPU)."""
        from megahash.training.trainer import _dp_mean, _grad_norm, batch_loss, scheduler_lr

        timer.start()
        self.objective.set_step(self.step_no, self.dp_rank)
        total = 0.0
        for _ in range(self.gas):
            batch = next(self.batches)
            timer.lap("data")
            loss = batch_loss(self.engine, batch, self.objective)
            timer.lap("forward")
            self.engine.backward(loss)
            timer.lap("backward")
            self.engine.step()
            timer.lap("optimizer")
            total += loss.item()
            timer.lap("logging")
        self.step_no += 1
        loss = _dp_mean(total / self.gas)
        scheduler_lr(self.engine), _grad_norm(self.engine)
        timer.lap("logging")
        timer.stop()
        return loss


def main(argv=None) -> int:
    ap = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=None)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--torch-profile", action="store_true", help="also print torch.profiler's top ops")
    ap.add_argument("--rows", type=int, default=25)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)

    from megahash.accelerator import process_groups
    from megahash.config import load_config

    cfg = load_config(args.config, args.overrides)
    process_groups.init_distributed(cfg.parallel.tensor, cfg.parallel.sequence)
    try:
        h = TrainHarness(cfg, args.warmup + args.steps * (2 if args.torch_profile else 1))
        print(
            f"{h.num_params:,} parameters, {h.tokens_per_step} tokens/step, ZeRO-{cfg.train.zero_stage}, "
            f"optimizer {type(h.engine.optimizer).__name__}, threads {torch.get_num_threads()}"
        )
        for _ in range(args.warmup):
            h.step()
        timer = PhaseTimer()
        for _ in range(args.steps):
            h.phased_step(timer)
        print(timer.table())
        med = timer.medians()["step"]
        print(f"tokens/s {h.tokens_per_step / med:,.0f}")
        if args.torch_profile:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(args.steps):
                    h.step()
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))
    finally:
        process_groups.teardown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
