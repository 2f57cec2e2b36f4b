#!/usr/bin/env python
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
import hashlib
import json
import os
import signal
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Iterable, Iterator, Optional, Sequence

if __package__ in (None, ""):  # run as a script: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

import megahash  # noqa: E402
from megahash.data.verify import sha256_file  # noqa: E402
from megahash.data_stage.common import DataError, InputError, cli  # noqa: E402
from megahash.data_stage.encoding import (  # noqa: E402
    WORDS,
    ChunkEncoder,
    ChunkResult,
    EncoderConfig,
    GrowArray,
    resolve_tokenizer,
)
from megahash.data_stage.indexed_writer import IndexedShardWriter, optimal_token_dtype  # noqa: E402
from megahash.data_stage.ordered_pool import OrderedPool  # noqa: E402
from megahash.data_stage.sources import open_source, parse_doc_range, select_documents  # noqa: E402
from megahash.hashing.codes import hash_words  # noqa: E402
from megahash.hashing.lsh import DEFAULT_NGRAM_VOCAB, NGRAM_ORDERS, LSHModel  # noqa: E402
from megahash.hashing.md5 import DEFAULT_KEY  # noqa: E402
from megahash.hashing.specs import parse_hash_specs  # noqa: E402
from megahash.hashing.tokens import HASH_UNITS  # noqa: E402
from megahash.hashing.words import EOS_ID, NUM_SPECIAL, SPECIAL_TOKENS, WORD_PATTERN  # noqa: E402

FORMAT_VERSION = 1
FAIL_ENV = "MEGAHASH_PREPROCESS_FAIL_AFTER_DOCS"  # test hook: raise after writing this many documents


class InjectedFailure(DataError):
    """Raised by the ``MEGAHASH_PREPROCESS_FAIL_AFTER_DOCS`` test hook."""


# -- output names -----------------------------------------------------------------------------
def shard_names(prefix: str, spec_names: Sequence[str]) -> dict[str, str]:
    """Shard prefixes: ``tokens`` -> PREFIX_text_document, spec name -> PREFIX_hash_{spec}."""
    out = {"tokens": f"{prefix}_text_document"}
    out.update({name: f"{prefix}_hash_{name}" for name in spec_names})
    return out


class AtomicOutputs:
    """Temp files ``FINAL.tmp-<pid>``, renamed to their final names by ``commit`` (in order, the
    meta last), all removed by ``cleanup`` when anything fails."""

    def __init__(self):
        self.pending: dict[str, str] = {}  # final -> tmp
        self.scratch_files: list[str] = []  # temporary files that are never renamed
        self.suffix = f".tmp-{os.getpid()}"

    def scratch(self, name: str) -> str:
        """Path of a temporary work file ``NAME.tmp-<pid>``, removed by ``commit`` and ``cleanup``."""
        self.scratch_files.append(name + self.suffix)
        return self.scratch_files[-1]

    def remove_scratch(self) -> None:
        for tmp in self.scratch_files:
            try:
                os.remove(tmp)
            except FileNotFoundError:
                pass
        self.scratch_files.clear()

    def tmp(self, final: str) -> str:
        self.pending[final] = final + self.suffix
        return self.pending[final]

    def commit(self, last: str) -> None:
        from megahash.data_stage.publish import publish

        self.remove_scratch()
        publish(self.pending, last)  # old meta removed first, shards, then the meta (megahash/data_stage/publish.py)
        self.pending.clear()

    def cleanup(self) -> None:
        self.remove_scratch()
        for tmp in self.pending.values():
            try:
                os.remove(tmp)
            except FileNotFoundError:
                pass
        self.pending.clear()


# -- parallel map -----------------------------------------------------------------------------
_STATE: dict = {}


def _init_encoder(cfg: EncoderConfig, lsh: Optional[LSHModel]) -> None:
    """Worker initializer: forked workers inherit the encoder built by ``_encode_all`` (no second
    tokenizer load per worker) and only take their own id; otherwise (spawn) build one."""
    enc = _STATE.get("encoder")
    if enc is not None and enc.cfg is cfg:
        enc.worker = os.getpid()
    else:
        _STATE["encoder"] = ChunkEncoder(cfg, lsh)


def _encode_chunk(task: tuple[list[str], int]) -> ChunkResult:
    docs, n_count = task
    res = _STATE["encoder"].encode(docs, n_count)
    res.counted = n_count
    return res


def _finish_encoder(_) -> Counter:
    return _STATE["encoder"].finish()


