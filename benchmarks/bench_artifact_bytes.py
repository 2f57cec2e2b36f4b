#!/usr/bin/env python
"""Equal artifact bytes (issue 44 item 3, Parameter Golf's framing): the quickstart at int8 + zlib against
configs/compact_artifact.yaml at its own mixed widths, on held-out text, paired seeds.

    python benchmarks/bench_artifact_bytes.py [--seeds 1,2,3] [--jobs 2] [--work /tmp/megahash_artifact]
        [--out benchmarks/results/DATE_artifact_bytes_cpu.md]

Each (recipe, seed) is trained on one process (bench_compact_recipe.py's harness: the same 4,800 sequences
of 128 tokens for both), written as an artifact by ``megahash export`` (the quickstart with ``--quantize int8
--compress zlib``, compact_artifact with no flags: its config's ``export.artifact``) and scored by
``megahash eval --tasks shk_ppl`` (lm-eval's rolling log-likelihood over the held-out plays, documents
1100+) twice: the fp32 checkpoint and the artifact (``--artifact``); the artifact is also scored on the same
documents with dynamic evaluation (``megahash eval --text --dynamic-lr``, bench_compact_ladder's ``DYNAMIC``:
each window scored, then one clipped SGD step on it). The table gives artifact bytes,
bits per byte (mean ± sd over seeds) and the paired difference of the artifacts' bits per byte with its
standard error. Needs the quickstart data (README step 1: ``data/shakespeare``, ``data/eval_tasks``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_compact_ladder import DYNAMIC, held_out_text, mean_se  # noqa: E402
from bench_compact_recipe import ROOT, _metric, config_args, params_of, run  # noqa: E402

# name -> (config files, export flags)
RECIPES = {
    "quickstart": (["configs/quickstart.yaml"], ["--quantize", "int8", "--compress", "zlib"]),
    "compact_artifact": (["configs/compact_artifact.yaml"], []),
}


def _eval(run_dir: Path, out: Path, log: Path, artifact: Path | None) -> float:
    if not out.exists():
        extra = ["--artifact", str(artifact)] if artifact else []
        run(
            [sys.executable, "-m", "megahash", "eval", "--checkpoint", str(run_dir), "--tasks-dir", "data/eval_tasks"]
            + ["--tasks", "shk_ppl", "--overwrite", "--out", str(out), *extra],
            log,
        )
    return _metric(json.loads(out.read_text()), "bits_per_byte")


def _dynamic(run_dir: Path, log: Path, artifact: Path, work: Path) -> float:
    """The artifact's held-out bits per byte under dynamic evaluation (the weights it stores, adapted as scored)."""
    out = run_dir / f"eval_artifact_dynamic_lr{DYNAMIC['lr']:g}.json"
    if not out.exists():
        run(
            [sys.executable, "-m", "megahash", "eval", "--checkpoint", str(run_dir), "--artifact", str(artifact)]
            + ["--text", str(held_out_text(work)), "--stride", "0", "--dynamic-lr", str(DYNAMIC["lr"])]
            + ["--dynamic-clip", str(DYNAMIC["clip"]), "--overwrite", "--out", str(out)],
            log,
        )
    return float(json.loads(out.read_text())["dynamic"]["bpb"])


def one(recipe: str, seed: int, work: Path) -> dict:
    """Train, export and score one (recipe, seed); stages whose output exists are skipped."""
    configs, flags = RECIPES[recipe]
    run_dir, log = work / f"{recipe}_s{seed}", work / f"{recipe}_s{seed}.log"
    sets = [
        f"train.seed={seed}",
        f"data.seed={seed}",
        f"train.save_dir={run_dir}",
        "train.save_interval=0",
        "logging.plot=false",
        "logging.tensorboard=false",
        "train.keep_last=1",
    ]
    timing = run_dir / "train_seconds.txt"
    if not timing.exists():
        seconds = run([sys.executable, "megahash/pretrain.py", *config_args(configs), *sets], log)
        timing.write_text(str(round(seconds, 1)))
    artifact = run_dir / "artifact"
    if not artifact.exists():
        run(
            [sys.executable, "-m", "megahash", "export", "--checkpoint", str(run_dir), "--output", str(artifact)]
            + flags,
            log,
        )
    return {
        "recipe": recipe,
        "seed": seed,
        "bpb_fp32": _eval(run_dir, run_dir / "eval_fp32.json", log, None),
        "bpb_artifact": _eval(run_dir, run_dir / "eval_artifact.json", log, artifact),
        "bpb_artifact_dynamic": _dynamic(run_dir, log, artifact, work),
        "artifact_bytes": artifact.stat().st_size,
        "params": params_of(configs, sets),
        "train_s": float(timing.read_text()),
    }


