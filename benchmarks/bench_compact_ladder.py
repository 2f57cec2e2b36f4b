#!/usr/bin/env python
"""The compact recipe against the quickstart on a ladder of model sizes, paired seeds, held-out bits per byte.

    python benchmarks/bench_compact_ladder.py [--rungs 24,64,128] [--seeds 1,2,3]
        [--recipes baseline,compact] [--try NAME=BASE:KEY=V,KEY=V] [--work /tmp/megahash_ladder]
        [--out benchmarks/results/DATE_compact_ladder_cpu.md]

A rung is the tiny shape (4 layers, 4 heads, FFN 4 x hidden) at one hidden size (:data:`RUNGS`), trained on
0.39 tokens per parameter (the quickstart's 614,400 tokens over its 1,575,552 parameters), never fewer per
parameter at a larger rung: the hidden-128 rung is the quickstart itself. A recipe of the quickstart family
trains ``steps`` steps of ``16 / div`` sequences; one of the compact family (``configs/compact.yaml``) twice
the steps at half that batch, the same tokens. Warmup is a tenth of the steps. Every run is scored by
``megahash eval`` on ``shk_ppl`` (lm-eval's rolling log-likelihood over held-out plays, documents 1100+,
never trained on) as ``bits_per_byte``. The gain of a recipe at a rung is the mean over seeds of
``1 - bpb(recipe, seed) / bpb(baseline, seed)`` (paired by seed: the same data order and initial draw), with
its standard error ``sd / sqrt(seeds)``. Beside lm-eval's disjoint windows, each run is scored on the same
documents with strided windows (``megahash eval --text``, stride half the window: issue 44 item 4), its own
columns, and with dynamic evaluation (``--dynamic-lr``: each window scored, then one clipped SGD step on it;
megahash/eval/dynamic.py), whose gain is given both against the reference's dynamic number (the same
evaluation for both) and against its standard one. Writes a markdown table, issue 44's targets in each framing
(:func:`target_lines`), and one PNG of bits per byte against parameters. Stages whose output exists are skipped
(rerun to finish). Hidden 256 (5.2M parameters) takes 11-14 minutes a run on one core of the 2-core development
machine. Bad arguments end in one line ``error: <problem>; <fix>`` and exit status 2 before anything is trained
or created (bench_compact_recipe.py's checks: each run's config is loaded and checked first, ``--try`` overrides
included; under ``--cached``, some cached row must match).
"""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_compact_recipe import (  # noqa: E402
    ArgumentParser,
    _metric,
    cached_rows,
    check_configs,
    check_out,
    check_work,
    config_args,
    eval_weights,
    fail,
    int_list,
    make_dir,
    name_list,
    params_of,
    run,
    try_recipe,
)

ROOT = Path(__file__).resolve().parents[1]
QS, COMPACT = "configs/quickstart.yaml", "configs/compact.yaml"

# hidden size -> (batch divisor, quickstart-family steps): tokens = steps x 16 / div x 128, 0.389-0.390 per parameter
RUNGS: dict[int, tuple[int, int]] = {24: (4, 103), 64: (2, 200), 128: (1, 300), 256: (1, 1000)}

# name -> (base config, overrides)
RECIPES: dict[str, tuple[str, list[str]]] = {"baseline": (QS, []), "compact": (COMPACT, [])}


def rung_overrides(hidden: int, base: str) -> list[str]:
    """The model size and the schedule of one rung for a recipe built on ``base``."""
    div, steps = RUNGS[hidden]
    batch = 16 // div
    if base == COMPACT:
        batch, steps = batch // 2, 2 * steps
    return [
        f"model.hidden_size={hidden}",
        f"model.ffn_hidden_size={4 * hidden}",
        f"train.global_batch_size={batch}",
        f"train.micro_batch_size={min(8, batch)}",
        f"train.steps={steps}",
        f"train.warmup_steps={steps // 10}",
        "train.eval_interval=0",
        "train.save_interval=0",
        "train.keep_last=1",
        "logging.plot=false",
        "logging.tensorboard=false",
    ]


def run_paths(recipe: str, hidden: int, seed: int, work: Path) -> tuple[Path, Path]:
    """The run directory and log of one (recipe, rung, seed) under ``work``."""
    name = f"{recipe}_h{hidden}_s{seed}"
    return work / name, work / f"{name}.log"


