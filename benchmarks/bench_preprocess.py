#!/usr/bin/env python
"""Tokens/s of data_tools/preprocess_data.py with word-hash side shards vs a plain tokenise+write
baseline, both in this process on the same corpus, tokenizer and worker count.

    python benchmarks/bench_preprocess.py [--input shakespeare] [--workers 1] [--hashes md5,lsh128]

Baseline: the corpus read by the same source reader, each document encoded with
``SentencePieceProcessor.encode`` (per document, like megatron's tools/preprocess_data.py), EOS
appended, written with megatron-core's ``IndexedDatasetBuilder`` (``add_document``); with
``--workers N > 1`` the encoding runs in a pool of N processes (``imap`` over 32-document chunks).
Ours: ``preprocess_data.main`` (one pass: tokenisation, hashing, token + side shards and word
counts; then the LSH vocabulary and LSH side shards; checksums, meta). Runs alternate; the best of
``--repeats`` of each is reported. Prints both rates
and ``ratio = ours / baseline`` (1.0 = hashing costs nothing), by wall clock and by CPU time
(user + system of this process and its joined workers: robust on a shared machine).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megahash.data.preprocess import preprocess_data, train_tokenizer
from megahash.data.preprocess.sources import open_source, parse_doc_range, select_documents

_SP = {}


def _init(model: str) -> None:
    import sentencepiece as spm

    _SP["sp"] = spm.SentencePieceProcessor(model_file=model)


def _encode(chunk: list[str]) -> list[list[int]]:
    sp = _SP["sp"]
    return [sp.encode(doc) + [2] for doc in chunk]


def _chunks(docs, size=32):
    chunk = []
    for d in docs:
        if d.strip():
            chunk.append(d)
            if len(chunk) == size:
                yield chunk
                chunk = []
    if chunk:
        yield chunk


def baseline(src: str, start: int, end, model: str, out_prefix: str, workers: int) -> int:
    """Tokenise + write with megatron-core's IndexedDatasetBuilder; returns the token count."""
    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    import sentencepiece as spm

    vocab = spm.SentencePieceProcessor(model_file=model).get_piece_size()
    builder = IndexedDatasetBuilder(out_prefix + ".bin", dtype=DType.optimal_dtype(vocab))
    chunks = _chunks(select_documents(open_source(src), start, end))
    tokens = 0
    if workers > 1:
        pool = mp.get_context("fork").Pool(workers, _init, (model,))
        results = pool.imap(_encode, chunks)
    else:
        _init(model)
        pool, results = None, map(_encode, chunks)
    try:
        for encoded in results:
            for ids in encoded:
                builder.add_document(torch.IntTensor(ids), [len(ids)])
                tokens += len(ids)
    finally:
        if pool is not None:
            pool.close()
            pool.join()
    builder.finalize(out_prefix + ".idx")
    return tokens


def _cpu() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--input", default="shakespeare")
    p.add_argument("--max-docs", type=int, default=None)
    p.add_argument("--tokenizer", default=None, help="sentencepiece .model (default: train an 8k BPE on the input)")
    p.add_argument("--vocab-size", type=int, default=8000)
    p.add_argument("--hashes", default="md5,lsh128")
    p.add_argument("--hash-unit", default="word", choices=["word", "subword"])
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)

    tmp = Path(tempfile.mkdtemp(prefix="bench_preprocess_"))
    try:
        model = args.tokenizer
        if model is None:
            model = str(tmp / "tok.model")
            rc = train_tokenizer.main(
                [
                    "--input",
                    args.input,
                    "--output",
                    str(tmp / "tok"),
                    "--vocab-size",
                    str(args.vocab_size),
                    "--quiet",
                    "--lossy",
                ]
            )  # the figures in docs/data.md
            if rc:
                return rc
        start, end = parse_doc_range(None, 0, args.max_docs)
        import sentencepiece  # noqa: F401
        import torch  # noqa: F401  (imports outside the timed regions)

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import megatron.core.datasets.indexed_dataset  # noqa: F401

        base_t, ours_t, base_c, ours_c = [], [], [], []
        base_tokens = ours_tokens = 0
        ours_args = [
            "--input",
            args.input,
            "--tokenizer",
            model,
            "--word-hashes",
            args.hashes,
            "--hash-unit",
            args.hash_unit,
            "--workers",
            str(args.workers),
            "--quiet",
            "--overwrite",
        ]
        if args.max_docs is not None:
            ours_args += ["--max-docs", str(args.max_docs)]
        for _r in range(args.repeats):
            t, c = time.perf_counter(), _cpu()
            base_tokens = baseline(args.input, start, end, model, str(tmp / "base"), args.workers)
            base_t.append(time.perf_counter() - t)
            base_c.append(_cpu() - c)
            t, c = time.perf_counter(), _cpu()
            rc = preprocess_data.main([*ours_args, "--output-prefix", str(tmp / "ours")])
            ours_t.append(time.perf_counter() - t)
            ours_c.append(_cpu() - c)
            if rc:
                return rc
            ours_tokens = json.loads((tmp / "ours_meta.json").read_text())["counts"]["tokens"]
        if base_tokens != ours_tokens:
            print(f"warning: token counts differ: baseline {base_tokens}, ours {ours_tokens}", file=sys.stderr)
        base_rate, ours_rate = base_tokens / min(base_t), ours_tokens / min(ours_t)
        result = {
            "input": args.input,
            "documents_max": args.max_docs,
            "tokens": ours_tokens,
            "workers": args.workers,
            "hashes": args.hashes,
            "hash_unit": args.hash_unit,
            "cpus": os.cpu_count(),
            "baseline_s": round(min(base_t), 3),
            "ours_s": round(min(ours_t), 3),
            "baseline_tokens_per_s": round(base_rate),
            "ours_tokens_per_s": round(ours_rate),
            "ratio": round(ours_rate / base_rate, 3),
            "baseline_cpu_s": round(min(base_c), 3),
            "ours_cpu_s": round(min(ours_c), 3),
            "ratio_cpu": round(min(base_c) / min(ours_c), 3),
        }
        if args.json:
            print(json.dumps(result))
        else:
            print(
                f"corpus {args.input}: {ours_tokens:,} tokens, workers {args.workers}, hashes {args.hashes} "
                f"(unit {args.hash_unit}), best of {args.repeats}"
            )
            print(
                f"baseline (sentencepiece + IndexedDatasetBuilder): {base_rate:12,.0f} tokens/s  ({min(base_t):.2f} s)"
            )
            print(
                f"preprocess_data.py with hash side shards:         {ours_rate:12,.0f} tokens/s  ({min(ours_t):.2f} s)"
            )
            print(
                f"ratio ours/baseline: {result['ratio']:.2f} (wall clock), {result['ratio_cpu']:.2f} (CPU time: "
                f"{min(base_c):.2f} s vs {min(ours_c):.2f} s)"
            )
        return 0
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
