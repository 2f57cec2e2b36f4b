#!/usr/bin/env python
"""Training-step throughput and MFU per model config and attention schedule, against the standard
model of the same size measured in the same run.

    python benchmarks/bench_training.py [--sizes tiny,70m] [--schedules uniform:mha,hybrid:rndembqk:even,...]
                                        [--seq 256] [--batch 4] [--steps 5] [--dtype auto] [--compile off|on|both]

One rank, the model of ``megahash.models.megatron_model`` (the same code DeepSpeed wraps) with torch AdamW:
forward + backward + optimizer step. Reports the median step time over ``--steps`` (after one
warm-up), tokens/s, achieved model FLOP/s (``megahash.models.costs.train_flops_per_token``), MFU
where the device's peak is known (GPUs), and the ratio of tokens/s to ``uniform:mha`` of the same
size. Embedding kinds can be compared with ``--embeddings vocab,proj,...`` (hash codes are random
bit patterns of the right shape). ``--compile both`` measures every row eagerly and with
``train.compile`` (``torch.compile`` of each transformer layer; compile time is excluded: the
warm-up steps compile).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

DEFAULT_SCHEDULES = (
    "uniform:mha,hybrid:rndembqk:even,hybrid:approx:even,hybrid:nonapprox:even,uniform:mhe-add,uniform:mqa"
)


def fake_codes(cfg, batch, seq, torch):
    from megahash.hashing.specs import parse_hash_spec

    spec = parse_hash_spec(cfg.model.embed.hash_spec)
    if spec.is_bits:
        return torch.randint(0, 256, (batch, seq, spec.width), dtype=torch.uint8)
    high = spec.params.get("buckets") or 1000
    return torch.randint(0, high, (batch, seq, spec.width), dtype=torch.int64)


def measure(size: str, schedule: str, embedding: str, args, compiled: bool = False) -> dict:
    import torch

    from megahash.accelerator import measurement, policy, process_groups, rng
    from megahash.config import load_config
    from megahash.models.costs import train_flops_per_token
    from megahash.models.megatron_model import build_model

    cfg = load_config(
        None,
        [
            f"model.size={size}",
            f"model.schedule={schedule}",
            f"model.embedding={embedding}",
            f"data.seq_length={args.seq}",
            f"model.max_position_embeddings={max(args.seq, 2048)}",
        ],
    )
    dtype = policy.train_dtype(args.dtype)
    process_groups.init_distributed(1)
    rng.seed_all(1)
    dev = policy.device()
    model = build_model(cfg, cfg.model.vocab_size or 50304, dtype).to(dev)
    if compiled:
        from megahash.training.trainer import compile_layers

        compile_layers(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    vocab = model.vocab_size
    tokens = torch.randint(5, vocab, (args.batch, args.seq), device=dev)
    codes = fake_codes(cfg, args.batch, args.seq, torch).to(dev) if embedding not in ("vocab", "bert-hash") else None
    times = []
    for i in range(args.steps + 2):  # two warm-up steps
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = model(tokens, hash_codes=codes, labels=tokens).float().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        if i >= 2:
            times.append(time.perf_counter() - t0)
    step = statistics.median(times)
    tok_s = args.batch * args.seq / step
    flops = train_flops_per_token(cfg, vocab, args.seq) * tok_s
    peak = measurement.peak_flops(dtype)
    process_groups.teardown()
    return {
        "size": size,
        "schedule": schedule,
        "embedding": embedding,
        "compiled": compiled,
        "step_s": step,
        "tokens_per_s": tok_s,
        "tflops": flops / 1e12,
        "mfu": flops / peak if peak else None,
        "params": sum(p.numel() for p in model.parameters()),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="tiny,70m")
    ap.add_argument("--schedules", default=DEFAULT_SCHEDULES)
    ap.add_argument("--embeddings", default="vocab")
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16"])
    ap.add_argument("--compile", default="off", choices=["off", "on", "both"])
    args = ap.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))
    modes = {"off": [False], "on": [True], "both": [False, True]}[args.compile]
    runs = [
        (size, emb, sched, compiled)
        for size in args.sizes.split(",")
        for emb in args.embeddings.split(",")
        for sched in args.schedules.split(",")
        for compiled in modes
    ]
    base = {}
    for size, emb, sched, compiled in runs:
        r = measure(size, sched, emb, args, compiled)
        r["ratio"] = r["tokens_per_s"] / base.setdefault(size, r["tokens_per_s"])
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "n/a"
        name = sched + (" (compiled)" if compiled else "")
        print(
            f"| {size} | {emb} | {name} | {r['params'] / 1e6:.1f}M | {r['step_s'] * 1e3:.1f} ms | "
            f"{r['tokens_per_s']:,.0f} | {r['tflops']:.3f} | {mfu} | {r['ratio']:.2f} |",
            flush=True,
        )
    return 0


HEADER = (
    "| size | embedding | schedule | params | step | tokens/s | model TFLOP/s | MFU | tokens/s vs first row |\n"
    "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"
)

if __name__ == "__main__":
    print(HEADER)
    sys.exit(main())
