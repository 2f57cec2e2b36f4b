"""``megahash diagnose``: synthetic recall tasks that separate attention kinds at tiny scale.

    megahash diagnose [--kinds all|mha,mlp,...] [--schedules hybrid:mlp:even,...] [--tasks mqar,copy]
                      [--steps N] [--batch-size B] [--lr LR] [--seed S] [--out FILE.json]
                      [--config CFG.yaml] [key=value ...]

At tiny scale held-out perplexity barely separates attention kinds (a 4-layer model without any
attention lands within 3% of full attention after 300 steps); recall tasks do. Two tasks, generated
on the fly from a seed (the same batches for every kind):

- ``mqar``: multi-query associative recall ([Arora23], "Zoology", sec. 3): a sequence of
  ``pairs`` key-value pairs ``k1 v1 k2 v2 ...`` (distinct keys drawn from ``keys`` ids, values from
  ``values`` ids) followed by ``queries`` of those keys in random order, each followed by its value
  ``q1 a1 q2 a2 ...``; the model is scored on predicting ``a_j`` at the position of ``q_j``.
  The association is random per sequence, so a model that cannot mix tokens is at chance
  (1/values).
- ``copy``: ``length`` random tokens, a separator, then the same tokens; scored on predicting
  each copied token (chance 1/values).

Every kind (or schedule) trains a fresh model built from the normal config tree and registry
(``model.schedule=uniform:KIND``; defaults below, or ``--config`` plus overrides) for the same fixed
budget with a plain AdamW loop in this process (one rank, CPU or GPU), then is scored on held-out
sequences from another seed: accuracy = argmax prediction equals the answer, over answer positions.
The table goes to stdout, the numbers to ``--out`` (JSON, markdown beside it as ``.md``).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from megahash.errors import ConfigError

# the default tiny budget: a kind trains in a few seconds on 2 CPU cores (measured in docs/experiments.md)
MODEL_DEFAULTS = [
    "model.arch=decoder",
    "model.hidden_size=128",
    "model.num_layers=2",
    "model.num_heads=2",
    "model.ffn_hidden_size=256",
    "model.embedding=vocab",
    "model.head=vocab",
    "train.objective=clm",
    "model.max_position_embeddings=128",
    "model.make_vocab_size_divisible_by=8",
]
STEPS, BATCH, LR, EVAL_SAMPLES = 600, 64, 1e-3, 512
TASKS = ("mqar", "copy")
IGNORE = -100


@dataclass
class MQAR:
    """Multi-query associative recall (Zoology): token 0 unused, keys 1..K, values K+1..K+V."""

    pairs: int = 4
    queries: int = 4
    keys: int = 8
    values: int = 8
    name: str = "mqar"

    @property
    def vocab(self) -> int:
        return 1 + self.keys + self.values

    @property
    def seq_length(self) -> int:
        return 2 * self.pairs + 2 * self.queries

    @property
    def chance(self) -> float:
        return 1.0 / self.values

    def batch(self, gen, n: int):
        import torch

        if self.pairs > self.keys or self.queries > self.pairs:
            raise ConfigError(f"mqar needs queries <= pairs <= keys, got {self.queries}, {self.pairs}, {self.keys}")
        keys = torch.argsort(torch.rand(n, self.keys, generator=gen), dim=1)[:, : self.pairs] + 1
        vals = torch.randint(self.values, (n, self.pairs), generator=gen) + 1 + self.keys
        pick = torch.argsort(torch.rand(n, self.pairs, generator=gen), dim=1)[:, : self.queries]
        q, a = keys.gather(1, pick), vals.gather(1, pick)
        ctx = torch.stack([keys, vals], dim=2).reshape(n, -1)
        qa = torch.stack([q, a], dim=2).reshape(n, -1)
        tokens = torch.cat([ctx, qa], dim=1)
        labels = torch.full_like(tokens, IGNORE)
        labels[:, 2 * self.pairs :: 2] = a  # at q_j predict a_j
        return tokens, labels


@dataclass
class Copy:
    """Copy: ``length`` tokens from 1..V, separator V+1, the same tokens again."""

    length: int = 16
    values: int = 8
    name: str = "copy"

    @property
    def vocab(self) -> int:
        return self.values + 2

    @property
    def seq_length(self) -> int:
        return 2 * self.length + 1

    @property
    def chance(self) -> float:
        return 1.0 / self.values

    def batch(self, gen, n: int):
        import torch

        seq = torch.randint(self.values, (n, self.length), generator=gen) + 1
        sep = torch.full((n, 1), self.values + 1, dtype=seq.dtype)
        tokens = torch.cat([seq, sep, seq], dim=1)
        labels = torch.full_like(tokens, IGNORE)
        labels[:, self.length : 2 * self.length] = seq  # at the separator and each copied token: the next one
        return tokens, labels


def make_task(name: str, args) -> object:
    if name == "mqar":
        return MQAR(
            pairs=args.mqar_pairs, queries=args.mqar_queries or args.mqar_pairs, keys=args.keys, values=args.values
        )
    if name == "copy":
        return Copy(length=args.copy_length, values=args.values)
    raise ConfigError(f"unknown diagnose task {name!r} (choose from {', '.join(TASKS)})")


def variant_config(base_config: str | None, overrides: list[str], schedule: str, task):
    """The config of one variant: defaults (without --config), the user's overrides, the schedule
    and the task's vocabulary/length."""
    from megahash.config import load_config
    from megahash.models.arch import arch_of

    pre = [] if base_config else list(MODEL_DEFAULTS)
    cfg = load_config(base_config, pre + list(overrides) + [f"model.schedule={schedule}"])
    if not arch_of(cfg.model.arch).causal:
        raise ConfigError(f"megahash diagnose trains causal models; model.arch={cfg.model.arch!r} is not decoder")
    cfg.model.vocab_size = task.vocab
    cfg.data.seq_length = task.seq_length
    cfg.model.max_position_embeddings = max(cfg.model.max_position_embeddings, task.seq_length)
    return cfg