def train_sets(recipe: str, hidden: int, seed: int, work: Path) -> list[str]:
    """The overrides of megahash/pretrain.py for one (recipe, rung, seed), after ``--config`` of its base."""
    base, overrides = RECIPES[recipe]
    run_dir = run_paths(recipe, hidden, seed, work)[0]
    return [
        f"train.seed={seed}",
        f"data.seed={seed}",
        f"train.save_dir={run_dir}",
        *rung_overrides(hidden, base),
        *overrides,
    ]


def one(recipe: str, hidden: int, seed: int, work: Path) -> dict:
    """Train and evaluate one (recipe, rung, seed): held-out bits per byte, parameters, tokens, train seconds."""
    base = RECIPES[recipe][0]
    run_dir, log = run_paths(recipe, hidden, seed, work)
    sets = train_sets(recipe, hidden, seed, work)
    timing = run_dir / "train_seconds.txt"
    if not timing.exists():
        seconds = run([sys.executable, "megahash/pretrain.py", *config_args([base]), *sets], log)
        timing.write_text(str(round(seconds, 1)))
    if not list((run_dir / "eval").glob("step_*.json")):
        cmd = ["-m", "megahash", "eval", "--checkpoint", str(run_dir), "--tasks-dir", "data/eval_tasks"]
        run([sys.executable, *cmd, "--tasks", "shk_ppl", "--overwrite", *eval_weights(run_dir)], log)
    bpb = _metric(json.loads(next((run_dir / "eval").glob("step_*.json")).read_text()), "bits_per_byte")
    sliding = sliding_bpb(run_dir, log, work)
    params = params_of([base], sets)
    div, steps = RUNGS[hidden]
    tokens = steps * (16 // div) * 128
    return {
        "recipe": recipe,
        "hidden": hidden,
        "seed": seed,
        "bpb": bpb,
        "bpb_sliding": sliding,
        "params": params,
        "tokens": tokens,
        "train_s": float(timing.read_text()),
    }


def held_out_text(work: Path) -> Path:
    """shk_ppl's documents (data/eval_tasks/shk_ppl.jsonl, field ``page``) as a ``.jsonl`` of ``text``: the
    same held-out plays for ``megahash eval --text`` as for lm-eval's task."""
    path = work / "shk_ppl_text.jsonl"
    if not path.exists():
        pages = [json.loads(line)["page"] for line in (ROOT / "data/eval_tasks/shk_ppl.jsonl").read_text().splitlines()]
        tmp = path.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps({"text": p}) + "\n" for p in pages))
        tmp.replace(path)
    return path


def sliding_bpb(run_dir: Path, log: Path, work: Path) -> float:
    """Held-out bits per byte of ``run_dir`` with strided windows (``megahash eval --text``, stride half the
    window: each scored token sees at least half a window of context), beside lm-eval's disjoint windows."""
    out = run_dir / "eval" / "sliding.json"
    if not out.exists():
        cmd = ["-m", "megahash", "eval", "--checkpoint", str(run_dir), "--text", str(held_out_text(work))]
        run([sys.executable, *cmd, "--out", str(out), "--overwrite", *eval_weights(run_dir)], log)
    return float(json.loads(out.read_text())["sliding"]["bpb"])


DYNAMIC = {"lr": 0.5, "clip": 1.0}  # megahash eval --dynamic-lr / --dynamic-clip of every run (main: --dynamic-lr)


def dynamic_bpb(run_dir: Path, log: Path, work: Path) -> float | None:
    """Held-out bits per byte of ``run_dir`` under dynamic evaluation (``megahash eval --text --dynamic-lr``);
    None when ``DYNAMIC["lr"]`` is 0."""
    if not DYNAMIC["lr"]:
        return None
    out = run_dir / "eval" / f"dynamic_lr{DYNAMIC['lr']:g}_clip{DYNAMIC['clip']:g}.json"
    if not out.exists():
        cmd = ["-m", "megahash", "eval", "--checkpoint", str(run_dir), "--text", str(held_out_text(work))]
        cmd += ["--stride", "0", "--dynamic-lr", str(DYNAMIC["lr"]), "--dynamic-clip", str(DYNAMIC["clip"])]
        cmd += eval_weights(run_dir)
        run([sys.executable, *cmd, "--out", str(out), "--overwrite"], log)
    return float(json.loads(out.read_text())["dynamic"]["bpb"])


