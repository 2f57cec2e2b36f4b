#!/usr/bin/env python
"""Muon sharded over data-parallel ranks (``train.optimizer=muon`` at ZeRO-1/2, megahash/training/muon_sharded.py)
against ZeRO-0 Muon (every rank holds and computes everything) and AdamW at ZeRO-1 (DeepSpeed's partitions).

    python benchmarks/bench_muon_sharded.py [--layouts muon1:1,muon1:2,muon1:4,muon0:2,muon0:4,adamw1:2,adamw1:4]
                                            [--model configs/model/70m.yaml] [--seq 128] [--global-batch 4]
                                            [--steps 2] [--warmup 1] [--out FILE.json]

Each layout ``OPTIMIZER+STAGE:DP`` runs as DP gloo processes of this script (``--worker``), each one thread, one
after the other: the trainer's step (megahash.training.profiling.TrainHarness: the DeepSpeed engine of
``trainer.build_engine``, megatron-core model, real shards built by the data tools, fp32) at the same global batch
(``--global-batch`` sequences of ``--seq`` tokens: 4 micro-batches of 1 accumulated at DP 1, 1 a rank at DP 4).
Every rank reports after the warmup and the timed steps:

- optimizer-state bytes: the tensors its optimizer keeps between steps (Muon's momentum buffers, AdamW's two
  moments; for DeepSpeed's ZeRO-1 the moments of its flat partition, plus, reported apart, its flat fp32 copy of
  the partition, which DeepSpeed keeps even in fp32);
- Newton-Schulz matrix-steps per optimizer step: the matrices it orthogonalized times ``train.muon_ns_steps``,
  and their flops (:func:`ns_flops`: the matrices differ in shape, so equal elements are not equal work);
- the median step time and its optimizer phase (``engine.step``: clipping, the optimizer, the all-gather), wall
  clock, and the process's peak resident memory.

Rank 0 gathers the ranks' figures and prints one JSON line; the launcher writes the table. The step times come
from 2 shared cores running up to 4 ranks: read them as the cost of the communication and the work each rank does,
not as a cluster's step time.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

DEFAULT_LAYOUTS = "muon1:1,muon1:2,muon1:4,muon0:2,muon0:4,adamw1:2,adamw1:4"


def parse(layout: str) -> tuple[str, int, int]:
    """``muon1:4`` -> ("muon", 1, 4): optimizer, ZeRO stage, data-parallel ranks."""
    name, dp = layout.split(":")
    return name[:-1], int(name[-1]), int(dp)


def state_bytes(engine) -> tuple[int, int]:
    """(optimizer-state bytes this rank keeps, DeepSpeed's flat fp32 partition copies in bytes)."""
    from megahash.checkpoint.optimizer_state import torch_optimizer

    inner = torch_optimizer(engine)
    seen, total = set(), 0
    states = list(inner.state.values())
    shards = getattr(inner, "shards", None)
    if shards is not None:
        states += [pc.state for pieces in shards.pieces for pc in pieces]
    for st in states:
        for t in st.values():
            if hasattr(t, "ndim") and t.ndim and id(t) not in seen:
                seen.add(id(t))
                total += t.numel() * t.element_size()
    copies = sum(t.numel() * t.element_size() for t in getattr(engine.optimizer, "single_partition_of_fp32_groups", []))
    return total, copies


def ns_flops(shape: tuple, steps: int) -> int:
    """Multiply-add flops of ``torch.optim.Muon``'s Newton-Schulz on one matrix (X: m x n, m <= n): per step
    A = X X^T (2 m^2 n), B = b A + c A A (2 m^3), X = a X + B X (2 m^2 n)."""
    m, n = sorted(shape[-2:])
    return steps * (4 * m * m * n + 2 * m**3)


def worker(args) -> None:
    import torch

    from megahash.accelerator import process_groups
    from megahash.config import load_config

    optimizer, stage, dp = parse(args.layout)
    process_groups.init_distributed(1)
    from megahash.training import muon
    from megahash.training.profiling import PhaseTimer, TrainHarness

    counting = contextlib.ExitStack()  # for the whole run
    calls = counting.enter_context(muon.counting_newton_schulz())
    cfg = load_config(
        args.model,
        [
            f"data.prefix=[{args.prefix}]",
            f"data.tokenizer={args.tokenizer}",
            f"data.seq_length={args.seq}",
            "model.max_position_embeddings=2048",
            "train.micro_batch_size=1",
            f"train.global_batch_size={args.global_batch}",
            f"train.zero_stage={stage}",
            f"train.optimizer={optimizer}",
            "train.precision=fp32",
            f"train.steps={args.warmup + args.steps}",
            "train.warmup_steps=1",
            f"data.cache_dir={args.work / 'cache'}",
        ],
    )
    h = TrainHarness(cfg, args.warmup + args.steps)
    for _ in range(args.warmup):
        h.step()
    calls.clear()
    timer = PhaseTimer()
    for _ in range(args.steps):
        h.phased_step(timer)
    med = timer.medians()
    held, copies = state_bytes(h.engine)
    mine = {
        "state_bytes": held,
        "fp32_partition_bytes": copies,
        "ns_matrix_steps": len(calls) // args.steps * cfg.train.muon_ns_steps,
        "ns_gflop": sum(ns_flops(shape, cfg.train.muon_ns_steps) for shape in calls) / args.steps / 1e9,
        "step_s": med["step"],
        "optimizer_s": med["optimizer"],
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "engine_stage": h.engine.zero_optimization_stage(),
        "sharded": getattr(h.engine.optimizer, "shards", None) is not None,
    }
    ranks = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(ranks, mine)
    if torch.distributed.get_rank() == 0:
        n = sum(p.numel() for p in h.model.parameters())
        routed = [p for name, p in h.model.named_parameters() if muon.routes_to_muon(h.model).get(name)]
        print(
            "RESULT "
            + json.dumps(
                {
                    "layout": args.layout,
                    "dp": dp,
                    "params": n,
                    "muon_params": sum(p.numel() for p in routed),
                    "muon_matrices": len(routed) if optimizer == "muon" else 0,
                    "ranks": ranks,
                }
            ),
            flush=True,
        )
    process_groups.teardown()


def launch(args, layout: str) -> dict:
    from megahash.launching.env import run_local_world

    cmd = [sys.executable, __file__, "--worker", "--layout", layout, "--prefix", args.prefix]
    cmd += ["--tokenizer", args.tokenizer, "--model", args.model, "--seq", str(args.seq)]
    cmd += ["--global-batch", str(args.global_batch), "--steps", str(args.steps), "--warmup", str(args.warmup)]
    cmd += ["--work", str(args.work)]
    done = run_local_world(cmd, parse(layout)[2], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    if any(status for status, _ in done):
        raise SystemExit(f"{layout} failed:\n" + "\n".join(out[-3000:] for _, out in done))
    line = next(l for l in done[0][1].splitlines() if l.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :])


def table(results: list[dict]) -> str:
    mib = 2**20
    rows = [
        "| layout | DP | state MiB per rank (max / min) | x DP / DP-1 state | DeepSpeed fp32 partition MiB | "
        "NS matrix-steps per rank (max / min) | NS GFLOP per rank (max / min) | step s | optimizer s | "
        "peak RSS MiB (max) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    base = {r["layout"].split(":")[0]: max(x["state_bytes"] for x in r["ranks"]) for r in results if r["dp"] == 1}
    for r in results:
        st = [x["state_bytes"] for x in r["ranks"]]
        ns = [x["ns_matrix_steps"] for x in r["ranks"]]
        ref = base.get(r["layout"].split(":")[0])
        share = f"{max(st) * r['dp'] / ref:.2f}" if ref else "-"
        rows.append(
            f"| {r['layout'].split(':')[0]} | {r['dp']} | {max(st) / mib:.1f} / {min(st) / mib:.1f} | {share} | "
            f"{max(x['fp32_partition_bytes'] for x in r['ranks']) / mib:.1f} | {max(ns)} / {min(ns)} | "
            f"{max(x['ns_gflop'] for x in r['ranks']):.1f} / {min(x['ns_gflop'] for x in r['ranks']):.1f} | "
            f"{max(x['step_s'] for x in r['ranks']):.2f} | {max(x['optimizer_s'] for x in r['ranks']):.2f} | "
            f"{max(x['peak_rss_mib'] for x in r['ranks']):.0f} |"
        )
    return "\n".join(rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--layout", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--layouts", default=DEFAULT_LAYOUTS)
    ap.add_argument("--model", default=str(ROOT / "configs" / "model" / "70m.yaml"))
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--global-batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--work", type=Path, default=ROOT / "runs" / "bench_muon_sharded")
    ap.add_argument("--prefix", default=None)
    ap.add_argument("--tokenizer", default=None)
    ap.add_argument("--out", type=Path, default=None, help="also write the results as JSON")
    args = ap.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    if args.prefix is None:
        from bench_vs_transformers import build_shards

        args.prefix, args.tokenizer = build_shards(args.work / "data")
    results = []
    for layout in args.layouts.split(","):
        t0 = time.perf_counter()
        results.append(launch(args, layout))
        print(f"{layout}: {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