# -- documents --------------------------------------------------------------------------------
class DocStats:
    def __init__(self):
        self.read = 0
        self.empty = 0


def chunked(docs: Iterable[str], stats: DocStats, max_docs: int, max_chars: int) -> Iterator[list[str]]:
    """Non-empty documents in lists of <= ``max_docs`` documents / about ``max_chars`` characters."""
    return (chunk for chunk, _ in chunked_tasks(docs, stats, max_docs, max_chars))


def chunked_tasks(docs: Iterable[str], stats: DocStats, max_docs: int, max_chars: int,
                  count_limit: Optional[int] = None) -> Iterator[tuple[list[str], int]]:
    """``(chunk, n)`` with the chunks of ``chunked``; the first ``n`` documents of a chunk are among
    the first ``count_limit`` selected source documents (empty ones included in that count; all of
    them when ``count_limit`` is None)."""
    chunk: list[str] = []
    size = counted = 0
    for doc in docs:
        stats.read += 1
        if not doc.strip():
            stats.empty += 1
            continue
        chunk.append(doc)
        size += len(doc)
        if count_limit is None or stats.read <= count_limit:
            counted += 1
        if len(chunk) >= max_docs or size >= max_chars:
            yield chunk, counted
            chunk, size, counted = [], 0, 0
    if chunk:
        yield chunk, counted


class Progress:
    """tqdm bar on stderr (docs/s, tokens/s); off with --quiet or when stderr is not a tty."""

    def __init__(self, desc: str, quiet: bool):
        self.bar = None
        self.tokens = 0
        self.t0 = time.perf_counter()
        if not quiet and not sys.stderr.isatty():  # logs: say what runs (the bar says it on a terminal)
            print(f"{desc}: tokenizing and hashing ...", flush=True)  # stdout: stderr is kept for the one-line error
        if not quiet and sys.stderr.isatty():
            from tqdm import tqdm

            tqdm.monitor_interval = 0  # no monitor thread (we fork worker processes)
            self.bar = tqdm(desc=desc, unit="doc", file=sys.stderr, dynamic_ncols=True, mininterval=0.5)

    def update(self, docs: int, tokens: int) -> None:
        self.tokens += tokens
        if self.bar is not None:
            self.bar.update(docs)
            rate = self.tokens / max(time.perf_counter() - self.t0, 1e-9)
            self.bar.set_postfix_str(f"{rate:,.0f} tok/s", refresh=False)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


# -- CLI --------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--input", required=True, help="SRC: file/dir/glob of .txt/.jsonl/.parquet, hf:NAME[:CONFIG]:SPLIT, shakespeare, bible-kjv")
    p.add_argument("--output-prefix", required=True)
    p.add_argument("--tokenizer", default=None, help="sentencepiece PREFIX.model, tokenizer.json, HF tokenizer folder or name, "
                   "or 'words' (vocabulary-free)")
    # Megatron-LM's tools/preprocess_data.py spellings (same meaning)
    p.add_argument("--tokenizer-type", default=None, help="Megatron alias: HuggingFaceTokenizer or SentencePieceTokenizer")
    p.add_argument("--tokenizer-model", default=None, help="Megatron alias of --tokenizer (with --tokenizer-type)")
    p.add_argument("--json-keys", nargs="+", default=None, help="Megatron alias of --json-key (one key)")
    p.add_argument("--append-eod", dest="append_eos", action="store_true", default=True, help="Megatron alias of --append-eos")
    p.add_argument("--word-hashes", default="", help="comma-separated hash specs: md5, md5-bucketN, lshT, lsh-bucketN, rollingN[-lenL]")
    p.add_argument("--hash-unit", choices=HASH_UNITS, default="word", help="subword streams: hash the whole word (default) or the piece")
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--json-key", default="text", help="text key of .jsonl/.parquet/hf rows")
    p.add_argument("--txt-mode", choices=["blocks", "lines"], default="blocks")
    p.add_argument("--append-eos", dest="append_eos", action="store_true", default=True, help="append </s> (id 2) to every document (default)")
    p.add_argument("--no-append-eos", dest="append_eos", action="store_false")
    p.add_argument("--doc-range", default=None, help="START:END source document indices (half-open)")
    p.add_argument("--skip-docs", type=int, default=0)
    p.add_argument("--max-docs", type=int, default=None)
    p.add_argument("--seed", type=int, default=1234, help="seed of the LSH hyperplanes")
    p.add_argument("--md5-key", default=DEFAULT_KEY.decode(), help="HMAC key of md5 specs (default 'en')")
    p.add_argument("--lsh-vocab-size", type=int, default=DEFAULT_NGRAM_VOCAB, help="top-K character n-grams (default 50,000)")
    p.add_argument("--lsh-sample-docs", type=int, default=0, help="count n-grams over the first M selected documents only (0 = all)")
    p.add_argument("--shakespeare-chunk-chars", type=int, default=4000)
    p.add_argument("--chunk-docs", type=int, default=64, help="documents per worker task")
    p.add_argument("--chunk-chars", type=int, default=1 << 19, help="characters per worker task")
    p.add_argument("--encode-threads", type=int, default=1, help="sentencepiece threads per worker (batch encode)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output prefix")
    p.add_argument("--quiet", action="store_true")
    return p