def gains(
    rows: list[dict], recipe: str, hidden: int, ref: str = "baseline", key: str = "bpb", ref_key: str | None = None
) -> list[float]:
    """Per-seed relative gains (percent) of ``recipe``'s ``key`` over ``ref``'s ``ref_key`` (default ``key``) at
    one rung, paired by seed."""
    base = {r["seed"]: r.get(ref_key or key) for r in rows if r["recipe"] == ref and r["hidden"] == hidden}
    return [
        100 * (1 - r[key] / base[r["seed"]])
        for r in rows
        if r["recipe"] == recipe and r["hidden"] == hidden and base.get(r["seed"]) and r.get(key)
    ]


def mean_se(xs: list[float]) -> tuple[float, float]:
    return statistics.mean(xs), (statistics.stdev(xs) / math.sqrt(len(xs)) if len(xs) > 1 else float("nan"))


def _mean_sd(xs: list[float]) -> str:
    return f"{statistics.mean(xs):.4f} ± {statistics.stdev(xs) if len(xs) > 1 else 0.0:.4f}"


def _gain_text(g: list[float]) -> str:
    """Paired gains as "mean% ± SE", "-" for none."""
    if not g:
        return "-"
    m, se = mean_se(g)
    return f"{m:+.2f}% ± {se:.2f}"


