"""``megahash eval --text SRC``: loss, perplexity and bits per byte of a checkpoint on raw text.

    megahash eval --checkpoint runs/quickstart --text held_out.jsonl [--limit DOCS] [--out FILE.json]

SRC is any input of the data stage (megahash/data/preprocess/sources.py: ``.txt`` blank-line blocks,
``.jsonl``, ``.parquet``, a folder or glob, ``hf:NAME:SPLIT``, ``shakespeare``); every document is
scored as lm-eval's ``loglikelihood_rolling`` scores it (megahash/eval/lm.py: disjoint windows of
``--max-length`` tokens after a ``</s>`` prefix, every token once), and

    bpb = sum of token NLL (nats) / (ln 2 * bytes)                     (lm-eval's ``bits_per_byte``)

and, on a line of its own, the same text scored with strided windows (``--stride S``, default half the
window; 0 = off): each window ends S tokens after the previous one and scores those S tokens with up to
the full window before them as context, the sliding-window perplexity of transformers' guide; lm-eval's
disjoint windows give a window's early tokens almost no context, so the strided number is usually the
lower (not for a model that makes little use of context: the compact ladder's 0.14-1.6M models score
within -0.15% to +0.23% of their disjoint number at S = 64 of 128), and the two agree at ``S = --max-length``. The bytes are counted per token as in training's validation (megahash/data/text_bytes.py; equal to
``len(text.encode())`` for a lossless tokenizer, tested against lm-eval's own count and metric); a
word stream counts ``len(text.encode())``. Written to ``--out`` (default ``RUN_DIR/eval/STEP_text_SRCNAME.json``, SRC's name: :func:`source_tag`).
"""

from __future__ import annotations

import json
import math
import re
import sys
import time
from pathlib import Path

from megahash.errors import ConfigError


class _Request:
    """The one field lm-eval's ``Instance`` gives ``loglikelihood_rolling``: ``args = (text,)``."""

    def __init__(self, text: str):
        self.args = (text,)


def documents(src: str, limit=None) -> tuple[list[str], int]:
    """The documents of a data-stage SRC (the first ``limit`` when given, a fraction < 1 of them as lm-eval's
    ``--limit``; one-line error when empty) and how many invalid UTF-8 bytes were read as U+FFFD."""
    from megahash.data.preprocess.sources import open_source
    from megahash.errors import DataError

    source, docs = open_source(src), []
    for doc in source.documents():
        if limit is not None and limit >= 1 and len(docs) >= limit:
            break
        docs.append(doc)
    if limit is not None and limit < 1:
        docs = docs[: math.ceil(len(docs) * limit)]
    if not docs:
        raise DataError(f"--text {src} holds no documents")
    return docs, source.replaced_chars


def text_metrics(
    lm, docs: list[str], stride: int = 0, dynamic_lr: float = 0.0, dynamic_clip: float = 1.0, on_static=None
) -> dict:
    """Sums and metrics of ``docs`` through a ``MegahashEvalLM``: NLL, tokens, bytes, loss, ppl, bpb
    (lm-eval's disjoint windows), for a ``stride`` the same of strided windows under ``sliding``, and for a
    ``dynamic_lr`` > 0 the same under dynamic evaluation (megahash/eval/dynamic.py) under ``dynamic``.
    ``on_static(metrics)`` is called with the static metrics before the dynamic pass (about 3x as long) starts."""
    from megahash.data.text_bytes import TokenBytes
    from megahash.eval.dynamic import check_model, check_settings, dynamic_nll

    check_settings(dynamic_lr, dynamic_clip)  # bad settings before the work
    if dynamic_lr > 0:
        check_model(lm)
    sliding = -sum(lm.loglikelihood_sliding(docs, stride)) if stride else None  # a bad stride before the work
    nll = -sum(lm.loglikelihood_rolling([_Request(d) for d in docs]))
    encoded = [lm.codec.encode(d).ids for d in docs]
    tokens = sum(len(ids) for ids in encoded)
    if lm.codec.sp is not None:
        counter = TokenBytes(lm.codec.sp)
        n_bytes = sum(counter.count(ids) for ids in encoded)
    else:  # a word stream: the text itself
        n_bytes = sum(len(d.encode("utf-8")) for d in docs)
    loss_only = lm.hash_head  # a hash-code head scores codes, not the text: a loss, no ppl or bpb (docs/eval.md)
    out = {"documents": len(docs), "tokens": tokens, "bytes": n_bytes, **_scores(nll, tokens, n_bytes, loss_only)}
    if stride:
        out["sliding"] = {"stride": stride, **_scores(sliding, tokens, n_bytes, loss_only)}
    if on_static is not None:
        on_static(out)
    if dynamic_lr > 0:
        nll_dyn = dynamic_nll(lm, docs, dynamic_lr, dynamic_clip)
        out["dynamic"] = {"lr": dynamic_lr, "clip": dynamic_clip, **_scores(nll_dyn, tokens, n_bytes)}
    return out


