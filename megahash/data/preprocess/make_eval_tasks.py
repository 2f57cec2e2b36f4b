"""Offline lm-eval task suite from held-out documents of the offline corpora.

    python data_tools/make_eval_tasks.py --source bible-kjv --out data/eval_tasks [--n 200] [--seed 1234]
    python data_tools/make_eval_tasks.py --source shakespeare --out data/eval_tasks --held-out-docs 1100:
    python data_tools/make_eval_tasks.py --source my_corpus.jsonl --out data/eval_tasks --name mine

No benchmark data is copied: every item is built from the SOURCE's documents in
``--held-out-docs START:END`` (document indices as ``data_tools/preprocess_data.py --doc-range``
counts them, so a training run with ``--doc-range 0:START`` never saw them). The tasks have the
output types and metrics of the [Xue25] lm-eval tasks (Table 4.1):

==========================  ======================  ====================================================
task                        like                    item / metrics
==========================  ======================  ====================================================
``NAME_next``               HellaSwag (4-way)       2-3 sentences of a document, then its true next
                                                    sentence vs 3 sentences of other documents of similar
                                                    length; ``multiple_choice``: acc, acc_norm (chance 25%)
``NAME_order``              PIQA/COPA (2-way)       the previous sentence, then a sentence vs the same
                                                    words shuffled; ``multiple_choice``: acc, acc_norm (50%)
``NAME_ppl``                WikiText                whole documents; ``loglikelihood_rolling``:
                                                    word_perplexity, byte_perplexity, bits_per_byte
``NAME_lastword``           LAMBADA (OpenAI)        passages whose last word already occurs in them;
                                                    ``loglikelihood`` of " " + last word: perplexity, acc
``NAME_lastword_gen``       LAMBADA, generated      same passages; ``generate_until`` (greedy, 8 tokens,
                                                    first word kept): exact_match
==========================  ======================  ====================================================

Each task is ``DIR/NAME_x.yaml`` (``dataset_path: json``, ``dataset_kwargs.data_files`` = the
absolute path of ``DIR/NAME_x.jsonl``, ``test_split: test``) plus its JSONL; all carry the tag
``NAME_suite``. Run them offline with ``megahash eval --tasks-dir DIR --tasks NAME_suite`` (or a
list of task names). ``DIR/NAME_manifest.json`` records the source, document range, seed and counts;
``DIR/NAME_held_out.txt`` holds the held-out text (first pages of the documents) for ``megahash indicators --text``.
Output is a pure function of (source, range, --n, --seed, ...): sentences come from a fixed
regex split, every random choice from ``random.Random(seed)``. An ``--out`` that already holds
``NAME_*`` files is refused in one line (exit 2) unless ``--overwrite`` is given.

NAME defaults to ``shk`` (shakespeare), ``kjv`` (bible-kjv) or the file's stem. Default held-out
ranges: shakespeare ``1100:`` (its last 103 of 1,203 documents: the quickstart trains on all of
shakespeare, so hold them out there with ``preprocess_data.py --doc-range 0:1100`` when scoring
these), bible-kjv and files: all documents.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
from collections.abc import Sequence
from pathlib import Path

from megahash.arguments import ArgumentParser
from megahash.atomic_write import write_text_atomic
from megahash.data.preprocess.common import InputError, cli
from megahash.data.preprocess.sources import open_source, parse_doc_range, select_documents

DEFAULT_RANGES = {"shakespeare": "1100:", "bible-kjv": "0:", "bible": "0:"}
DEFAULT_NAMES = {"shakespeare": "shk", "bible-kjv": "kjv", "bible": "kjv"}
_SENT_END = re.compile(r"(?<=[.!?;:])\s+(?=[\"'(\[]?[A-Z])")
_WS = re.compile(r"\s+")
_WORD = re.compile(r"[A-Za-z]+")


def sentences(doc: str) -> list[str]:
    """Whitespace-normalised sentences of a document (split after . ! ? ; : before a capital)."""
    lines = doc.splitlines()
    if lines and re.fullmatch(r"[1-3]?\s?[A-Z][A-Za-z ]+ \d+", lines[0].strip()):  # bible chapter heading
        lines = lines[1:]
    text = _WS.sub(" ", " ".join(lines)).strip()
    return [s.strip() for s in _SENT_END.split(text) if s.strip()]


def n_words(s: str) -> int:
    return len(s.split())


def _slug(name: str) -> str:
    s = re.sub(r"[^A-Za-z0-9]+", "_", name).strip("_").lower()
    return s or "corpus"


def build_items(docs: list[list[str]], pages: list[str], n: int, ppl_docs: int, seed: int) -> dict[str, list[dict]]:
    rng = random.Random(seed)
    pool = [(d, i, s) for d, sents in enumerate(docs) for i, s in enumerate(sents) if 4 <= n_words(s) <= 40]
    by_len: dict[int, list[tuple[int, str]]] = {}
    for d, _, s in pool:
        by_len.setdefault(n_words(s), []).append((d, s))

    def distractors(doc: int, gold: str, k: int) -> list[str] | None:
        """k distinct sentences of other documents as long as ``gold``: the word count widens from
        exact until 3k candidates exist, then k are drawn among the 3k closest in characters (so
        neither acc, which sums log-probabilities, nor acc_norm favours the gold by length)."""
        L = n_words(gold)
        cands: set = set()
        for width in range(0, L):
            for m in {L - width, L + width}:
                cands.update(s for d, s in by_len.get(m, []) if d != doc and s != gold)
            if len(cands) >= 3 * k:
                break
        if len(cands) < k:
            return None
        closest = sorted(cands, key=lambda s: (abs(len(s) - len(gold)), s))[: 3 * k]
        return rng.sample(closest, k)

    # next sentence (HellaSwag-like)
    nxt, order, lastword = [], [], []
    positions = [
        (d, i)
        for d, sents in enumerate(docs)
        for i in range(2, len(sents))
        if 4 <= n_words(sents[i]) <= 40 and n_words(" ".join(sents[i - 2 : i])) >= 6
    ]
    rng.shuffle(positions)
    for d, i in positions:
        if len(nxt) >= n:
            break
        k = 3 if i >= 3 and n_words(" ".join(docs[d][i - 3 : i])) <= 60 else 2
        ctx = " ".join(docs[d][i - k : i])
        gold = docs[d][i]
        dis = distractors(d, gold, 3)
        if dis is None:
            continue
        label = rng.randrange(4)
        endings = dis[:label] + [gold] + dis[label:]
        nxt.append({"ctx": ctx, "endings": endings, "label": label, "doc": d})
    # word order (2-way)
    positions = [(d, i) for d, sents in enumerate(docs) for i in range(1, len(sents)) if 5 <= n_words(sents[i]) <= 25]
    rng.shuffle(positions)
    for d, i in positions:
        if len(order) >= n:
            break
        words = docs[d][i].split()
        shuffled = words[:]
        for _ in range(10):
            rng.shuffle(shuffled)
            if shuffled != words:
                break
        if shuffled == words:
            continue
        label = rng.randrange(2)
        choices = [" ".join(shuffled)] * 2
        choices[label] = docs[d][i]
        order.append({"ctx": docs[d][i - 1], "choices": choices, "label": label, "doc": d})
    # last word (LAMBADA-like): passages of 30-120 words whose final word occurs earlier in them
    spans = []
    for d, sents in enumerate(docs):
        for end in range(1, len(sents)):
            last = sents[end].rstrip(" .,;:!?'\")]")
            m = re.search(r"(?:^|\s)([A-Za-z]{3,})$", last)  # the last space-separated token is a plain word
            if not m:
                continue
            start = end
            while start > 0 and n_words(" ".join(sents[start : end + 1])) < 30:
                start -= 1
            passage = " ".join(sents[start:end]) + " " + last if start < end else last
            if not 30 <= n_words(passage) <= 120:
                continue
            target = m.group(1)
            if target.isupper():  # a speaker heading (shakespeare), not running text
                continue
            earlier = passage[: len(passage) - len(target)].lower()
            if not re.search(rf"\b{re.escape(target.lower())}\b", earlier):
                continue
            spans.append((d, passage))
    rng.shuffle(spans)
    seen = set()
    for d, passage in spans:
        if len(lastword) >= n:
            break
        if passage in seen:
            continue
        seen.add(passage)
        lastword.append({"text": passage, "doc": d})
    order_pages = list(range(len(pages)))
    rng.shuffle(order_pages)
    ppl = [{"page": pages[i], "doc": i} for i in sorted(order_pages[:ppl_docs])]
    return {"next": nxt, "order": order, "ppl": ppl, "lastword": lastword, "lastword_gen": lastword}


MC_METRICS = [
    {"metric": "acc", "aggregation": "mean", "higher_is_better": True},
    {"metric": "acc_norm", "aggregation": "mean", "higher_is_better": True},
]


def task_yaml(task: str, kind: str, data_file: str, tag: str) -> dict:
    base = {
        "tag": [tag],
        "task": task,
        "dataset_path": "json",
        "dataset_name": None,
        "dataset_kwargs": {"data_files": {"test": data_file}},
        "test_split": "test",
    }
    if kind == "next":
        base.update(
            {
                "output_type": "multiple_choice",
                "doc_to_text": "{{ctx}}",
                "doc_to_choice": "{{endings}}",
                "doc_to_target": "{{label}}",
                "metric_list": MC_METRICS,
            }
        )
    elif kind == "order":
        base.update(
            {
                "output_type": "multiple_choice",
                "doc_to_text": "{{ctx}}",
                "doc_to_choice": "{{choices}}",
                "doc_to_target": "{{label}}",
                "metric_list": MC_METRICS,
            }
        )
    elif kind == "ppl":
        base.update(
            {
                "output_type": "loglikelihood_rolling",
                "doc_to_text": "",
                "doc_to_target": "{{page}}",
                "metric_list": [
                    {"metric": "word_perplexity"},
                    {"metric": "byte_perplexity"},
                    {"metric": "bits_per_byte"},
                ],
            }
        )
    elif kind == "lastword":
        base.update(
            {
                "output_type": "loglikelihood",
                "doc_to_text": "{{text.split(' ')[:-1]|join(' ')}}",
                "doc_to_target": "{{' '+text.split(' ')[-1]}}",
                "metric_list": [
                    {"metric": "perplexity", "aggregation": "perplexity", "higher_is_better": False},
                    {"metric": "acc", "aggregation": "mean", "higher_is_better": True},
                ],
            }
        )
    elif kind == "lastword_gen":
        base.update(
            {
                "output_type": "generate_until",
                "doc_to_text": "{{text.split(' ')[:-1]|join(' ')}}",
                "doc_to_target": "{{text.split(' ')[-1]}}",
                "generation_kwargs": {
                    "until": ["\n", ".", ",", ";", ":", "!", "?"],
                    "max_gen_toks": 8,
                    "do_sample": False,
                },
                "filter_list": [
                    {
                        "name": "first_word",
                        "filter": [
                            {"function": "regex", "regex_pattern": "(\\w+)", "group_select": 0},
                            {"function": "take_first"},
                        ],
                    }
                ],
                "metric_list": [
                    {
                        "metric": "exact_match",
                        "aggregation": "mean",
                        "higher_is_better": True,
                        "ignore_case": True,
                        "ignore_punctuation": True,
                    }
                ],
            }
        )
    base["metadata"] = {"version": 1.0}
    return base


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--source", required=True, help="shakespeare | bible-kjv | PATH (.txt/.jsonl/.parquet/dir)")
    p.add_argument("--out", required=True, help="output directory (YAML + JSONL per task)")
    p.add_argument("--held-out-docs", default=None, help="document range START:END (default: per source)")
    p.add_argument("--n", type=int, default=200, help="items per multiple-choice / last-word task")
    p.add_argument("--ppl-docs", type=int, default=40, help="documents in the perplexity task")
    p.add_argument("--max-doc-chars", type=int, default=6000, help="cut perplexity documents at a sentence end")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--name", default=None, help="task name prefix (default: shk, kjv or the file stem)")
    p.add_argument("--json-key", default="text")
    p.add_argument("--txt-mode", default="blocks", choices=["blocks", "lines"])
    p.add_argument("--overwrite", action="store_true", help="replace the NAME_* files of an earlier run in --out")
    return p


def run(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.n < 1 or args.ppl_docs < 1:
        raise InputError("--n and --ppl-docs must be >= 1")
    source = open_source(args.source, txt_mode=args.txt_mode, json_key=args.json_key)
    rng_spec = args.held_out_docs or DEFAULT_RANGES.get(args.source, "0:")
    start, end = parse_doc_range(rng_spec)
    name = _slug(args.name or DEFAULT_NAMES.get(args.source) or Path(args.source.rstrip("/")).stem)
    out = Path(args.out).resolve()
    existing = sorted(p.name for p in out.glob(f"{name}_*") if p.is_file()) if out.is_dir() else []
    if existing and not args.overwrite:
        raise InputError(
            f"output {str(out)!r} already holds the {name} tasks ({existing[0]}); pass --overwrite to "
            f"replace them (or --name for another suite beside them)"
        )
    docs, pages = [], []
    for doc in select_documents(source, start, end):
        sents = sentences(doc)
        if not sents:
            continue
        docs.append(sents)
        page, size = [], 0
        for s in sents:
            if size + len(s) > args.max_doc_chars and page:
                break
            page.append(s)
            size += len(s) + 1
        pages.append(" ".join(page))
    if len(docs) < 2:
        raise InputError(
            f"--held-out-docs {rng_spec} of {args.source!r} selects {len(docs)} non-empty documents; need >= 2"
        )
    items = build_items(docs, pages, args.n, args.ppl_docs, args.seed)
    out.mkdir(parents=True, exist_ok=True)
    import yaml

    tag = f"{name}_suite"
    counts = {}
    for kind, rows in items.items():
        if not rows:
            raise InputError(f"no items for task {name}_{kind}: the held-out documents are too few or too short")
        task = f"{name}_{kind}"
        data = out / f"{task}.jsonl"
        write_text_atomic(data, "".join(json.dumps(r, ensure_ascii=False, sort_keys=True) + "\n" for r in rows))
        write_text_atomic(
            out / f"{task}.yaml",
            yaml.safe_dump(task_yaml(task, kind, str(data), tag), sort_keys=False, allow_unicode=True),
        )
        counts[task] = len(rows)
    # the held-out text itself, for `megahash indicators --text` (first pages of the held-out documents)
    held = out / f"{name}_held_out.txt"
    write_text_atomic(held, "\n\n".join(pages) + "\n")
    manifest = {
        "source": args.source,
        "held_out_docs": [start, end],
        "documents": len(docs),
        "seed": args.seed,
        "held_out_text": held.name,
        "n": args.n,
        "ppl_docs": args.ppl_docs,
        "max_doc_chars": args.max_doc_chars,
        "tag": tag,
        "tasks": counts,
    }
    write_text_atomic(out / f"{name}_manifest.json", json.dumps(manifest, indent=1) + "\n")
    print(
        f"wrote {len(counts)} tasks (tag {tag}) to {out}: "
        + ", ".join(f"{k} {v}" for k, v in counts.items())
        + f"; held-out text {held}"
    )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return cli(run, argv)


if __name__ == "__main__":
    sys.exit(main())
