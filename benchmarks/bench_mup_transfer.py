#!/usr/bin/env python
"""muP's learning-rate transfer across widths (issue 48 item 2; docs/compact_models.md "Hyperparameter transfer").

    python benchmarks/bench_mup_transfer.py [--report-only] [--out benchmarks/results/DATE_mup_transfer_cpu.md]

Runs ``megahash sweep --grid benchmarks/grids/mup_transfer.yaml --tasks none`` (5 learning rates x hidden 32 and
128 (4x apart), standard parametrization (SP) and muP with base 32, on the quickstart data; finished cells are
skipped, an interrupted one resumes), then reads each finished cell's final validation loss and writes the
loss-vs-LR curves as one plot (``..._mup_transfer_cpu.png`` beside the table) and the table with each row's best LR.
The narrow muP model is SP h32 bit for bit (muP at its base width is the standard model), so SP h32 is both rows'
narrow curve. The claim checked: with muP the narrow model's best LR is within one sweep step of the wide model's;
without it the best LR moves. ``--report-only``: the table and plot of the cells finished so far (missing cells are
listed). Needs README step 1's ``data/shakespeare``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import platform
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GRID = ROOT / "benchmarks" / "grids" / "mup_transfer.yaml"
ROWS = {"SP": ("SP h32", "SP h128"), "muP": ("SP h32", "muP h128")}  # narrow, wide (muP h32 == SP h32)


def losses(out: Path) -> dict[str, dict[float, float]]:
    """variant -> {lr: final validation loss} of the finished cells (``sweep_cell.json`` written)."""
    grid = json.loads((out / "grid.json").read_text())
    res: dict[str, dict[float, float]] = {}
    for cell in grid["cells"]:
        d = out / "cells" / cell["name"]
        if not (d / "sweep_cell.json").exists():
            continue
        valid = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines() if '"valid"' in x]
        valid = [r for r in valid if r.get("split") == "valid" and "loss" in r]
        if valid:
            res.setdefault(cell["values"]["variant"], {})[float(cell["values"]["train.lr"])] = valid[-1]["loss"]
    return res


def best(curve: dict[float, float]) -> float | None:
    return min(curve, key=curve.get) if curve else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--report-only", action="store_true")
    day = datetime.date.today().isoformat()
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / f"{day}_mup_transfer_cpu.md"))
    args = ap.parse_args()
    out_dir = ROOT / "runs" / "grids" / "mup_transfer"
    if not args.report_only:
        subprocess.run([sys.executable, "-m", "megahash", "sweep", "--grid", str(GRID), "--tasks", "none"], cwd=ROOT)
    res = losses(out_dir)
    import yaml

    spec = yaml.safe_load(GRID.read_text())
    grid_lrs = [float(x) for x in spec["axes"]["train.lr"]]
    o = spec["overrides"]
    step = lambda a, b: round(abs(math.log2(a / b)))  # noqa: E731  sweep steps apart (the grid doubles)
    lines = [
        f"# muP learning-rate transfer, {day} ({platform.machine()}, {platform.processor() or 'cpu'})",
        "",
        "`python benchmarks/bench_mup_transfer.py` (`megahash sweep --grid benchmarks/grids/mup_transfer.yaml`):",
        f"quickstart data, {o['model.num_layers']} layers, {o['model.num_heads']} heads, FFN 4h, seq "
        f"{o['data.seq_length']}, batch {o['train.global_batch_size']}, {o['train.steps']} steps (warmup "
        f"{o['train.warmup_steps']}, cosine to {o['train.min_lr']:g}), one rank;",
        "final validation loss (4,096 held-out tokens). muP's base width is 32, so muP h32 is SP h32 bit for bit.",
        "",
        "| variant | " + " | ".join(f"lr {x:g}" for x in grid_lrs) + " | best LR |",
        "| --- | " + " | ".join("---" for _ in grid_lrs) + " | --- |",
    ]
    for v in ("SP h32", "SP h128", "muP h128"):
        c = res.get(v, {})
        cells = [f"{c[x]:.3f}" if x in c else "not run" for x in grid_lrs]
        full = len(c) == len(grid_lrs)
        lines.append(f"| {v} | " + " | ".join(cells) + f" | {best(c) if full else 'incomplete'} |")
    lines.append("")
    for name, (narrow, wide) in ROWS.items():
        a, b = res.get(narrow, {}), res.get(wide, {})
        if len(a) == len(b) == len(grid_lrs):
            n = step(best(a), best(b))
            lines.append(f"- {name}: best LR {best(a):g} at h32, {best(b):g} at h128: {n} sweep step(s) apart.")
        else:
            lines.append(f"- {name}: incomplete ({len(a)} + {len(b)} of {2 * len(grid_lrs)} cells finished).")
    out = Path(args.out)
    png = out.with_suffix(".png")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        for v, style in (("SP h32", "k-o"), ("SP h128", "C0--s"), ("muP h128", "C3-^")):
            c = res.get(v, {})
            if c:
                xs = sorted(c)
                ax.plot(xs, [c[x] for x in xs], style, label=v if v != "SP h32" else "SP h32 = muP h32 (base)")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("train.lr")
        ax.set_ylabel("final validation loss")
        ax.set_title("muP transfer: loss vs LR at widths 32 and 128")
        ax.legend()
        fig.tight_layout()
        fig.savefig(png, dpi=110)
        lines += ["", f"![loss vs LR]({png.name})"]
    except ImportError:
        pass
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