def _scores(nll: float, tokens: int, n_bytes: int, loss_only: bool = False) -> dict:
    """NLL, mean loss per token and, unless ``loss_only``, perplexity (None past a float's range) and bits per byte."""
    from megahash.data.text_bytes import bits_per_byte, perplexity

    loss = nll / max(tokens, 1)
    if loss_only:
        return {"nll": nll, "loss": loss}
    return {"nll": nll, "loss": loss, "ppl": perplexity(loss), "bpb": bits_per_byte(nll, n_bytes)}


def _tail(m: dict) -> str:
    """``loss ... nats/token[, ppl ..., bpb ...]`` of a :func:`_scores` record."""
    text = f"loss {m['loss']:.4f} nats/token"
    if "bpb" not in m:
        return text + " (of the head's hash codes: no ppl or bits per byte)"
    ppl = "beyond float range" if m["ppl"] is None else f"{m['ppl']:.4g}"
    return f"{text}, ppl {ppl}, bpb {m['bpb']:.4f}"


def weights_tag(weights: str) -> str:
    """The part of a default results file name that says which weights were scored: "" (live), "_ema",
    "_<artifact file name>"."""
    if weights == "live":
        return ""
    return "_" + ("ema" if weights == "ema" else Path(weights).name.replace(".", "_"))


def source_tag(src: str) -> str:
    """The part of a default results file name that says which text was scored: ``_`` and SRC's name (a file's
    stem, a folder's or glob's last part, ``hf:NAME:SPLIT`` as ``hf_NAME_SPLIT``), so results of different texts
    of one checkpoint do not collide."""
    name = src.rstrip("/\\").rsplit("/", 1)[-1]
    if "." in name and not name.startswith("hf:"):
        name = name.rsplit(".", 1)[0]
    name = re.sub(r"[^A-Za-z0-9_-]+", "_", name).strip("_") or re.sub(r"[^A-Za-z0-9_-]+", "_", src).strip("_")
    return f"_{name}" if name else ""


