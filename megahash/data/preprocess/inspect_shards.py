"""Inspect (and with --verify, check) shards written by preprocess_data.py.

    python data_tools/inspect_shards.py data/shk/shk [--verify] [--json]

Prints counts, a document-length histogram, a decoded sample document and the side shards.
``--verify`` checks the sha256 of every file against the meta, that every side shard has the same
documents as the token shard with lengths = width x token lengths, and recomputes the codes of the
tokens of ``--verify-docs`` documents from their decoded words; it runs before the statistics, so a
damaged set prints only the one line training prints for it (``megahash/data/verify.py``). Without it the
sizes and headers are checked as training's ``data.verify=cheap`` does (a truncated file is that line too), and
``--sample-doc`` must name a document of the set. Exit 0 = OK, 2 = a mismatch, bad usage or missing shards (one
``error:`` line).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

import numpy as np

from megahash.arguments import ArgumentParser
from megahash.data.preprocess.common import cli, one_line
from megahash.errors import DataError


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("prefix", help="output prefix given to preprocess_data.py (or PREFIX_text_document)")
    p.add_argument("--verify", action="store_true", help="check checksums, alignment and recomputed hashes")
    p.add_argument("--verify-docs", type=int, default=16, help="documents whose codes are recomputed")
    p.add_argument("--no-checksums", action="store_true", help="skip the sha256 checks of --verify")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.add_argument("--sample-doc", type=int, default=0, help="document to decode")
    p.add_argument("--sample-chars", type=int, default=400)
    p.add_argument(
        "--tokenizer",
        default=None,
        help="the shards' tokenizer (.model, tokenizer.json, HF folder or name), if moved since preprocessing",
    )
    return p


def length_histogram(lengths: np.ndarray) -> list[dict]:
    """Power-of-two bins ``[lo, hi)`` of document lengths with counts."""
    out = []
    if len(lengths) == 0:
        return out
    hi_exp = int(np.ceil(np.log2(max(int(lengths.max()), 1) + 1)))
    for e in range(hi_exp + 1):
        lo, hi = (0, 1) if e == 0 else (2 ** (e - 1), 2**e)
        n = int(((lengths >= lo) & (lengths < hi)).sum())
        if n or out:
            out.append({"lo": lo, "hi": hi, "count": n})
    while out and out[-1]["count"] == 0:
        out.pop()
    return out


def summarize(shards, sample_doc: int, sample_chars: int, tokenizer: str | None) -> dict:
    meta = shards.meta
    lengths = np.asarray(shards.tokens.sequence_lengths, dtype=np.int64)
    info = {
        "prefix": shards.prefix,
        "stream": meta["stream"],
        "tokenizer": {k: meta["tokenizer"].get(k) for k in ("kind", "path", "vocab_size")},
        "documents": shards.num_documents,
        "tokens": shards.num_tokens,
        "length": {
            "mean": float(lengths.mean()),
            "min": int(lengths.min()),
            "max": int(lengths.max()),
            "median": float(np.median(lengths)),
        },
        "histogram": length_histogram(lengths),
        "counts": meta["counts"],
        "side_shards": [
            {
                "name": name,
                "kind": spec.kind,
                "dtype": spec.dtype.name,
                "width": spec.width,
                "elements": int(np.asarray(ds.sequence_lengths, np.int64).sum()),
                "params": spec.params,
            }
            for name, (ds, spec) in shards.side.items()
        ],
    }
    if 0 <= sample_doc < shards.num_documents:
        try:
            text = shards.decode(sample_doc, tokenizer, max_tokens=4 * sample_chars)
        except DataError as e:
            text = f"<cannot decode: {one_line(e)}>"
        info["sample"] = {"document": sample_doc, "text": text[:sample_chars]}
    return info


def print_text(info: dict, out) -> None:
    s = info["stream"]
    tok = info["tokenizer"]
    w = out.write
    w(f"shards     {info['prefix']}\n")
    w(
        f"stream     {s['kind']} ({tok['kind']}{' ' + tok['path'] if tok.get('path') else ''}, vocab {tok['vocab_size']:,}), "
        f"dtype {s['dtype']}, EOS {'appended' if s['append_eos'] else 'not appended'}, hash unit {s['hash_unit']}\n"
    )
    c = info["counts"]
    w(
        f"documents  {info['documents']:,}   tokens {info['tokens']:,}   skipped empty {c.get('skipped_empty_documents', 0):,}   "
        f"replaced invalid UTF-8 chars {c.get('replaced_invalid_utf8_chars', 0):,}\n"
    )
    ln = info["length"]
    w(f"length     mean {ln['mean']:.1f}  median {ln['median']:.0f}  min {ln['min']}  max {ln['max']}\n")
    w("histogram  (tokens per document)\n")
    peak = max((b["count"] for b in info["histogram"]), default=1) or 1
    for b in info["histogram"]:
        bar = "#" * max(1 if b["count"] else 0, round(40 * b["count"] / peak))
        w(f"  [{b['lo']:>7,}, {b['hi']:>7,})  {b['count']:>8,}  {bar}\n")
    w("side shards\n")
    if not info["side_shards"]:
        w("  (none)\n")
    for sd in info["side_shards"]:
        w(
            f"  {sd['name']:<16} {sd['kind']:<10} {sd['dtype']:<6} x{sd['width']:<4} per token  {sd['elements']:,} elements\n"
        )
    if "sample" in info:
        w(f"sample     document {info['sample']['document']}:\n")
        for line in info["sample"]["text"].splitlines() or [""]:
            w(f"  | {line}\n")


def run(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from megahash.data.shards import ShardSet

    shards = ShardSet.open(args.prefix)
    n = shards.num_documents
    if not 0 <= args.sample_doc < max(n, 1):  # was no sample and no word about it
        raise DataError(f"--sample-doc {args.sample_doc}: the set has {n:,} documents, 0 to {n - 1:,}")
    # first: a damaged set is the one line (exit 2) training gives, not statistics of damaged files
    if args.verify:
        verified = shards.verify(args.verify_docs, not args.no_checksums, args.tokenizer)
    else:  # the sizes and headers training checks (data.verify=cheap): a truncated .bin was statistics of the
        # index, then numpy's "offset must be non-negative ..." from the sample decode
        from megahash.data.verify import verify_set

        verified = None
        verify_set(shards.prefix, "cheap", specs=list(shards.side), meta=shards.meta)
    info = summarize(shards, args.sample_doc, args.sample_chars, args.tokenizer)
    if verified is not None:
        info["verify"] = {"ok": True, **verified}
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        print_text(info, sys.stdout)
        v = info.get("verify")
        if v and v["ok"]:
            print(
                f"verify     OK: {v['checked_files']} checksums, {len(v['side_shards'])} side shards aligned, "
                f"codes of {v['checked_tokens']:,} tokens in {v['checked_documents']} documents recomputed"
            )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point: 0 OK, 2 verification mismatch, bad usage or missing shards."""
    return cli(run, argv)


if __name__ == "__main__":
    sys.exit(main())
