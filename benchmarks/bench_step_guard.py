#!/usr/bin/env python
"""The cost per training step of the non-finite check every run makes before its update
(megahash/training/step_guard.py, issue 47.5).

    python benchmarks/bench_step_guard.py [--models tiny,70m] [--ranks 1,2] [--pairs 40] [--warmup 3] [--out FILE]

Per model and rank count (worker processes of this script, gloo; 2 ranks: the quickstart's layout, data
parallel with ZeRO-1): the trainer's own objects (``megahash.training.profiling.TrainHarness``: the
megatron-core datasets over Shakespeare shards built here, the model, the DeepSpeed engine of
``trainer.build_engine``, the objective) stepping with ``trainer.train_step``. The guard is installed as
``trainer.train`` installs it; every rank swaps the engine's guarded ``backward``/``_take_model_step`` for
the unguarded ones on alternate steps (ABBA order, so a drift of the shared machine's load falls on both
arms alike) and rank 0 reports the median step with and without it, the median of the paired differences,
and the guard's decision alone (``StepGuard.decide``: the all-reduce of [loss, flag] over the world and its
host sync), timed inside the step.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_async_save import MODELS, ROOT, shards  # the same two models and shards


def measure(model: str, data: tuple[str, str], pairs: int, warmup: int) -> dict:
    """This rank's figures (inside a launched world of 1 or 2 ranks)."""
    import torch

    from megahash.accelerator import process_groups
    from megahash.config import load_config
    from megahash.training import step_guard
    from megahash.training.profiling import TrainHarness

    argv, configs = MODELS[model], []
    while argv[:1] == ["--config"]:
        configs, argv = configs + [argv[1]], argv[2:]
    overrides = [*argv, f"data.prefix=[{data[0]}]", f"data.tokenizer={data[1]}", "train.precision=fp32"]
    if os.environ.get("WORLD_SIZE", "1") != "1":  # the same global batch: micro-batches over the ranks
        overrides += ["train.micro_batch_size=1"] if model == "70m" else ["train.micro_batch_size=4"]
    cfg = load_config(configs, overrides)
    arms, decide_s = {}, []
    install = step_guard.install

    def capturing(engine, t):  # the engine's methods before and after the guard wraps them
        arms["off"] = (engine.backward, engine._take_model_step)
        guard = install(engine, t)
        arms["on"] = (engine.backward, engine._take_model_step)
        decide = guard.decide

        def timed(*a, **k):
            t0 = time.perf_counter()
            out = decide(*a, **k)
            decide_s.append(time.perf_counter() - t0)
            return out

        guard.decide = timed
        return guard

    step_guard.install = capturing
    process_groups.init_distributed(1)
    try:
        h = TrainHarness(cfg, warmup + 2 * pairs + 1)
        step_guard.install = install
        times = {"on": [], "off": []}
        for i in range(warmup + pairs):
            for arm in ("on", "off") if i % 2 == 0 else ("off", "on"):
                h.engine.backward, h.engine._take_model_step = arms[arm]
                t0 = time.perf_counter()
                h.step()
                if i >= warmup:
                    times[arm].append(time.perf_counter() - t0)
        n_params = h.num_params
        zero = h.engine.zero_optimization_stage()
    finally:
        step_guard.install = install
        process_groups.teardown()
    on, off = times["on"], times["off"]
    return {
        "params": n_params,
        "zero": zero,
        "threads": torch.get_num_threads(),
        "on": statistics.median(on),
        "off": statistics.median(off),
        "paired": statistics.median(a - b for a, b in zip(on, off)),
        "decide": statistics.median(decide_s[-len(on) :]),
        "n": len(on),
    }


def launch(model: str, ranks: int, data: tuple[str, str], pairs: int, warmup: int, d: Path) -> dict:
    """``ranks`` worker processes of this script (gloo); rank 0's figures."""
    from megahash.launching.env import free_port

    out, port, procs = d / f"{model}_{ranks}.json", free_port(), []
    for rank in range(ranks):
        env = dict(
            os.environ,
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(ranks),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            PYTHONPATH=str(ROOT),
        )
        cmd = [sys.executable, __file__, "--worker", model, *data, str(pairs), str(warmup), str(out)]
        procs.append(subprocess.Popen(cmd, env=env, cwd=ROOT))
    if any(p.wait() for p in procs):
        raise SystemExit(f"error: a worker of {model} at {ranks} rank(s) failed")
    return json.loads(out.read_text())


def main() -> None:
    if sys.argv[1:2] == ["--worker"]:
        model, prefix, tokenizer, pairs, warmup, out = sys.argv[2:8]
        m = measure(model, (prefix, tokenizer), int(pairs), int(warmup))
        if os.environ.get("RANK", "0") == "0":
            Path(out).write_text(json.dumps(m))
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="tiny,70m")
    ap.add_argument("--ranks", default="1,2", help="rank counts (2: data parallel, ZeRO-1, as the quickstart)")
    ap.add_argument("--pairs", type=int, default=40, help="steps with and without the guard, each")
    ap.add_argument("--warmup", type=int, default=3, help="pairs run before timing")
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    lines = [
        "| model | parameters | ranks, engine | steps per arm | median step, guarded, ms "
        "| median step, unguarded, ms | median paired difference, ms (%) | the decision alone, ms (%) |",
        "|" + " --- |" * 8,
    ]
    with tempfile.TemporaryDirectory() as tmp:
        data = shards(Path(tmp))
        for model in a.models.split(","):
            for ranks in map(int, a.ranks.split(",")):
                m = launch(model, ranks, data, a.pairs, a.warmup, Path(tmp))
                lines.append(
                    f"| {model} | {m['params']:,} | {ranks}, ZeRO-{m['zero']} | {m['n']} "
                    f"| {1e3 * m['on']:.1f} | {1e3 * m['off']:.1f} "
                    f"| {1e3 * m['paired']:+.2f} ({100 * m['paired'] / m['off']:+.1f}%) "
                    f"| {1e3 * m['decide']:.3f} ({100 * m['decide'] / m['off']:.2f}%) |"
                )
                print(lines[-1], flush=True)
    text = "\n".join(lines)
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
