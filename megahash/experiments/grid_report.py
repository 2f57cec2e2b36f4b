"""The report of a finished ``megahash sweep`` in the [Xue25] layout (Table 4.1; also Tables 2.1, 3.2).

Rows = cells (variant, and seed when the grid repeats seeds), in grid order; the standard row(s)
are marked. Columns: parameter counts (total, embedding, attention) and attention costs
(:func:`megahash.eval.report.describe_run`: ``megahash.models.accounting`` and ``megahash.models.costs``,
prefill/decode FLOPs per token and cache bytes at the run's context), then one column per task with
its main metric (accuracies in %, as [Xue25] prints them) and the delta against the standard
row of the same seed, the average over the higher-is-better tasks ("Avg.", the [Xue25] NLU
average) and the final validation loss. With several seeds a second table gives mean ± standard
deviation per variant. Cells without a result are listed after the table, each failed one with its
exit status and one-line error (also ``not_done`` in report.json).

Files: ``OUT/report.md``, ``OUT/report.json``, ``OUT/loss_curves.png`` (training loss of every cell,
validation loss as markers, overlaid) and ``OUT/scores.png`` (bars per task and Avg.; validation
loss when the grid has no tasks). Everything is written under a temporary name, then renamed.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path

PERCENT = ("acc", "acc_norm", "exact_match")


def _metrics(run_dir: Path) -> list[dict]:
    from megahash.training.logging import read_metrics

    try:
        return read_metrics(run_dir)
    except OSError:
        return []


def _display(metric: str, value):
    if value is None:
        return None
    return 100.0 * value if metric in PERCENT else value


def collect(grid, unreadable: dict | None = None) -> list[dict]:
    """One record per finished cell: describe_run + loss curves + displayed task scores. A finished cell whose
    checkpoint cannot be read any more (removed to free the disk, damaged) has no row: its one-line reason goes
    to ``unreadable`` (cell name -> reason), which the report lists with the cells not done."""
    from megahash.errors import MegahashError, one_line
    from megahash.eval.report import describe_run

    rows = []
    for cell in grid.cells:
        if not cell.done:
            continue
        try:
            rec = describe_run(str(cell.dir))
        except MegahashError as e:  # was the whole report refused for one cell: no report of the others
            if unreadable is not None:
                unreadable[cell.name] = f"finished, but its checkpoint cannot be read: {one_line(e)}"
            continue
        recs = _metrics(cell.dir)
        train = {}
        valid = {}
        from megahash.training.logging import loss_points

        for split, step, loss in filter(None, map(loss_points, recs)):  # checkpoint records have no loss
            curve = {"train": train, "valid": valid}.get(split)
            if curve is not None:
                curve[step] = loss
        rec.update(
            {
                "cell": cell.name,
                "index": cell.index,
                "label": cell.label,
                "seed": cell.seed,
                "values": cell.values,
                "train_curve": sorted(train.items()),
                "valid_curve": sorted(valid.items()),
                "valid_loss": valid[max(valid)] if valid else None,
                "standard": all(cell.values.get(k) == v for k, v in grid.standard.items()),
            }
        )
        rec["display"] = {t: _display(s["metric"], s["value"]) for t, s in rec["scores"].items()}
        hib = [
            rec["display"][t]
            for t, s in rec["scores"].items()
            if s["higher_is_better"] and rec["display"][t] is not None
        ]
        rec["avg"] = sum(hib) / len(hib) if hib else None
        rows.append(rec)
    # deltas against the standard row of the same seed (else the first standard row)
    standards = [r for r in rows if r["standard"]]
    for r in rows:
        ref = next((s for s in standards if s["seed"] == r["seed"]), standards[0] if standards else None)
        r["standard_cell"] = ref["cell"] if ref else None
        r["delta"] = {}
        for t, v in r["display"].items():
            rv = ref["display"].get(t) if ref else None
            r["delta"][t] = None if v is None or rv is None else v - rv
        r["delta_avg"] = None if ref is None or r["avg"] is None or ref["avg"] is None else r["avg"] - ref["avg"]
        r["delta_valid_loss"] = (
            None
            if ref is None or r["valid_loss"] is None or ref["valid_loss"] is None
            else r["valid_loss"] - ref["valid_loss"]
        )
    return rows


def _fmt(v, delta=None, digits=1) -> str:
    if v is None:
        return "–"
    if not math.isfinite(v):  # a diverged run: nan / inf, without a delta
        return str(v)
    if delta is not None and not math.isfinite(delta):
        delta = None
    big = abs(v) >= 1e4
    text = f"{v:.1E}" if big else f"{v:.{digits}f}"
    if delta is not None:
        text += f" ({delta:+.1E})" if big else f" ({delta:+.{digits}f})"
    return text


def _num(v) -> str:
    if v is None:
        return "–"
    v = float(v)
    for div, unit in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "K")):
        if abs(v) >= div:
            return f"{v / div:.2f}{unit}"
    return f"{v:.0f}"


def task_columns(rows: list[dict]) -> list[tuple[str, str, bool]]:
    """(task, metric, higher_is_better), accuracies first then the rest, each group sorted."""
    seen = {}
    for r in rows:
        for t, s in r["scores"].items():
            seen.setdefault(t, (s["metric"], s["higher_is_better"]))
    cols = [(t, m, h) for t, (m, h) in seen.items()]
    return sorted(cols, key=lambda c: (not c[2], c[0]))


def markdown(grid, rows: list[dict], unreadable: dict | None = None) -> str:
    cols = task_columns(rows)
    seeds = any(r["seed"] for r in rows)
    head = (
        ["", "variant"]
        + (["seed"] if seeds else [])
        + ["#params", "#emb", "#attn", "attn FLOPs/tok prefill", "attn FLOPs/tok decode", "cache bytes"]
    )
    head += [f"{t} {m}{' %' if m in PERCENT else ''} {'↑' if h else '↓'}" for t, m, h in cols]
    if any(h for _, _, h in cols):
        head.append("Avg. ↑")
    head.append("valid loss ↓")
    lines = [
        f"### {grid.name}",
        "",
        "| " + " | ".join(head) + " |",
        "| " + " | ".join(["---"] * (2 + seeds) + ["---:"] * (len(head) - 2 - seeds)) + " |",
    ]
    for r in rows:
        c = r["costs"] or {}
        std = r["standard"]
        cells = [str(r["index"]), r["label"] + (" (standard)" if std else "")] + ([r["seed"]] if seeds else [])
        cells += [
            _num(r["params"]["total"]),
            _num(r["params"]["embedding"]),
            _num(r["params"]["attention"]),
            _num(c.get("prefill_flops_per_token")),
            _num(c.get("decode_flops_per_token")),
            _num(c.get("cache_bytes")),
        ]
        for t, m, _h in cols:
            d = None if std else r["delta"].get(t)
            cells.append(_fmt(r["display"].get(t), d, 1 if m in PERCENT else 2))
        if any(h for _, _, h in cols):
            cells.append(_fmt(r["avg"], None if std else r["delta_avg"]))
        cells.append(_fmt(r["valid_loss"], None if std else r["delta_valid_loss"], 3))
        lines.append("| " + " | ".join(cells) + " |")
    notes = [
        "",
        "Deltas in parentheses: against the standard row "
        f"({', '.join(f'{k}={v}' for k, v in grid.standard.items())}) of the same seed. Accuracies in %; "
        "Avg. = mean of the ↑ tasks (the thesis's NLU average). Attention costs: megahash.models.costs at batch 1 "
        "and each cell's data.seq_length, summed over layers; parameters: megahash.models.accounting.",
    ]
    if seeds and len({r["seed"] for r in rows}) > 1:
        notes += ["", "#### Mean ± std over seeds", "", *seed_table(rows, cols)]
    left = not_done(grid, unreadable)
    if left:
        notes += ["", f"#### Cells not done ({len(left)} of {len(grid.cells)})", ""]
        notes += [
            f"- {c['index']} {c['cell']}: "
            + (
                (f"failed (exit {c['exit']}): {c['error']}" if c.get("exit") is not None else c["error"])
                if c.get("error")
                else "not run yet or still running"
            )
            for c in left
        ]
    if grid.expected:
        notes += ["", "Expected ordering (docs/experiments.md): " + " ".join(grid.expected.split())]
    return "\n".join(lines + notes)


def not_done(grid, unreadable: dict | None = None) -> list[dict]:
    """Every cell without a result: its index, name and, when it failed, its exit status and one-line
    error (``sweep_failed.json``, megahash.experiments.cell_failures.record_failure); a finished cell in
    ``unreadable`` (:func:`collect`) with that reason as its error."""
    from megahash.experiments.cell_failures import failure

    unreadable = unreadable or {}
    out = []
    for cell in grid.cells:
        if cell.done and cell.name not in unreadable:
            continue
        why = failure(cell) or ({"error": unreadable[cell.name]} if cell.name in unreadable else {})
        out.append(
            {
                "index": cell.index,
                "cell": cell.name,
                "label": cell.label,
                "exit": why.get("exit"),
                "error": why.get("error"),
            }
        )
    return out


def seed_table(rows: list[dict], cols) -> list[str]:
    groups: dict[str, list[dict]] = {}
    for r in rows:
        groups.setdefault(r["label"], []).append(r)
    head = (
        ["variant", "n"] + [t for t, _, _ in cols] + (["Avg."] if any(h for _, _, h in cols) else []) + ["valid loss"]
    )
    out = ["| " + " | ".join(head) + " |", "| --- | ---: |" + " ---: |" * (len(head) - 2)]

    def ms(vals, digits):
        vals = [v for v in vals if v is not None]
        if not vals:
            return "–"
        sd = statistics.stdev(vals) if len(vals) > 1 else 0.0
        mean = statistics.fmean(vals)
        if abs(mean) >= 1e4:
            return f"{mean:.2E} ± {sd:.1E}"
        return f"{mean:.{digits}f} ± {sd:.{digits}f}"

    for label, rs in groups.items():
        cells = [label, str(len(rs))] + [
            ms([r["display"].get(t) for r in rs], 1 if m in PERCENT else 2) for t, m, _ in cols
        ]
        if any(h for _, _, h in cols):
            cells.append(ms([r["avg"] for r in rs], 1))
        cells.append(ms([r["valid_loss"] for r in rs], 3))
        out.append("| " + " | ".join(cells) + " |")
    return out


def ema(values, keep: float = 0.9) -> list[float]:
    """Exponential moving average of the training losses; a NaN / inf or missing loss (a step the step guard
    skipped, a null) is a gap in the curve and leaves the average as it was (it made every later point NaN: the
    curve of a run that recovered from one bad step ended there)."""
    out, acc = [], None
    for v in values:
        if v is None or not math.isfinite(v):
            out.append(math.nan)
            continue
        acc = v if acc is None else keep * acc + (1 - keep) * v
        out.append(acc)
    return out


def plots(grid, rows: list[dict]) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = []
    fig, ax = plt.subplots(figsize=(8, 5))
    for r in rows:
        name = r["label"] + (f" s{r['seed']}" if r["seed"] else "")
        if r["train_curve"]:
            steps, losses = zip(*r["train_curve"])
            # exponential moving average for readability (raw values are in metrics.jsonl)
            (line,) = ax.plot(steps, ema(losses), label=name, lw=1.2)
            if r["valid_curve"]:
                vs, vl = zip(*r["valid_curve"])
                ax.plot(vs, vl, "o", color=line.get_color(), ms=4)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (train EMA; dots: validation)")
    ax.set_title(f"{grid.name}: loss curves")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    out.append(_savefig(fig, grid.out / "loss_curves.png"))
    plt.close(fig)

    cols = task_columns(rows)
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * (len(cols) + 1) * max(1, len(rows)) / 3), 4.5))
    if cols:
        names = [t for t, _, _ in cols] + (["Avg."] if any(h for _, _, h in cols) else [])
        width = 0.8 / max(1, len(rows))
        for i, r in enumerate(rows):
            vals = [r["display"].get(t) for t, _, _ in cols] + ([r["avg"]] if len(names) > len(cols) else [])
            xs = [j + i * width for j in range(len(names))]
            ax.bar(
                xs,
                [v if v is not None and math.isfinite(v) else 0 for v in vals],
                width,
                label=r["label"] + (f" s{r['seed']}" if r["seed"] else ""),
            )
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(names))])
        ax.set_xticklabels(names, rotation=20, fontsize=8)
        ax.set_ylabel("score (accuracies in %)")
    else:
        labels = [r["label"] + (f" s{r['seed']}" if r["seed"] else "") for r in rows]
        ax.bar(range(len(rows)), [r["valid_loss"] or 0 for r in rows])
        ax.set_xticks(range(len(rows)))
        ax.set_xticklabels(labels, rotation=20, fontsize=8)
        ax.set_ylabel("final validation loss")
    ax.set_title(f"{grid.name}: scores")
    if cols:
        ax.legend(fontsize=7)
    fig.tight_layout()
    out.append(_savefig(fig, grid.out / "scores.png"))
    plt.close(fig)
    return out


def _savefig(fig, path: Path) -> Path:
    from megahash.atomic_write import write_figure_atomic

    return write_figure_atomic(fig, path, dpi=110)


def write_report(grid, unreadable: dict | None = None) -> list[Path]:
    """report.md, report.json and the two plots of the finished cells; ``unreadable`` (filled in): the
    finished cells without a row, each with its reason (:func:`collect`)."""
    import warnings

    warnings.filterwarnings("ignore")
    from megahash.atomic_write import write_finite_json_atomic
    from megahash.atomic_write import write_text_atomic as _atomic

    unreadable = {} if unreadable is None else unreadable
    rows = collect(grid, unreadable)
    md = markdown(grid, rows, unreadable)
    _atomic(grid.out / "report.md", md + "\n")
    missing = [c.name for c in grid.cells if c.name not in {r["cell"] for r in rows}]
    write_finite_json_atomic(  # a diverged cell's NaN / inf losses as null (the table shows them)
        grid.out / "report.json",
        {
            "megahash_sweep_report": 1,
            "grid": grid.to_json(),
            "rows": rows,
            "missing": missing,
            "not_done": not_done(grid, unreadable),
        },
    )
    paths = [grid.out / "report.md", grid.out / "report.json"] + plots(grid, rows)
    print(md)
    return paths
