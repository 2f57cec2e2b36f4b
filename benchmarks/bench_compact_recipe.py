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

Bad arguments (here and in bench_compact_ladder.py, which shares these checks) end in one line
``error: <problem>; <fix>`` and exit status 2 before anything is trained or created; every run's config is
loaded and checked first as megahash/pretrain.py will (a bad ``--try`` override fails at once, not after the
recipes before it trained).
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import NoReturn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # megahash's one-line errors and config checks (no install needed)
from megahash.arguments import ArgumentParser  # noqa: E402
from megahash.errors import MegahashError, print_error  # noqa: E402

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


def fail(problem: str, fix: str) -> NoReturn:
    """Bad input, the house rule: ONE line ``error: <problem>; <fix>`` on stderr and exit status 2, no traceback."""
    print_error(f"{problem}; {fix}")
    sys.exit(2)


def int_list(text: str, flag: str, choices=None, minimum: int = 0) -> list[int]:
    """``--flag 1,2,3``: distinct integers (of ``choices`` if given, else >= ``minimum``), or :func:`fail`."""
    fix = f"give comma-separated integers, e.g. {flag} {','.join(map(str, choices or (1, 2, 3)))}"
    if not text.strip():
        fail(f"{flag} is empty", fix)
    values = []
    for item in text.split(","):
        try:
            values.append(int(item))
        except ValueError:
            fail(f"{flag} {text!r}: {item!r} is not an integer", fix)
    for v in values:
        if choices is not None and v not in choices:
            fail(f"{flag}: {v} is not one of {', '.join(map(str, choices))}", fix)
        if choices is None and v < minimum:
            fail(f"{flag}: {v} is below {minimum}", fix)
    return _distinct(values, flag, text)


def name_list(text: str, flag: str, known) -> list[str]:
    """``--flag a,b``: distinct names of ``known``, or :func:`fail`."""
    names = text.split(",")
    if not text.strip():
        fail(f"{flag} is empty", f"give comma-separated names of {', '.join(known)}")
    for n in names:
        if n not in known:
            fail(f"{flag}: unknown recipe {n!r}", f"choose from {', '.join(known)} (or define it with --try)")
    return _distinct(names, flag, text)


def _distinct(values: list, flag: str, text: str) -> list:
    for i, v in enumerate(values):
        if v in values[:i]:
            fail(f"{flag} {text!r} lists {v} twice", "list each once")
    return values


TRY_NAME = re.compile(r"[A-Za-z0-9_.-]+")
BENCH_KEYS = ("train.save_dir",)  # set by the bench for every run (its output is read from there)


def try_recipe(spec: str, name: str, overrides: str, recipes: dict, tried: set, usage: str) -> list[str]:
    """Check a ``--try`` recipe's name (a new name of letters, digits, ``_.-``: it becomes a file name and a
    row's recipe; not one of ``recipes`` nor of the earlier ``tried``) and its overrides (``KEY=VALUE``, not the
    bench's own keys); its override list. The name is added to ``tried``."""
    if not TRY_NAME.fullmatch(name):
        fail(f"--try {spec!r}: recipe name {name!r} is not letters, digits, '_', '.' or '-'", f"write --try {usage}")
    if name in tried:
        fail(f"--try {spec!r}: the name {name!r} is given to an earlier --try too", "give each --try its own name")
    if name in recipes:
        fail(f"--try {spec!r} would redefine the built-in recipe {name!r}", "give the new recipe a name of its own")
    items = [o for o in overrides.split(",") if o]
    for o in items:
        key = o.partition("=")[0].strip()
        if "=" not in o or not key:
            fail(f"--try {spec!r}: override {o!r} is not KEY=VALUE", f"write --try {usage}")
        if key in BENCH_KEYS:
            fail(f"--try {spec!r} sets {key}, which the bench sets for every run", "leave it out")
    tried.add(name)
    return items


def check_out(out: str, *more: str) -> Path:
    """``--out`` (and the files written beside it, ``more`` suffixes) as a writable file path, or :func:`fail`
    (before the runs, not after hours of them)."""
    path = Path(out)
    for p in [path] + [path.with_suffix(s) for s in more if path.name]:
        if p.is_dir() or not p.name:
            fail(f"--out {out!r}: {p or '.'} is a directory", "give the path of the markdown file to write")
    if path.suffix in more:
        fail(f"--out {out} ends in {path.suffix}, the suffix of the plot beside it", "give a .md path")
    if not path.parent.is_dir():
        fail(f"--out {out}: directory {path.parent} does not exist", "create it or write elsewhere")
    if not os.access(path.parent, os.W_OK):
        fail(f"--out {out}: directory {path.parent} is not writable", "write elsewhere")
    return path