MEGATRON_TOKENIZER_TYPES = ("HuggingFaceTokenizer", "SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer")


def _megatron_aliases(args) -> None:
    """Map Megatron-LM's spellings onto ours (``--tokenizer-model``, ``--json-keys``)."""
    if args.tokenizer_type is not None and args.tokenizer_type not in MEGATRON_TOKENIZER_TYPES:
        raise InputError(f"--tokenizer-type {args.tokenizer_type} is not supported; use HuggingFaceTokenizer or "
                         f"SentencePieceTokenizer with --tokenizer-model, or --tokenizer PATH")
    if args.tokenizer_model is not None:
        if args.tokenizer is not None and args.tokenizer != args.tokenizer_model:
            raise InputError("give either --tokenizer or --tokenizer-model, not both")
        args.tokenizer = args.tokenizer_model
    if args.tokenizer is None:
        raise InputError("no tokenizer: pass --tokenizer PATH|NAME|words (or --tokenizer-type HuggingFaceTokenizer "
                         "--tokenizer-model NAME)")
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


def _existing_outputs(prefix: str, finals: Iterable[str]) -> list[str]:
    meta = f"{prefix}_meta.json"
    return [f for f in [meta, *finals] if os.path.exists(f)]


def run(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    _check_args(args)
    specs = parse_hash_specs(args.word_hashes)
    source = open_source(args.input, txt_mode=args.txt_mode, json_key=args.json_key,
                         shakespeare_chunk_chars=args.shakespeare_chunk_chars)
    start, end = parse_doc_range(args.doc_range, args.skip_docs, args.max_docs)
    tok = resolve_tokenizer(args.tokenizer)
    words_mode = tok.kind == WORDS
    token_dtype = np.dtype(np.int32) if words_mode else optimal_token_dtype(tok.vocab_size)
    key = args.md5_key.encode("utf-8")
    lsh_specs = [s for s in specs if s.kind in ("lsh", "lsh-bucket")]

    prefix = args.output_prefix
    shards = shard_names(prefix, [s.name for s in specs])
    lsh_path = f"{prefix}_lsh.npz" if lsh_specs else None
    words_path = f"{prefix}_words.tsv" if words_mode else None
    meta_path = f"{prefix}_meta.json"
    finals = [p + ext for p in shards.values() for ext in (".bin", ".idx")] + [p for p in (lsh_path, words_path) if p]
    from megahash.data_stage.publish import leftovers, remove

    stale = leftovers(prefix, finals)  # an unpublished set (no meta) or temp files of dead runs: replaced
    remove(stale)
    existing = _existing_outputs(prefix, finals)
    if existing and not args.overwrite:
        raise InputError(f"output prefix {prefix!r} already exists ({existing[0]}); pass --overwrite to replace it")
    old_meta = _read_json(meta_path) if args.overwrite and os.path.exists(meta_path) else None
    Path(prefix).parent.mkdir(parents=True, exist_ok=True)

    outputs = AtomicOutputs()
    writers: dict[str, IndexedShardWriter] = {}
    lsh_pass = None
    progress = None
    previous_handler = None
    if threading.current_thread() is threading.main_thread():
        previous_handler = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        lsh_info = None
        for name, shard in shards.items():
            dtype = token_dtype if name == "tokens" else next(s.dtype for s in specs if s.name == name)
            writers[name] = IndexedShardWriter(outputs.tmp(shard + ".bin"), outputs.tmp(shard + ".idx"), dtype)

        cfg = EncoderConfig(
            tokenizer=tok.path or WORDS, specs=specs, hash_unit=args.hash_unit, append_eos=args.append_eos,
            key=key, token_dtype=token_dtype.name, encode_threads=args.encode_threads,
            deferred=tuple(s.name for s in lsh_specs), count_words=bool(lsh_specs) and not words_mode,
        )
        stats = DocStats()
        progress = Progress("encoding", args.quiet)
        lsh_pass = _LSHPass(outputs.scratch(f"{prefix}_lsh_rows"), words_mode) if lsh_specs else None
        counts = _encode_all(args, cfg, source, start, end, stats, writers, specs, words_mode, progress, lsh_pass)
        progress.close()
        progress = None
        if counts["documents"] == 0:
            raise InputError(f"no non-empty documents in {args.input!r} (document range {start}:{'' if end is None else end})")
        for name, w in writers.items():
            if name not in cfg.deferred:
                w.finalize()
        npz_sha = None
        if lsh_pass is not None:
            lsh, lsh_info = lsh_pass.model(args)
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

            with _Threads(args.workers) as threads:  # --workers > 1: the .npz and the hashing overlap
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
        counts["replaced_invalid_utf8_chars"] = source.replaced_chars
        meta = _meta(args, source, start, end, tok, token_dtype, specs, key, shards, lsh_info, words_path, counts, files)
        with open(outputs.tmp(meta_path), "w", encoding="utf-8") as f:
            json.dump(meta, f, indent=2)
            f.write("\n")
        outputs.commit(last=meta_path)
        _remove_stale(old_meta, prefix, set(files) | {os.path.basename(meta_path)})
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
        if previous_handler is not None:
            signal.signal(signal.SIGTERM, previous_handler)
    if not args.quiet:
        print(f"wrote {counts['documents']:,} documents, {counts['tokens']:,} tokens -> {prefix}_* "
              f"(hashes: {', '.join(s.name for s in specs) or 'none'})", file=sys.stderr)
    return 0


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def _read_json(path: str) -> Optional[dict]:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _remove_stale(old_meta: Optional[dict], prefix: str, keep: set) -> None:
    """After --overwrite: delete files of the previous run that this run did not write."""
    if not old_meta:
        return
    base = os.path.dirname(prefix)
    for name in old_meta.get("files", {}):
        if name not in keep and os.path.basename(name) == name and name.startswith(os.path.basename(prefix) + "_"):
            try:
                os.remove(os.path.join(base, name))
            except FileNotFoundError:
                pass


class _Threads:
    """``submit`` runs a job in a thread pool of ``n`` threads (numpy and hashlib release the GIL),
    or at once in the calling thread when ``n == 1``; results via ``.result()``."""

    class _Done:
        def __init__(self, value):
            self.value = value

        def result(self):
            return self.value

    def __init__(self, n: int):
        self.n = max(1, n)
        self.pool = None
        if self.n > 1:
            from concurrent.futures import ThreadPoolExecutor

            self.pool = ThreadPoolExecutor(self.n)

    def submit(self, fn, *args):
        return self.pool.submit(fn, *args) if self.pool is not None else self._Done(fn(*args))

    def __enter__(self) -> "_Threads":
        return self

    def __exit__(self, *exc) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True)


