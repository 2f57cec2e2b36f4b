#!/usr/bin/env python
"""Each compact-model lever alone and together, on held-out text at the same tokens, several seeds.

    python benchmarks/bench_compact_recipe.py [--recipes baseline,muon,...] [--seeds 1,2,3]
        [--steps N] [--work /tmp/compact] [--out benchmarks/results/DATE_compact_recipe_cpu.md]

Every recipe is ``configs/quickstart.yaml`` plus the overrides in :data:`RECIPES` (``compact`` is
``configs/compact.yaml``), trained on one process (the same global batch, so the same tokens as the
2-rank quickstart), then scored by ``megahash eval`` on ``shk_ppl``: lm-eval's rolling
log-likelihood over the held-out plays (documents 1100+, never trained on), reported as
``bits_per_byte`` (tokenizer-independent; a recipe with ``train.ema.decay`` is scored and exported with its
averaged weights). The artifact column is the exact size of
``megahash export --quantize int8 --compress zlib``. Needs the quickstart data (README step 1:
``data/shakespeare`` and ``data/eval_tasks``). The table gives mean and sample standard deviation over
seeds and each recipe's change against ``baseline`` measured in the same run.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# name -> (config files, overrides). Filled with the levers of docs/compact_models.md.
QS = ["configs/quickstart.yaml"]
RECIPES: dict[str, tuple[list[str], list[str]]] = {
    "baseline": (QS, []),
    "muon": (QS, ["train.optimizer=muon", "train.muon.lr=0.01"]),
    # the table at the quickstart's stored parameters: 2 x 2,048 x 32 + 32 x 128, paid for by FFN 512 -> 416
    "ngram": (QS, ["model.embed.options.ngram_hash_buckets=2048", "model.ffn_hidden_size=416"]),
    "ema": (QS, ["train.ema.decay=0.99", "train.ema.warmup=true"]),
    "schedule": (
        QS,
        [
            "train.global_batch_size=8",
            "train.steps=600",
            "train.warmup_steps=60",
            "train.eval_interval=100",
            "train.decay=wsd",
            "train.decay_fraction=0.3",
        ],
    ),
    "compact": (["configs/compact.yaml"], []),
}


def run(cmd: list[str], log: Path) -> float:
    """Run ``cmd`` from the repository root, output to ``log``; its wall seconds (raise on failure)."""
    start = time.perf_counter()
    with open(log, "a") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        done = subprocess.run(
            cmd,
            cwd=ROOT,
            stdout=f,
            stderr=subprocess.STDOUT,
            env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "WANDB_MODE": "disabled"},
        )
    if done.returncode != 0:
        raise SystemExit(f"error: {' '.join(cmd[:4])} ... failed (exit {done.returncode}); see {log}")
    return time.perf_counter() - start


def vocab_size(model: str = "data/shakespeare/spm.model") -> int:
    """The quickstart tokenizer's pieces (what ``model.vocab_size: 0`` resolves to)."""
    import sentencepiece

    return sentencepiece.SentencePieceProcessor(model_file=str(ROOT / model)).get_piece_size()


def config_args(configs: list[str]) -> list[str]:
    return [a for c in configs for a in ("--config", c)]


def one(recipe: str, seed: int, steps: int, work: Path, artifact_too: bool = True) -> dict | None:
    """Train, evaluate and export one (recipe, seed); the held-out bits per byte and artifact bytes."""
    configs, overrides = RECIPES[recipe]
    run_dir = work / f"{recipe}_s{seed}"
    log = work / f"{recipe}_s{seed}.log"
    sets = [
        f"train.seed={seed}",
        f"data.seed={seed}",
        *([f"train.steps={steps}"] if steps else []),
        f"train.save_dir={run_dir}",
        "train.save_interval=0",
        "logging.plot=false",
        "logging.tensorboard=false",
        "train.keep_last=1",
        *overrides,
    ]  # a recipe may change the steps with the batch (the same tokens)
    timing = run_dir / "train_seconds.txt"  # each stage is skipped when its output exists (rerun to finish)
    if not timing.exists():
        timing.write_text(
            str(round(run([sys.executable, "megahash/pretrain.py", *config_args(configs), *sets], log), 1))
        )
    weights = eval_weights(run_dir)
    if not list((run_dir / "eval").glob("step_*.json")):
        run(
            [
                sys.executable,
                "-m",
                "megahash",
                "eval",
                "--checkpoint",
                str(run_dir),
                "--tasks-dir",
                "data/eval_tasks",
                "--tasks",
                "shk_ppl",
                "--overwrite",
                *weights,
            ],
            log,
        )
    bpb = _metric(json.loads(next((run_dir / "eval").glob("step_*.json")).read_text()), "bits_per_byte")
    artifact = run_dir / "artifact_int8.zlib"
    if not artifact_too:
        return None
    if not artifact.exists():
        run(
            [
                sys.executable,
                "-m",
                "megahash",
                "export",
                "--checkpoint",
                str(run_dir),
                "--quantize",
                "int8",
                "--compress",
                "zlib",
                "--output",
                str(artifact),
                *weights,
            ],
            log,
        )
    params = params_of(configs, sets)
    return {
        "recipe": recipe,
        "seed": seed,
        "bpb": bpb,
        "artifact_bytes": artifact.stat().st_size,
        "params": params,
        "train_s": float(timing.read_text()),
    }