def train_and_score(cfg, task, steps: int, batch: int, lr: float, seed: int, eval_samples: int) -> dict:
    """Train a fresh model of ``cfg`` on ``task`` for ``steps`` steps; accuracy on held-out sequences."""
    import torch

    from megahash.accelerator import policy, rng
    from megahash.data.text_source import RandomTexts
    from megahash.models.megatron_model import build_model

    dev = policy.device()
    rng.seed_all(seed)
    model = build_model(cfg, task.vocab).to(dev)
    for extra in model.kind_inputs():  # e.g. a fixed text: drawn once from the task's vocabulary (same seed for all)
        extra.prepare(cfg, task.vocab, RandomTexts(torch.Generator().manual_seed(seed + 17)))
    params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.0)
    warm = max(1, steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warm) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps)))
    )
    gen = torch.Generator().manual_seed(seed)
    t0 = time.perf_counter()
    model.train()
    loss_first = loss_last = float("nan")
    for step in range(steps):
        tokens, labels = task.batch(gen, batch)
        tokens, labels = tokens.to(dev), labels.to(dev)
        per_token = model(tokens, labels=labels)
        mask = (labels >= 0).float()
        loss = (per_token.float() * mask).sum() / mask.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step == 0:
            loss_first = loss.item()
        loss_last = loss.item()
        if not math.isfinite(loss_last):
            break
    train_s = time.perf_counter() - t0
    model.eval()
    gen_eval = torch.Generator().manual_seed(seed + 1_000_003)
    correct = total = 0
    with torch.no_grad():
        for start in range(0, eval_samples, batch):
            tokens, labels = task.batch(gen_eval, min(batch, eval_samples - start))
            tokens, labels = tokens.to(dev), labels.to(dev)
            logits = model.gather_logits(model(tokens))
            pred = logits.argmax(-1)
            mask = labels >= 0
            correct += int((pred[mask] == labels[mask]).sum())
            total += int(mask.sum())
    return {
        "accuracy": correct / max(1, total),
        "answers": total,
        "chance": task.chance,
        "params": params,
        "loss_first": loss_first,
        "loss_last": loss_last,
        "train_seconds": round(train_s, 2),
    }


def all_kinds() -> list[str]:
    """Every registered attention kind (the registry's names, read by the torch-free declarations: new kinds
    appear here, and a misspelt one fails before the heavy imports)."""
    from megahash import catalog

    return sorted(catalog.names("attention"))


def variants(kinds: str | None, schedules: str | None) -> list[str]:
    out: list[str] = []
    if kinds:
        names = all_kinds() if kinds == "all" else [k.strip() for k in kinds.split(",") if k.strip()]
        known = set(all_kinds())
        for k in names:
            if k not in known:
                import difflib

                close = difflib.get_close_matches(k, sorted(known), n=1)
                raise ConfigError(
                    f"unknown attention kind {k!r}"
                    + (f" (did you mean {close[0]!r}?)" if close else f" (known: {', '.join(sorted(known))})")
                )
            out.append(f"uniform:{k}")
    for s in (schedules or "").split(";" if ";" in (schedules or "") else " "):
        if s.strip():
            out.append(s.strip())
    return out


def markdown(rows: list[dict], tasks: list[str], budget: dict) -> str:
    head = ["schedule", "#params"] + [f"{t} acc ↑" for t in tasks] + ["train s"]
    lines = ["| " + " | ".join(head) + " |", "| --- |" + " ---: |" * (len(head) - 1)]
    for r in rows:
        cells = [r["schedule"], f"{r['params']:,}"]
        cells += [f"{r['tasks'][t]['accuracy']:.3f}" if t in r["tasks"] else "–" for t in tasks]
        cells.append(f"{sum(v['train_seconds'] for v in r['tasks'].values()):.1f}")
        lines.append("| " + " | ".join(cells) + " |")
    chance = ", ".join(f"{t} {r['tasks'][t]['chance']:.3f}" for t in tasks for r in rows[:1] if t in r["tasks"])
    lines += [
        "",
        f"Budget: {budget['steps']} steps x {budget['batch_size']} sequences, lr {budget['lr']}, "
        f"seed {budget['seed']}; accuracy over {budget['eval_samples']} held-out sequences; chance: {chance}.",
    ]
    return "\n".join(lines)