def evaluate_text(
    ckpt_dir,
    src: str,
    out=None,
    limit=None,
    batch_size: int = 8,
    max_length=None,
    tokenizer=None,
    overrides=None,
    overwrite: bool = True,
    quiet: bool = False,
    stride: int | None = None,
    weights: str = "live",
    dynamic_lr: float | None = None,
    dynamic_clip: float | None = None,
) -> dict:
    """Score ``src`` with the checkpoint's ``weights`` (live, ema or a quantized artifact's path); write the
    JSON record and print one line per window scheme (``stride``: None = half the window, 0 = lm-eval's
    disjoint windows only) and one for dynamic evaluation (``dynamic_lr``/``dynamic_clip``: None = the run's
    ``eval.dynamic_lr``/``eval.dynamic_clip``; a step size of 0 = none)."""
    from megahash.accelerator import process_groups
    from megahash.atomic_write import write_text_atomic
    from megahash.checkpoint.resolve import resolve_for_inference
    from megahash.eval.dynamic import check_settings

    ckpt = resolve_for_inference(ckpt_dir, overrides)
    out = Path(out) if out else ckpt.parent / "eval" / f"{ckpt.name}_text{source_tag(src)}{weights_tag(weights)}.json"
    if out.exists() and not overwrite:  # as megahash eval's task results (eval/run.py refuse_existing)
        raise ConfigError(f"{out} already exists; pass --overwrite to replace it (or --out for another file)")
    from megahash.atomic_write import check_writable

    check_writable(out, "pass --out FILE elsewhere")  # a read-only run folder: before the scoring, not after
    docs, replaced = documents(src, limit)
    if replaced and not quiet:
        print(
            f"warning: --text {src}: {replaced} invalid UTF-8 byte(s) read as U+FFFD (counted as its 3 bytes); "
            "scores are of the decoded text",
            file=sys.stderr,
        )
    t0 = time.time()
    from megahash.eval.lm import MegahashEvalLM

    with process_groups.releasing_group():
        lm = MegahashEvalLM(
            checkpoint=str(ckpt),
            batch_size=batch_size,
            max_length=max_length,
            tokenizer=tokenizer,
            overrides=overrides,
            weights=weights,
        )
        max_len = lm.max_length
        lr = lm.cfg.eval.dynamic_lr if dynamic_lr is None else dynamic_lr
        clip = lm.cfg.eval.dynamic_clip if dynamic_clip is None else dynamic_clip
        check_settings(
            lr,
            clip,
            (
                "eval.dynamic_lr" if dynamic_lr is None else "--dynamic-lr",
                "eval.dynamic_clip" if dynamic_clip is None else "--dynamic-clip",
            ),
        )
        if dynamic_clip is not None and lr == 0:
            raise ConfigError(
                f"--dynamic-clip sets dynamic evaluation's clipping, which is off here (eval.dynamic_lr "
                f"{lm.cfg.eval.dynamic_lr:g}{'' if dynamic_lr is None else ', --dynamic-lr 0'}): pass --dynamic-lr LR"
            )

        def on_static(static: dict) -> None:  # printed now: a dynamic pass takes about 3x as long again
            if not quiet:
                print(static_lines(src, static, max_len), flush=True)
                if lr > 0:
                    print(f"{src}: dynamic evaluation (SGD lr {lr:g}, clip {clip:g}) ...", file=sys.stderr, flush=True)

        metrics = text_metrics(lm, docs, max(1, max_len // 2) if stride is None else stride, lr, clip, on_static)
        del lm
        if "dynamic" in metrics and not quiet:
            print(dynamic_line(src, metrics["dynamic"]), flush=True)
    from megahash.checkpoint.layout import read_state

    step = read_state(ckpt).get("step")
    record = {
        "megahash_eval_text": 1,
        "checkpoint": str(ckpt),
        "step": step,
        "text": src,
        "limit": limit,
        "weights": weights,
        "max_length": max_len,
        "replaced_invalid_utf8_chars": replaced,
        **metrics,
        "seconds": round(time.time() - t0, 2),
    }
    write_text_atomic(out, json.dumps(record, indent=1) + "\n")
    if not quiet:
        print(f"wrote {out}", file=sys.stderr)
    return record


def static_lines(src: str, metrics: dict, max_len: int) -> str:
    """The printed lines of the static schemes: lm-eval's disjoint windows and, when scored, the strided ones."""
    lines = [
        f"{src}: {metrics['documents']} documents, {metrics['tokens']} tokens, {metrics['bytes']} bytes: "
        f"{_tail(metrics)} (disjoint windows of {max_len} tokens, as lm-eval)"
    ]
    if "sliding" in metrics:
        sl = metrics["sliding"]
        lines.append(f"{src}: sliding windows of {max_len} tokens, stride {sl['stride']}: {_tail(sl)}")
    return "\n".join(lines)


def dynamic_line(src: str, dy: dict) -> str:
    """The printed line of dynamic evaluation."""
    return (
        f"{src}: dynamic evaluation (disjoint windows, SGD lr {dy['lr']:g}, clip {dy['clip']:g}, each window "
        f"scored before the step on it): {_tail(dy)}"
    )