def params_of(configs: list[str], sets: list[str]) -> int:
    """The stored parameters of a config (``megahash params`` at the quickstart tokenizer's vocabulary)."""
    out = subprocess.run(
        [sys.executable, "-m", "megahash", "params", "--json", "--vocab-size", str(vocab_size())]
        + [*config_args(configs), *sets],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return int(json.loads(out)["total"])


def eval_weights(run_dir: Path) -> list[str]:
    """``megahash eval``'s weights flag for a finished run: its EMA weights when its resolved config keeps an
    average (``train.ema.decay`` > 0: the recipe is scored with the average it trained for), else none."""
    import yaml

    cfg = yaml.safe_load((run_dir / "resolved_config.yaml").read_text())
    return ["--weights", "ema"] if float(((cfg.get("train") or {}).get("ema") or {}).get("decay") or 0) > 0 else []


def _metric(scores: dict, name: str) -> float:
    """``name`` of the one task in a ``megahash eval`` JSON (lm-eval's ``"bits_per_byte,none"`` key)."""
    for task in scores.get("results", {}).values():
        for key, value in task.items():
            if key.split(",")[0] == name:
                return float(value)
    raise SystemExit(f"error: no {name} in the evaluation output")


def table(rows: list[dict]) -> str:
    by = {}
    for r in rows:
        by.setdefault(r["recipe"], []).append(r)
    base = statistics.mean(r["bpb"] for r in by["baseline"]) if "baseline" in by else None
    out = [
        "| recipe | seeds | held-out bits/byte (mean ± sd) | vs baseline | int8+zlib artifact bytes | parameters | train s/run |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, rs in by.items():
        b = [r["bpb"] for r in rs]
        sd = statistics.stdev(b) if len(b) > 1 else 0.0
        rel = f"{100 * (statistics.mean(b) / base - 1):+.1f}%" if base else "-"
        out.append(
            f"| {name} | {len(rs)} | {statistics.mean(b):.4f} ± {sd:.4f} | {rel} | "
            f"{max(r['artifact_bytes'] for r in rs):,} | {rs[0]['params']:,} | "
            f"{statistics.mean(r['train_s'] for r in rs):.0f} |"
        )
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipes", default=",".join(RECIPES))
    ap.add_argument("--seeds", default="1,2,3")
    ap.add_argument("--steps", type=int, default=0, help="override every recipe's train.steps (0: each recipe's own)")
    ap.add_argument("--work", default="/tmp/megahash_compact")
    ap.add_argument("--out", default=str(ROOT / f"benchmarks/results/{datetime.date.today()}_compact_recipe_cpu.md"))
    ap.add_argument("--train-only", action="store_true", help="train and evaluate only (no artifact, no table)")
    ap.add_argument(
        "--try",
        dest="extra",
        action="append",
        default=[],
        metavar="NAME=KEY=V,KEY=V",
        help="one more recipe: the quickstart plus these overrides (repeatable)",
    )
    args = ap.parse_args()
    for spec in args.extra:
        name, _, overrides = spec.partition("=")
        RECIPES[name] = (["configs/quickstart.yaml"], overrides.split(","))
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    unknown = [r for r in args.recipes.split(",") if r not in RECIPES]
    if unknown:
        raise SystemExit(f"error: unknown recipe {unknown[0]!r}; choose from {', '.join(RECIPES)}")
    rows = []
    cache = work / "rows.jsonl"
    done = (
        {(r["recipe"], r["seed"]): r for r in map(json.loads, cache.read_text().splitlines())} if cache.exists() else {}
    )
    for recipe in args.recipes.split(","):
        for seed in map(int, args.seeds.split(",")):
            row = done.get((recipe, seed)) or one(recipe, seed, args.steps, work, not args.train_only)
            if row is None:
                continue
            if (recipe, seed) not in done:
                with open(cache, "a") as f:
                    f.write(json.dumps(row) + "\n")
            rows.append(row)
            print(json.dumps(row), flush=True)
    if not rows:
        return
    text = table(rows)
    print(text)
    cmd = "python benchmarks/bench_compact_recipe.py " + " ".join(sys.argv[1:])
    Path(args.out).write_text(
        f"# Compact-model levers on held-out Shakespeare ({datetime.date.today()})\n\n"
        f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, CPU only, one process per run.\n"
        f"Command: `{cmd}`\n\n{text}\n\nRecipes (configs + overrides):\n\n"
        + "\n".join(
            f"- `{n}`: {' '.join(RECIPES[n][0])} {' '.join(RECIPES[n][1])}"
            for n in dict.fromkeys(r["recipe"] for r in rows)
        )
        + "\n"
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
