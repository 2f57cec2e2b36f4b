"""``README.md`` model card of an exported Hugging Face folder (``megahash export-hf``).

Written from the checkpoint alone: the variant (attention schedule, embedding, head, objective),
parameter counts (total, token embedding, the rest), the architecture, the training run (steps,
tokens seen, data source and tokenizer from the shard meta, no local paths), and the evaluation
results found in ``RUN_DIR/eval/*.json`` (``megahash eval``), when there are any.
"""

from __future__ import annotations

import json
import os
from pathlib import Path


def _base(v) -> str:
    s = str(v)
    return os.path.basename(s.rstrip("/")) if os.path.isabs(s) else s


def portable_tree(tree):
    """The config tree with every absolute local path replaced by its base name (an export carries no
    paths of the machine that wrote it; ``data.prefix`` entries "weight path" keep their weight)."""
    if isinstance(tree, dict):
        return {k: portable_tree(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [portable_tree(v) for v in tree]
    if isinstance(tree, str) and "/" in tree:
        return " ".join(_base(p) for p in tree.split(" "))
    return tree


def _eval_rows(run_dir) -> list[tuple[str, str, float]]:
    rows = []
    if run_dir is None:
        return rows
    for p in sorted(Path(run_dir).glob("eval/*.json")):
        try:
            data = json.loads(p.read_text())
        except (OSError, ValueError):
            continue
        for task, metrics in (data.get("results") or {}).items():
            for name, value in metrics.items():
                if "stderr" in name or not isinstance(value, (int, float)):
                    continue
                rows.append((f"{task} (step {data.get('step', '?')})", name, float(value)))
    return rows


def write_model_card(out: Path, cfg, model, fmt: str, step: int, run_dir=None) -> str:
    """Write ``out/README.md``; returns the file name."""
    from megahash.data.verify import read_meta
    from megahash.eval.text import first_prefix

    m, t = cfg.model, cfg.train
    total = sum(p.numel() for p in model.parameters())
    emb = sum(p.numel() for p in model.embedding.parameters())
    meta = read_meta(first_prefix(cfg.data.prefix), required=False) if cfg.data.prefix else {}
    inputs = meta.get("inputs") or {}
    source = _base(inputs.get("source", "")) or ", ".join(_base(p) for p in cfg.data.prefix) or "unknown"
    tok = meta.get("tokenizer") or {}
    from megahash.data.samples import consumed_samples

    samples = consumed_samples(t, int(step))  # step x global batch, or the sum of a batch ramp's batches
    tokens = samples * cfg.data.seq_length
    batch = (
        f"{step:,} steps x {t.global_batch_size} sequences"
        if not t.batch_ramp
        else f"{step:,} steps, {samples:,} sequences (batch ramped from {t.batch_ramp[0]} to {t.global_batch_size})"
    )
    variant = f"{m.schedule} attention, {m.embedding} embedding, {m.head} head, {t.objective}"
    use = (
        "AutoModelForCausalLM.from_pretrained(path)"
        if fmt == "qwen2"
        else "AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)"
    )
    lines = [
        "---",
        "library_name: transformers",
        "tags:",
        "- megahash",
        f"- {m.arch}",
        "---",
        "",
        f"# megahash {m.arch}: {variant}",
        "",
        f"Exported by `megahash export-hf` ({fmt} format) from step {step}.",
        "",
        "| | |",
        "| --- | --- |",
        f"| variant | {variant} |",
        f"| parameters | {total:,} total, {emb:,} token embedding, {total - emb:,} other |",
        f"| architecture | {m.num_layers} layers, hidden {m.hidden_size}, {m.num_heads} heads, "
        f"{m.num_query_groups or m.num_heads} key/value groups, FFN {m.ffn_hidden_size}, RoPE base {m.rotary_base} |",
        f"| vocabulary | {tok.get('vocab_size') or m.vocab_size or model.vocab_size} ({tok.get('kind', 'unknown')} tokenizer) |",
        f"| context | {cfg.data.seq_length} tokens (trained; lm-eval reads `n_positions`) |",
        f"| training | {batch} x {cfg.data.seq_length} tokens = {tokens:,} tokens, "
        f"lr {t.lr}, objective {t.objective} |",
        f"| training data | {source} ({(meta.get('counts') or {}).get('documents', '?')} documents, "
        f"{(meta.get('counts') or {}).get('tokens', '?')} tokens) |",
        "",
    ]
    rows = _eval_rows(run_dir)
    if rows:
        lines += ["## Evaluation (megahash eval)", "", "| task | metric | value |", "| --- | --- | ---: |"]
        lines += [f"| {task} | {name} | {value:.4g} |" for task, name, value in rows]
        lines.append("")
    lines += [
        "## Usage",
        "",
        "```python",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        "tok = AutoTokenizer.from_pretrained(path)",
        f"model = {use}",
        "```",
        "",
    ]
    (out / "README.md").write_text("\n".join(lines), encoding="utf-8")
    return "README.md"