def check_work(work: str) -> Path:
    """``--work`` as an absolute directory path (existing or to be made; absolute: the runs start in the
    repository root, the bench reads their output from where it was started), or :func:`fail`."""
    path = Path(work).absolute()
    if path.exists() and not path.is_dir():
        fail(f"--work {work} is not a directory", "give the directory the runs go in")
    return path


def cached_rows(cache: Path, fields: tuple[str, ...]) -> dict[tuple, dict]:
    """The rows of ``cache`` (``rows.jsonl``: one JSON object a line) by their ``fields``; {} if it is absent."""
    if not cache.is_file():
        return {}
    rows = {}
    for n, line in enumerate(cache.read_text(errors="replace").splitlines(), 1):
        if line.strip():
            try:
                row = json.loads(line)
                rows[tuple(row[f] for f in fields)] = row
            except (ValueError, KeyError, TypeError) as e:
                fix = f"fix or delete that line (a JSON object with {', '.join(fields)})"
                fail(f"{cache} line {n} is not a result row ({type(e).__name__}: {e})", fix)
    return rows


def make_dir(path: Path) -> None:
    """Create the work directory (after every check), or :func:`fail`."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        fail(f"--work {path}: {e.strerror or e}", "give a directory that can be created")


def check_configs(runs) -> None:
    """Load and check each run's config as megahash/pretrain.py will before training (its ``--check config``:
    no torch), so a bad override fails now rather than when its run starts after the others trained. ``runs``:
    (what, config files, overrides, fix) per run."""
    from megahash.pretrain import check

    for what, configs, sets, fix in runs:
        try:
            check(SimpleNamespace(config=configs, overrides=sets), inputs=False)
        except (MegahashError, OSError) as e:
            fail(f"{what}: {e}", fix)


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
        fail(f"{' '.join(cmd[:4])} ... failed (exit {done.returncode})", f"see {log}")
    return time.perf_counter() - start


def vocab_size(model: str = "data/shakespeare/spm.model") -> int:
    """The quickstart tokenizer's pieces (what ``model.vocab_size: 0`` resolves to)."""
    import sentencepiece

    return sentencepiece.SentencePieceProcessor(model_file=str(ROOT / model)).get_piece_size()


def config_args(configs: list[str]) -> list[str]:
    return [a for c in configs for a in ("--config", c)]


def train_sets(recipe: str, seed: int, steps: int, run_dir: Path) -> list[str]:
    """The overrides of megahash/pretrain.py for one (recipe, seed), after ``config_args`` of its configs."""
    return [
        f"train.seed={seed}",
        f"data.seed={seed}",
        f"train.save_dir={run_dir}",
        "train.save_interval=0",
        "logging.plot=false",
        "logging.tensorboard=false",
        "train.keep_last=1",
        *RECIPES[recipe][1],  # a recipe may change the steps with the batch (the same tokens) ...
        *([f"train.steps={steps}"] if steps else []),  # ... --steps sets every recipe's, its own overrides' too
    ]


def one(recipe: str, seed: int, steps: int, work: Path, artifact_too: bool = True) -> dict | None:
    """Train, evaluate and export one (recipe, seed); the held-out bits per byte and artifact bytes."""
    configs = RECIPES[recipe][0]
    run_dir = work / f"{recipe}_s{seed}"
    log = work / f"{recipe}_s{seed}.log"
    sets = train_sets(recipe, seed, steps, run_dir)
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
    fail(f"no {name} in the evaluation output", "see the run's log beside its directory")


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
    ap = ArgumentParser(description=__doc__.splitlines()[0])
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
    # every argument checked (one line, exit 2) before anything is created or trained
    seeds = int_list(args.seeds, "--seeds")
    if args.steps < 0:
        fail(f"--steps {args.steps} is negative", "give the steps of every recipe, or 0 for each recipe's own")
    tried = set()
    for spec in args.extra:
        name, eq, overrides = spec.partition("=")
        usage = "NAME=KEY=V,KEY=V"
        if not eq:
            fail(f"--try {spec!r} has no '='", f"write --try {usage}")
        RECIPES[name] = (QS, try_recipe(spec, name, overrides, RECIPES, tried, usage))
    recipes = name_list(args.recipes, "--recipes", RECIPES)
    check_out(args.out)
    work = check_work(args.work)
    cache = work / "rows.jsonl"
    done = cached_rows(cache, ("recipe", "seed"))
    check_configs(
        (
            f"recipe {recipe!r}, seed {seed}",
            RECIPES[recipe][0],
            train_sets(recipe, seed, args.steps, work / f"{recipe}_s{seed}"),
            "fix the overrides of its --try" if recipe in tried else "fix --steps or --seeds",
        )
        for recipe in recipes
        for seed in seeds
        if (recipe, seed) not in done
    )
    make_dir(work)
    rows = []
    for recipe in recipes:
        for seed in seeds:
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