def table(rows: list[dict]) -> str:
    by: dict[str, dict[int, dict]] = {}
    for r in rows:
        by.setdefault(r["recipe"], {})[r["seed"]] = r
    out = [
        "| recipe | seeds | parameters | artifact bytes (max) | fp32 bits/byte | artifact bits/byte | "
        "artifact, dynamic evaluation | train s/run |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, rs in by.items():
        cols = []
        for key in ("bpb_fp32", "bpb_artifact", "bpb_artifact_dynamic"):
            v = [r[key] for r in rs.values()]
            cols.append(f"{statistics.mean(v):.4f} ± {statistics.stdev(v) if len(v) > 1 else 0.0:.4f}")
        first = next(iter(rs.values()))
        out.append(
            f"| {name} | {len(rs)} | {first['params']:,} | {max(r['artifact_bytes'] for r in rs.values()):,} | "
            f"{cols[0]} | {cols[1]} | {cols[2]} | {statistics.mean(r['train_s'] for r in rs.values()):.0f} |"
        )
    if {"quickstart", "compact_artifact"} <= set(by):
        seeds = sorted(set(by["quickstart"]) & set(by["compact_artifact"]))
        rel = [by["compact_artifact"][s]["bpb_artifact"] / by["quickstart"][s]["bpb_artifact"] - 1 for s in seeds]
        mean, se = mean_se(rel)
        out.append(
            f"\nPaired over seeds {seeds}: compact_artifact's artifact vs the quickstart's int8+zlib artifact, "
            f"{100 * mean:+.1f}% bits per byte (standard error {100 * se:.1f} points); "
            f"per seed {', '.join(f'{100 * x:+.1f}%' for x in rel)}."
        )
        for ref_key, what in (
            ("bpb_artifact_dynamic", "dynamic evaluation for both"),
            ("bpb_artifact", "the quickstart's static"),
        ):
            rel = [by["compact_artifact"][s]["bpb_artifact_dynamic"] / by["quickstart"][s][ref_key] - 1 for s in seeds]
            mean, se = mean_se(rel)
            out.append(
                f"\nDynamic evaluation of compact_artifact's artifact against {what}: {100 * mean:+.1f}% bits per "
                f"byte (standard error {100 * se:.1f} points); per seed {', '.join(f'{100 * x:+.1f}%' for x in rel)}."
            )
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", default="1,2,3")
    ap.add_argument("--recipes", default=",".join(RECIPES))
    ap.add_argument("--jobs", type=int, default=2, help="(recipe, seed) runs at once (one thread each)")
    ap.add_argument("--work", default="/tmp/megahash_artifact")
    ap.add_argument("--out", default=str(ROOT / f"benchmarks/results/{datetime.date.today()}_artifact_bytes_cpu.md"))
    args = ap.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    jobs = [(r, int(s)) for s in args.seeds.split(",") for r in args.recipes.split(",")]
    with ThreadPoolExecutor(args.jobs) as pool:
        rows = list(pool.map(lambda job: one(*job, work), jobs))
    for row in rows:
        print(json.dumps(row))
    text = table(rows)
    print(text)
    cmd = "python benchmarks/bench_artifact_bytes.py " + " ".join(sys.argv[1:])
    Path(args.out).write_text(
        f"# Equal artifact bytes on held-out Shakespeare ({datetime.date.today()})\n\n"
        f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, CPU only, "
        f"{args.jobs} runs at once, one thread each.\n"
        f"Command: `{cmd}`\n\n{text}\n"
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
