"""The figures of ``megahash indicators``: each indicator per layer and head, the layer summary of [Xue25]
Figure 4.1 (footnote 5's normalisation) and the pre-softmax logits per layer (Figure 4.2's outlier view)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from megahash.eval.indicator_formulas import INDICATORS, LABELS


def _save(fig, path: Path) -> str:
    """Lay out, write (110 dpi) and close a matplotlib figure; its path."""
    import matplotlib.pyplot as plt

    from megahash.atomic_write import write_figure_atomic

    fig.tight_layout()
    write_figure_atomic(fig, path, dpi=110)
    plt.close(fig)
    return str(path)


def plot(records: list[dict], out_dir: Path, title: str = "") -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    layers = [r for r in records if "heads" in r]
    if layers:
        names = INDICATORS
        n_heads = max(len(r["heads"]["entropy"]) for r in layers)
        fig, axes = plt.subplots(2, 4, figsize=(16, 6.5))
        for ax, name in zip(axes.flat, names + ["head_div"]):
            if name == "head_div":
                grid = np.array([[r["head_div"] for r in layers]])
                ylabels = ["layer"]
            else:
                grid = np.full((n_heads, len(layers)), np.nan)
                for c, r in enumerate(layers):
                    vals = r["heads"][name]
                    grid[: len(vals), c] = vals
                ylabels = None
            im = ax.imshow(grid, aspect="auto", cmap="viridis", origin="lower")
            ax.set_title(LABELS[name])
            ax.set_xticks(range(len(layers)), [str(r["layer"]) for r in layers], fontsize=7)
            ax.set_xlabel("layer")
            if ylabels:
                ax.set_yticks([0], ylabels)
            else:
                ax.set_ylabel("head")
                ax.set_yticks(range(n_heads), [str(h + 1) for h in range(n_heads)], fontsize=7)
            fig.colorbar(im, ax=ax, fraction=0.046)
        fig.suptitle(f"Attention indicators per layer and head {title}".strip())
        written.append(_save(fig, out_dir / "indicators_heads.png"))

        # layer summary (Figure 4.1's quantities; footnote 5 normalisation)
        rows = ["entropy", "conc", "head_div", "sink", "locfoc_0", "locfoc_1", "locfoc_2", "locfoc_3"]
        grid = np.zeros((len(rows), len(layers)))
        for c, r in enumerate(layers):
            for k, name in enumerate(rows):
                grid[k, c] = r["head_div"] if name == "head_div" else r["mean"][name]
        shown = grid.copy()
        for k, name in enumerate(rows):
            if name in ("entropy", "conc", "head_div"):
                lo, hi = grid[k].min(), grid[k].max()
                shown[k] = (grid[k] - lo) / (hi - lo) if hi > lo else 0.5
            elif name.startswith("locfoc"):
                shown[k] = np.clip(2 * grid[k], 0, 1)
        fig, ax = plt.subplots(figsize=(max(6, 0.6 * len(layers) + 3), 4))
        im = ax.imshow(shown, aspect="auto", cmap="magma", vmin=0, vmax=1)
        ax.set_yticks(
            range(len(rows)),
            [
                LABELS[n]
                + (" (min-max)" if n in ("entropy", "conc", "head_div") else " (x2)" if n.startswith("locfoc") else "")
                for n in rows
            ],
        )
        ax.set_xticks(range(len(layers)), [f"{r['layer']}\n{r['kind']}" for r in layers], fontsize=7)
        for k in range(len(rows)):
            for c in range(len(layers)):
                ax.text(
                    c,
                    k,
                    f"{grid[k, c]:.2g}",
                    ha="center",
                    va="center",
                    fontsize=6,
                    color="white" if shown[k, c] < 0.6 else "black",
                )
        fig.colorbar(im, ax=ax, fraction=0.03)
        ax.set_title(f"Layer-wise attention indicators (head means) {title}".strip())
        written.append(_save(fig, out_dir / "indicators_layers.png"))

    with_logits = [r for r in records if r.get("logits")]
    if with_logits:
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(max(8, 0.7 * len(with_logits) + 6), 4))
        stats = []
        for r in with_logits:
            p = r["logits"]["percentiles"]
            stats.append(
                {
                    "label": f"{r['layer']}",
                    "whislo": p["p01"],
                    "q1": p["p25"],
                    "med": p["p50"],
                    "q3": p["p75"],
                    "whishi": p["p99"],
                    "fliers": [r["logits"]["min"], r["logits"]["max"]],
                }
            )
        ax1.bxp(stats, showfliers=True)
        ax1.set_yscale("symlog", linthresh=1.0)
        ax1.set_xlabel("layer")
        ax1.set_ylabel("pre-softmax logit (whiskers p1/p99, dots min/max)")
        ax1.set_title("Distribution of pre-softmax activations")
        ax2.bar([s["label"] for s in stats], [r["logits"]["abs_max"] for r in with_logits], color="tab:red")
        ax2.set_yscale("log")
        ax2.set_ylim(bottom=min(0.1, 0.5 * min(r["logits"]["abs_max"] for r in with_logits)))
        ax2.set_xlabel("layer")
        ax2.set_ylabel("max |logit|")
        ax2.set_title("Largest activation per layer")
        fig.suptitle(title)
        written.append(_save(fig, out_dir / "logits.png"))
    return written