def table(rows: list[dict], ref: str = "baseline") -> str:
    out = [
        f"| recipe | hidden | parameters | tokens/param | seeds | held-out bits/byte (mean ± sd) | gain vs {ref} "
        "(paired mean ± SE) | gain / SE | sliding-window bits/byte | sliding gain (paired) | dynamic bits/byte | "
        f"dynamic gain vs {ref} dynamic | dynamic gain vs {ref} standard | train s/run |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    keys = dict.fromkeys((r["recipe"], r["hidden"]) for r in rows)
    order = {"baseline": 0, ref: 1}
    for recipe, hidden in sorted(keys, key=lambda k: (k[1], order.get(k[0], 2), k[0])):
        rs = [r for r in rows if r["recipe"] == recipe and r["hidden"] == hidden]
        b = [r["bpb"] for r in rs]
        sd = statistics.stdev(b) if len(b) > 1 else 0.0
        g = gains(rows, recipe, hidden, ref) if recipe != ref else []
        gain, ratio = "-", "-"
        if g:
            m, se = mean_se(g)
            gain, ratio = f"{m:+.2f}% ± {se:.2f}", (f"{m / se:.1f}" if se == se and se > 0 else "-")
        sl, sl_gain = "-", "-"
        if all(r.get("bpb_sliding") is not None for r in rs):
            sl = _mean_sd([r["bpb_sliding"] for r in rs])
            if recipe != ref:
                sl_gain = _gain_text(gains(rows, recipe, hidden, ref, "bpb_sliding"))
        dy, dy_gain, dy_std = "-", "-", "-"
        if all(r.get("bpb_dynamic") is not None for r in rs):
            dy = _mean_sd([r["bpb_dynamic"] for r in rs])
            if recipe != ref:
                dy_gain = _gain_text(gains(rows, recipe, hidden, ref, "bpb_dynamic"))
            dy_std = _gain_text(gains(rows, recipe, hidden, ref, "bpb_dynamic", "bpb"))
        out.append(
            f"| {recipe} | {hidden} | {rs[0]['params']:,} | {rs[0]['tokens'] / rs[0]['params']:.3f} | {len(rs)} | "
            f"{statistics.mean(b):.4f} ± {sd:.4f} | {gain} | {ratio} | {sl} | {sl_gain} | {dy} | {dy_gain} | {dy_std} | "
            f"{statistics.mean(r['train_s'] for r in rs):.0f} |"
        )
    return "\n".join(out)


# issue 44's ladder targets: at hidden 128 (1.6M parameters) a gain of at least 12% over 3 standard errors, and at
# every larger rung at least the hidden-128 gain minus one point; each framing is (recipe's key, reference's key)
TARGET = {"hidden": 128, "gain": 12.0, "se": 3.0, "slack": 1.0}
FRAMINGS = {
    "static (lm-eval windows, both)": ("bpb", "bpb"),
    "dynamic evaluation, both": ("bpb_dynamic", "bpb_dynamic"),
    "recipe dynamic vs reference static (Parameter Golf)": ("bpb_dynamic", "bpb"),
}


def target_lines(rows: list[dict], recipe: str = "compact", ref: str = "baseline") -> list[str]:
    """One line per framing: ``recipe``'s gain over ``ref`` at :data:`TARGET`'s rung against its target, and each
    larger rung's gain against that gain minus the slack ("met" / "unmet"); none without the target rung."""
    at, out = TARGET["hidden"], []
    for name, (key, ref_key) in FRAMINGS.items():
        g = gains(rows, recipe, at, ref, key, ref_key)
        if len(g) < 2:
            continue
        m, se = mean_se(g)
        ok = m >= TARGET["gain"] and m > TARGET["se"] * se
        parts = [
            f"hidden {at}: {m:+.2f}% ± {se:.2f} ({'met' if ok else 'unmet'}: >= {TARGET['gain']:g}%, > {TARGET['se']:g} SE)"
        ]
        for hidden in sorted({r["hidden"] for r in rows if r["hidden"] > at}):
            if gh := gains(rows, recipe, hidden, ref, key, ref_key):
                mh = statistics.mean(gh)
                verdict = "met" if mh >= m - TARGET["slack"] else "unmet"
                parts.append(
                    f"hidden {hidden}: {mh:+.2f}% over {len(gh)} seeds ({verdict}: >= {m - TARGET['slack']:+.2f}%)"
                )
        out.append(f"- {name}: " + "; ".join(parts))
    return out


def plot(rows: list[dict], path: Path) -> None:
    """Mean held-out bits per byte against parameters (log x), one line per recipe, SE bars over seeds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, ax = plt.subplots(figsize=(6, 4))
    for recipe in dict.fromkeys(r["recipe"] for r in rows):
        pts = []
        for hidden in sorted({r["hidden"] for r in rows if r["recipe"] == recipe}):
            b = [r["bpb"] for r in rows if r["recipe"] == recipe and r["hidden"] == hidden]
            p = next(r["params"] for r in rows if r["recipe"] == recipe and r["hidden"] == hidden)
            pts.append((p, *mean_se(b)))
        xs, ys, es = zip(*pts, strict=True)
        ax.errorbar(xs, ys, yerr=[0 if e != e else e for e in es], marker="o", capsize=3, label=recipe)
    ax.set_xscale("log")
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())  # decades only: the minor labels overlap
    ax.set_xlabel("parameters")
    ax.set_ylabel("held-out Shakespeare bits per byte")
    ax.set_title("compact recipe vs quickstart, 0.39 tokens/parameter")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rungs", default="24,64,128", help=f"hidden sizes, of {', '.join(map(str, RUNGS))}")
    ap.add_argument("--seeds", default="1,2,3")
    ap.add_argument("--recipes", default="baseline,compact")
    ap.add_argument("--reference", default="baseline", help="the recipe the gains are paired against")
    ap.add_argument("--work", default="/tmp/megahash_ladder")
    ap.add_argument(
        "--dynamic-lr",
        type=float,
        default=DYNAMIC["lr"],
        help="megahash eval --dynamic-lr of every run (the dynamic columns; 0 = none)",
    )
    ap.add_argument(
        "--cached", action="store_true", help="no training: the table of the finished rows only (evaluated if need be)"
    )
    ap.add_argument("--out", default=str(ROOT / f"benchmarks/results/{datetime.date.today()}_compact_ladder_cpu.md"))
    ap.add_argument(
        "--try",
        dest="extra",
        action="append",
        default=[],
        metavar="NAME=BASE:KEY=V,KEY=V",
        help="one more recipe: BASE (baseline or compact) plus these overrides (repeatable)",
    )
    args = ap.parse_args()
    # every argument checked (one line, exit 2) before anything is created or trained
    rungs = int_list(args.rungs, "--rungs", choices=RUNGS)
    seeds = int_list(args.seeds, "--seeds")
    if not (math.isfinite(args.dynamic_lr) and args.dynamic_lr >= 0):
        fail(f"--dynamic-lr {args.dynamic_lr:g} is not a finite number >= 0", "give a learning rate, or 0 for none")
    DYNAMIC["lr"] = args.dynamic_lr
    tried = set()
    for spec in args.extra:
        name, eq, rest = spec.partition("=")
        base, _, overrides = rest.partition(":")
        usage = "NAME=BASE:KEY=V,KEY=V"
        if not eq:
            fail(f"--try {spec!r} has no '='", f"write --try {usage}")
        if base not in ("baseline", "compact"):
            fail(f"--try {spec!r}: BASE must be baseline or compact, got {base!r}", f"write --try {usage}")
        RECIPES[name] = (RECIPES[base][0], try_recipe(spec, name, overrides, RECIPES, tried, usage))
    recipes = name_list(args.recipes, "--recipes", RECIPES)
    if args.reference not in recipes:
        fail(f"--reference {args.reference!r} is not among --recipes {','.join(recipes)}", "name one of them")
    check_out(args.out, ".png")
    work = check_work(args.work)
    cache = work / "rows.jsonl"
    done = cached_rows(cache, ("recipe", "hidden", "seed"))
    wanted = [(recipe, hidden, seed) for hidden in rungs for seed in seeds for recipe in recipes]
    if args.cached:
        have = [key for key in wanted if key in done]
        if not have:
            asked = f"--recipes {','.join(recipes)} --rungs {args.rungs} --seeds {args.seeds}"
            fail(f"--cached: no row of {cache} matches {asked}", "run without --cached, or give the --work of a ladder")
        if args.reference not in {key[0] for key in have}:
            fail(f"--cached: {cache} has no row of --reference {args.reference!r}", "name a recipe it has rows of")
        wanted = have
    else:
        check_configs(
            (
                f"recipe {recipe!r} at hidden {hidden}, seed {seed}",
                [RECIPES[recipe][0]],
                train_sets(recipe, hidden, seed, work),
                "fix the overrides of its --try" if recipe in tried else "fix --rungs or --seeds",
            )
            for recipe, hidden, seed in wanted
            if (recipe, hidden, seed) not in done
        )
        make_dir(work)
    start, rows = time.perf_counter(), []
    for key in wanted:  # by rung, then seed, then recipe
        recipe, hidden, seed = key
        row = dict(done[key]) if key in done else one(recipe, hidden, seed, work)
        if row.get("bpb_sliding") is None:  # a row cached before the sliding-window column: evaluate it
            row["bpb_sliding"] = sliding_bpb(*run_paths(recipe, hidden, seed, work), work)
        # every row, new or cached, at this invocation's --dynamic-lr (its own file per setting)
        row["bpb_dynamic"] = dynamic_bpb(*run_paths(recipe, hidden, seed, work), work)
        if done.get(key) != row:
            done[key] = row
            tmp = cache.with_suffix(".tmp")
            tmp.write_text("".join(json.dumps(r) + "\n" for r in done.values()))
            tmp.replace(cache)
        rows.append(row)
        print(json.dumps(row), flush=True)
    wall = time.perf_counter() - start
    text = table(rows, args.reference)
    if targets := target_lines(rows, ref=args.reference):
        text += "\n\nIssue 44's targets for `compact`:\n\n" + "\n".join(targets)
    print(text)
    png = Path(args.out).with_suffix(".png")
    plot(rows, png)
    cmd = "python benchmarks/bench_compact_ladder.py " + " ".join(sys.argv[1:])
    Path(args.out).write_text(
        f"# Compact recipe on a ladder of model sizes, held-out Shakespeare ({datetime.date.today()})\n\n"
        f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, CPU only, one process "
        f"per run. Command: `{cmd}` (this invocation: {wall / 60:.1f} min wall, cached stages skipped).\n\n"
        f"{text}\n\n![bits per byte against parameters]({png.name})\n\nRecipes (base + overrides, before the rung's):\n\n"
        + "\n".join(
            f"- `{n}`: {RECIPES[n][0]} {' '.join(RECIPES[n][1])}" for n in dict.fromkeys(r["recipe"] for r in rows)
        )
        + "\n"
    )
    print(f"wrote {args.out} and {png}")


if __name__ == "__main__":
    main()