class _LSHPass:
    """LSH side shards without a first pass over the corpus (main process).

    During the encoding pass: the word counts for the n-gram vocabulary (subword streams: counted by
    the workers and collected at the end; words streams: counted here from the word ids), and each
    token's LSH string id -- subword streams: workers send CodeTable row ids plus the strings of
    their new rows, mapped here to global string ids (0 = special token), kept in memory up to
    ``MEMORY_TOKENS`` tokens and beyond that in a temporary int32 file; words streams: the token
    shard itself (global word ids). After the pass:
    ``model`` builds the vocabulary from the same counts as a separate first pass would (same
    vocabulary), ``write_shards`` hashes every distinct string once and writes the shards by a
    gather over the id stream, in bounded blocks of documents."""

    BLOCK_TOKENS = 1 << 20  # tokens per block of the LSH shard gather
    MEMORY_TOKENS = 1 << 24  # string ids of up to this many tokens stay in memory (64 MiB), then a file
    HASH_BLOCK = 1 << 16  # strings per hash_words call

    def __init__(self, ids_path: str, words_mode: bool):
        self.words_mode = words_mode
        self.ids_path = ids_path
        self.ids_file = None  # opened when the string ids outgrow MEMORY_TOKENS
        self.buffered: Optional[list[np.ndarray]] = []  # string ids kept in memory (None once spilled)
        self.buffered_size = 0
        self.index: dict[str, int] = {}  # string -> id (1, 2, ...)
        self.maps: dict[int, list] = {}  # worker -> [generation, GrowArray: worker row -> string id]
        self.lengths: list[np.ndarray] = []  # tokens per document
        self.counted_documents = 0
        self.word_counts: Counter = Counter()
        self.sample_counts = GrowArray(np.int64)  # words streams: counts per word id
        self.word_list: list[str] = []  # words streams: the word table (set by _encode_all)

    def add(self, res: ChunkResult, tokens: np.ndarray) -> None:
        """Record a chunk (``tokens``: the written ids; global word ids for words streams)."""
        self.lengths.append(res.lengths)
        self.counted_documents += res.counted
        if self.words_mode:
            if res.counted:  # every task document has words (non-blank text always does): lengths align
                n = int(res.lengths[: res.counted].sum())
                ids, n_ids = np.unique(tokens[:n], return_counts=True)
                if len(ids) and ids[-1] >= self.sample_counts.size:
                    self.sample_counts.extend(np.zeros(int(ids[-1]) + 1 - self.sample_counts.size, np.int64))
                self.sample_counts.data[ids] += n_ids
            return
        state = self.maps.get(res.worker)
        if state is None or state[0] != res.generation:
            state = self.maps[res.worker] = [res.generation, GrowArray(np.int32)]
            state[1].extend(np.zeros(1, np.int32))
        index = self.index
        setdefault = index.setdefault
        new = np.fromiter((setdefault(s, len(index) + 1) for s in res.new_strings), np.int32, count=len(res.new_strings))
        state[1].extend(new)
        ids = state[1].data[res.rows]
        if self.buffered is not None and self.buffered_size + len(ids) <= self.MEMORY_TOKENS:
            self.buffered.append(ids)  # small corpora: no temporary file
            self.buffered_size += len(ids)
            return
        if self.ids_file is None:  # spill what was kept in memory, then append to the file
            self.ids_file = open(self.ids_path, "wb")
            for part in self.buffered:
                self.ids_file.write(memoryview(part).cast("B"))
            self.buffered = None
        self.ids_file.write(memoryview(ids).cast("B"))

    def collect(self, pool: OrderedPool) -> None:
        """After the pass: the workers' word counts (subword streams)."""
        if not self.words_mode:
            for c in pool.broadcast(_finish_encoder):
                self.word_counts.update(c)
            self.close()

    def close(self) -> None:
        if self.ids_file is not None and not self.ids_file.closed:
            self.ids_file.close()

    def model(self, args) -> tuple[LSHModel, dict]:
        """The LSH model of the counted words and the meta's ``lsh`` entry."""
        counts = self.word_counts
        if self.words_mode:  # word ids -> words (ids < NUM_SPECIAL are the specials)
            c = self.sample_counts.view()
            ids = np.flatnonzero(c[NUM_SPECIAL:]) + NUM_SPECIAL
            counts = dict(zip([self.word_list[i] for i in ids.tolist()], c[ids].tolist()))
        model = LSHModel.from_word_counts(counts, args.lsh_vocab_size, args.seed, NGRAM_ORDERS)
        info = {
            "ngram_orders": list(NGRAM_ORDERS),
            "ngram_vocab_size_requested": args.lsh_vocab_size,
            "ngram_vocab_size": model.vocab_size,
            "seed": args.seed,
            "counted_documents": self.counted_documents,
            "counted_words": sum(counts.values()),
            "distinct_words": len(counts),
            "sample_docs": args.lsh_sample_docs,
            "counting": "streaming first pass over the selected documents" if not args.lsh_sample_docs
            else f"first {args.lsh_sample_docs} selected documents",
        }
        return model, info

    def write_shards(self, lsh: LSHModel, specs, writers: dict, key: bytes, word_table, threads: "_Threads") -> None:
        if self.words_mode:
            strings = word_table[0]
            ids = np.memmap(writers["tokens"].bin_path, dtype=np.int32, mode="r") if writers["tokens"].num_elements else np.zeros(0, np.int32)
            first = NUM_SPECIAL  # rows 0..4: the specials
            hashed = list(strings[NUM_SPECIAL:])
        elif self.buffered is not None:
            ids = np.concatenate(self.buffered) if self.buffered else np.zeros(0, np.int32)
            first = 1
            hashed = list(self.index)
        else:
            size = os.path.getsize(self.ids_path)
            ids = np.memmap(self.ids_path, dtype=np.int32, mode="r") if size else np.zeros(0, np.int32)
            first = 1
            hashed = list(self.index)
        tables = {}
        step = max(1, min(self.HASH_BLOCK, -(-len(hashed) // threads.n)))  # a block per thread at least
        for s in specs:  # every distinct string hashed once (in blocks: bounded temporaries)
            t = np.zeros((first + len(hashed), s.width), s.dtype)

            def fill(b: int, s=s, t=t) -> None:
                t[first + b : first + b + step] = hash_words(s, hashed[b : b + step], key, lsh)

            for f in [threads.submit(fill, b) for b in range(0, len(hashed), step)]:
                f.result()
            tables[s.name] = t
        lengths = np.concatenate(self.lengths) if self.lengths else np.zeros(0, np.int64)
        ends = np.cumsum(lengths)
        d0 = 0
        while d0 < len(lengths):
            a = int(ends[d0] - lengths[d0])
            d1 = max(int(np.searchsorted(ends, a + self.BLOCK_TOKENS, side="right")), d0 + 1)
            block = np.asarray(ids[a : int(ends[d1 - 1])])
            for s in specs:
                writers[s.name].add_documents(tables[s.name][block], lengths[d0:d1] * s.width)
            d0 = d1
        del ids


def _encode_all(args, cfg, source, start, end, stats, writers, specs, words_mode, progress, lsh_pass) -> dict:
    count_limit = args.lsh_sample_docs or None
    tasks = chunked_tasks(select_documents(source, start, end), stats, args.chunk_docs, args.chunk_chars, count_limit)
    _STATE["encoder"] = ChunkEncoder(cfg)  # inherited by forked workers (see _init_encoder)
    try:
        return _encode_pool(args, cfg, tasks, writers, specs, words_mode, progress, lsh_pass)
    finally:
        _STATE.pop("encoder", None)


def _encode_pool(args, cfg, tasks, writers, specs, words_mode, progress, lsh_pass) -> dict:
    fail_after = int(os.environ[FAIL_ENV]) if os.environ.get(FAIL_ENV) else None
    docs_written = tokens_written = empty_tokenized = 0
    word_ids: dict[str, int] = {w: i for i, w in enumerate(SPECIAL_TOKENS)}
    word_list: list[str] = list(SPECIAL_TOKENS)
    word_counts = np.zeros(1024, np.int64)
    deferred = set(cfg.deferred)
    with OrderedPool(args.workers, _init_encoder, (cfg, None)) as pool:
        for res in pool.map(_encode_chunk, tasks):
            tokens = res.tokens
            if words_mode:
                gids = np.empty(len(res.words), np.int64)
                gids[0] = EOS_ID
                for i, w in enumerate(res.words[1:], start=1):
                    g = word_ids.get(w)
                    if g is None:
                        g = word_ids[w] = len(word_list)
                        word_list.append(w)
                    gids[i] = g
                if len(word_list) > len(word_counts):
                    word_counts = np.concatenate([word_counts, np.zeros(max(len(word_list), 2 * len(word_counts)) - len(word_counts), np.int64)])
                np.add.at(word_counts, gids, np.bincount(tokens, minlength=len(gids)))
                tokens = gids.astype(np.int32)[tokens]
            writers["tokens"].add_documents(tokens, res.lengths)
            for s in specs:
                if s.name not in deferred:
                    writers[s.name].add_documents(res.codes[s.name], res.lengths * s.width)
            if lsh_pass is not None:
                lsh_pass.add(res, tokens)
            n_docs, n_tok = len(res.lengths), int(res.lengths.sum())
            docs_written += n_docs
            tokens_written += n_tok
            empty_tokenized += res.empty
            progress.update(n_docs, n_tok)
            if fail_after is not None and docs_written >= fail_after:
                raise InjectedFailure(f"injected failure after {docs_written} documents ({FAIL_ENV}={fail_after})")
        if lsh_pass is not None:
            lsh_pass.collect(pool)
            lsh_pass.word_list = word_list
    counts = {"documents": docs_written, "tokens": tokens_written, "_empty_tokenized": empty_tokenized}
    if words_mode:
        counts["_word_table"] = (word_list, word_counts[: len(word_list)])
        counts["word_table_size"] = len(word_list)
    return counts


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
            d["seed"] = args.seed
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
        },
        "hash_specs": hash_specs,
        "lsh": lsh_info,
        "counts": counts,
        "files": files,
    }


def main(argv: Optional[Sequence[str]] = None) -> int:
    """CLI entry point: 0 on success, 2 with ``error: ...`` on bad input, 130 on interrupt."""
    return cli(run, argv)


if __name__ == "__main__":
    sys.exit(main())