def run(args) -> dict:
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    task_objs = {t: make_task(t, args) for t in tasks}
    scheds = variants(args.kinds or (None if args.schedules else "all"), args.schedules)
    if not scheds:
        raise ConfigError("nothing to diagnose: give --kinds and/or --schedules")
    for s in scheds:  # every variant's config is checked before anything trains
        for t in task_objs.values():
            variant_config(args.config, args.overrides, s, t)
    from megahash.accelerator import process_groups

    own_group = False
    import torch.distributed as dist

    if not dist.is_initialized():
        process_groups.init_distributed(1)
        own_group = True
    rows = []
    try:
        for i, s in enumerate(scheds, 1):
            if not args.quiet:  # a kind trains for minutes at the default budget: say which one
                print(
                    f"diagnose: [{i}/{len(scheds)}] {s}: training on {', '.join(tasks)} ({args.steps} steps each)",
                    flush=True,
                )
            row = {"schedule": s, "tasks": {}}
            for name, task in task_objs.items():
                cfg = variant_config(args.config, args.overrides, s, task)
                from megahash.models.registry import schedule_kinds

                schedule_kinds(cfg)
                res = train_and_score(cfg, task, args.steps, args.batch_size, args.lr, args.seed, args.eval_samples)
                row["tasks"][name] = res
                row["params"] = res["params"]
                if not args.quiet:
                    print(
                        f"diagnose: {s:<28} {name:<5} acc {res['accuracy']:.3f} (chance {res['chance']:.3f}) "
                        f"loss {res['loss_first']:.2f} -> {res['loss_last']:.2f}  {res['train_seconds']:.1f}s",
                        flush=True,
                    )
            rows.append(row)
    finally:
        if own_group:
            process_groups.teardown(barrier=False)
    budget = {
        "steps": args.steps,
        "batch_size": args.batch_size,
        "lr": args.lr,
        "seed": args.seed,
        "eval_samples": args.eval_samples,
        "tasks": {n: {k: v for k, v in vars(t).items()} for n, t in task_objs.items()},
    }
    return {"megahash_diagnose": 1, "budget": budget, "rows": rows, "markdown": markdown(rows, tasks, budget)}


def build_parser() -> argparse.ArgumentParser:
    from megahash.arguments import ArgumentParser

    p = ArgumentParser(
        prog="megahash diagnose", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--kinds",
        default=None,
        help="comma-separated attention kinds, or 'all' (default: all, unless --schedules is given)",
    )
    p.add_argument(
        "--schedules",
        default=None,
        help="schedules to diagnose besides the kinds (space or ';' "
        "separated), e.g. 'hybrid:mlp:even hybrid:rndembqk:even'",
    )
    p.add_argument("--tasks", default="mqar,copy", help="mqar,copy")
    p.add_argument("--steps", type=int, default=STEPS)
    p.add_argument("--batch-size", type=int, default=BATCH)
    p.add_argument("--lr", type=float, default=LR)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--eval-samples", type=int, default=EVAL_SAMPLES)
    p.add_argument("--mqar-pairs", type=int, default=4)
    p.add_argument("--mqar-queries", type=int, default=0, help="queries per sequence (default: = pairs)")
    p.add_argument("--keys", type=int, default=8, help="mqar key vocabulary")
    p.add_argument("--values", type=int, default=8, help="value vocabulary (mqar values, copy tokens)")
    p.add_argument("--copy-length", type=int, default=16)
    p.add_argument("--config", default=None, help="model config YAML (default: a 2-layer h128 decoder, 2 heads)")
    p.add_argument("--out", default=None, help="JSON results (markdown beside it as .md)")
    p.add_argument("--quiet", action="store_true")
    p.add_argument("overrides", nargs="*", help="config overrides key=value")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    from megahash.command_errors import run_guarded

    args = build_parser().parse_args(argv)

    def go():
        import warnings

        warnings.filterwarnings("ignore")
        if args.steps < 1 or args.batch_size < 1 or args.eval_samples < 1:
            raise ConfigError("--steps, --batch-size and --eval-samples must be >= 1")
        from megahash.eval.run import check_out

        check_out(args.out, beside=".md")  # a folder, a file above it, a read-only place: before the kinds train
        result = run(args)
        print(result["markdown"])
        if args.out:
            from megahash.atomic_write import write_text_atomic

            out = Path(args.out)
            for path, text in (
                (out, json.dumps({k: v for k, v in result.items() if k != "markdown"}, indent=1) + "\n"),
                (out.with_suffix(".md"), result["markdown"] + "\n"),
            ):
                write_text_atomic(path, text)
            print(f"\nwrote {out} and {out.with_suffix('.md')}")
        return 0

    return run_guarded(go)


if __name__ == "__main__":
    sys.exit(main())
