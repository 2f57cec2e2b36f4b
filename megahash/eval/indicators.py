"""``megahash indicators``: attention pattern indicators ([Xue25] sec. 4.4.4) and pre-softmax logits (Figures
4.1, 4.2) of a checkpoint on a text.

    megahash indicators --checkpoint DIR --text FILE [--out DIR] [--max-tokens N] [--windows K]

For each layer l and head j the attention matrix A_j in R^{L x L} of a text window of L tokens is captured
(:class:`megahash.eval.attention_capture.AttentionCapture`: each kind's own ``maps`` hook) and the indicators
of sec. 4.4.4 are computed exactly as defined there (:mod:`megahash.eval.indicator_formulas`: entropy H,
concentration Conc, head diversity HeadDiv, attention sink Sink, local focus LocFoc_N for N = 0..3).

The JSON holds raw values per head, their head means per layer, and HeadDiv per layer (averaged
over ``--windows`` consecutive windows). Footnote 5 of [Xue25] plots H, Conc and HeadDiv
min-max normalised across layers and Sink/LocFoc_N as absolute values (LocFoc_N x 2): the layer
heatmap ``indicators_layers.png`` does the same. ``indicators_heads.png`` shows each indicator per
layer (x) and head (y); ``logits.png`` the distribution of the pre-softmax logits per layer
(box plot on a symmetric-log axis and the largest |logit| per layer, Figure 4.2's outlier view)
(:mod:`megahash.eval.indicator_plots`).

How each kind gives its map (the equivalent attention matrix: what multiplies V) is declared by the kind
(``register_attention(..., maps=...)``): softmax kinds from the q, k their softmax core receives, linear kinds
by their own formula on their kernel's q, k, the fixed-input kinds as the one map the batch shares, kinds that
mix no tokens as A = I; a kind without a ``maps`` hook is reported as "unavailable", a layer that did not run
(``skip`` mode) as skipped.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from megahash.eval.attention_capture import AttentionCapture
from megahash.eval.indicator_formulas import head_diversity, head_indicators
from megahash.eval.indicator_plots import plot


def layer_records(captured: list[dict | None], kinds: list[str]) -> list[dict]:
    """Per-layer JSON records (indicators of the first sequence of the batch)."""
    out = []
    for i, rec in enumerate(captured):
        kind = kinds[i] if i < len(kinds) else "?"
        if rec is None:
            out.append({"layer": i + 1, "kind": kind, "source": "skipped (layer not run)"})
            continue
        if rec["probs"] is None:
            out.append({"layer": i + 1, "kind": rec["kind"], "source": rec["source"]})
            continue
        A = rec["probs"][0]
        heads = head_indicators(A)
        out.append(
            {
                "layer": i + 1,
                "kind": rec["kind"],
                "source": rec["source"],
                "seq_len": int(A.shape[-1]),
                "heads": heads,
                "mean": {k: float(np.mean(v)) for k, v in heads.items()},
                "head_div": head_diversity(A, rec["causal"]),
            }
        )
    return out


def logit_stats(values: torch.Tensor | None) -> dict | None:
    if values is None or values.numel() == 0:
        return None
    v = values.double().numpy()
    q = np.percentile(v, [1, 5, 25, 50, 75, 95, 99])
    edges = np.linspace(v.min(), v.max() if v.max() > v.min() else v.min() + 1, 41)
    counts, _ = np.histogram(v, bins=edges)
    return {
        "count": int(v.size),
        "min": float(v.min()),
        "max": float(v.max()),
        "mean": float(v.mean()),
        "std": float(v.std()),
        "abs_max": float(np.abs(v).max()),
        "percentiles": {p: float(x) for p, x in zip(["p01", "p05", "p25", "p50", "p75", "p95", "p99"], q)},
        "hist": {"edges": [float(e) for e in edges], "counts": [int(c) for c in counts]},
    }


def _merge(records: list[list[dict]]) -> list[dict]:
    """Average per-window records (same layers) into one."""
    first = records[0]
    if len(records) == 1:
        return first
    out = []
    for i, rec in enumerate(first):
        if "heads" not in rec:
            out.append(rec)
            continue
        heads = {
            k: [float(np.mean([r[i]["heads"][k][j] for r in records])) for j in range(len(rec["heads"][k]))]
            for k in rec["heads"]
        }
        out.append(
            {
                **rec,
                "heads": heads,
                "mean": {k: float(np.mean(v)) for k, v in heads.items()},
                "head_div": float(np.mean([r[i]["head_div"] for r in records])),
                "windows": len(records),
            }
        )
    return out


@torch.no_grad()
def compute(model, codec, text: str, max_tokens: int, windows: int = 1) -> tuple[list[dict], dict]:
    """Indicators of ``windows`` consecutive windows of ``max_tokens`` tokens of ``text``; returns
    (layer records, info) with the pre-softmax logit statistics in each layer record."""
    from megahash.errors import DataError

    enc = codec.prefix() + codec.encode(text)
    if len(enc) < 4:
        raise DataError("the text gives fewer than 3 tokens; give a longer --text")
    per_window, logits = [], {}
    kinds = list(getattr(model, "layer_kinds", []))
    used = 0
    for w in range(windows):
        part = enc[w * max_tokens : (w + 1) * max_tokens]
        if len(part) < 4:
            break
        codes = codec.codes(part)
        dev = next(model.parameters()).device
        tok = torch.tensor([part.ids], dtype=torch.long, device=dev)
        cod = None
        if codes is not None:
            t = torch.from_numpy(np.ascontiguousarray(codes))[None]
            cod = (t if t.dtype == torch.uint8 else t.long()).to(dev)
        with AttentionCapture(model, batch=1) as cap:
            model(tok, hash_codes=cod)
        per_window.append(layer_records(cap.layers, kinds))
        for i, rec in enumerate(cap.layers):
            if rec is not None and rec.get("logits") is not None:
                logits.setdefault(i, []).append(rec["logits"])
        used += 1
    merged = _merge(per_window)
    for i, rec in enumerate(merged):
        rec["logits"] = logit_stats(torch.cat(logits[i])) if i in logits else None
    info = {"windows": used, "window_tokens": max_tokens, "text_tokens": len(enc) - 1}
    return merged, info


def build_parser() -> argparse.ArgumentParser:
    from megahash.arguments import ArgumentParser

    p = ArgumentParser(
        prog="megahash indicators",
        description="Attention pattern indicators ([Xue25] sec. 4.4.4, docs/references.md) of a checkpoint on a text.",
    )
    p.add_argument("--checkpoint", required=True, help="run directory or step_N directory")
    p.add_argument("--text", required=True, help="UTF-8 text file")
    p.add_argument("--out", default=None, help="output directory (default RUN_DIR/indicators)")
    p.add_argument("--max-tokens", type=int, default=0, help="tokens per window (default data.seq_length)")
    p.add_argument("--windows", type=int, default=1, help="consecutive windows to average")
    p.add_argument("--tokenizer", default=None)
    p.add_argument("--override", action="append", default=[], help="config override key=value (repeatable)")
    p.add_argument("--no-plots", action="store_true")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    from megahash.command_errors import run_guarded

    args = build_parser().parse_args(argv)

    def run():
        from megahash.errors import ConfigError, DataError

        if args.max_tokens < 0 or args.windows < 1:
            raise ConfigError("--max-tokens must be >= 0 and --windows >= 1")
        from megahash.eval.run import check_out

        check_out(args.out, folder=True)
        path = Path(args.text)
        if not path.is_file():
            raise DataError(f"--text {path} does not exist")
        text = path.read_text(encoding="utf-8", errors="replace")
        from megahash.eval.text import load_codec, load_model

        cfg, model, ckpt = load_model(args.checkpoint, args.override)
        out = Path(args.out) if args.out else ckpt.parent / "indicators"
        from megahash.atomic_write import check_writable, write_text_atomic

        check_writable(out, "pass --out DIR elsewhere", folder=True)  # a read-only run folder: before the forward
        from megahash.accelerator import policy

        if policy.has_gpu():
            model = model.to(policy.device())
        codec = load_codec(cfg, ckpt, args.tokenizer, model_vocab=model.vocab_size)
        max_tokens = args.max_tokens or cfg.data.seq_length
        records, info = compute(model, codec, text, max_tokens, args.windows)
        out.mkdir(parents=True, exist_ok=True)
        record = {
            "checkpoint": str(ckpt),
            "text": str(path),
            "schedule": cfg.model.schedule,
            **info,
            "definitions": "thesis sec. 4.4.4; see megahash/eval/indicator_formulas.py",
            "layers": records,
        }
        write_text_atomic(out / "indicators.json", json.dumps(record, indent=1) + "\n")
        written = [] if args.no_plots else plot(records, out, f"({cfg.model.schedule})")
        print(format_table(records))
        print(f"\nwrote {out / 'indicators.json'}" + "".join(f", {w}" for w in written))
        return 0

    return run_guarded(run)


def format_table(records: list[dict]) -> str:
    lines = [
        "| layer | kind | H | Conc | HeadDiv | Sink | LocFoc0 | LocFoc1 | LocFoc2 | LocFoc3 | max abs logit |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in records:
        if "mean" not in r:
            lines.append(f"| {r['layer']} | {r['kind']} | {r['source']} |" + " |" * 8)
            continue
        m = r["mean"]
        lg = r.get("logits")
        mx = f"{lg['abs_max']:.3g}" if lg else ""
        lines.append(
            f"| {r['layer']} | {r['kind']} | {m['entropy']:.3f} | {m['conc']:.3f} | {r['head_div']:.4f} | "
            f"{m['sink']:.3f} | {m['locfoc_0']:.3f} | {m['locfoc_1']:.3f} | {m['locfoc_2']:.3f} | "
            f"{m['locfoc_3']:.3f} | {mx} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
