"""The encoding pass of ``preprocess_data``: selected documents in chunks, encoded by a pool of worker
processes (:mod:`.encoding`), written in document order to the token shard and the non-LSH side shards;
words streams get their global word ids here (first occurrence in document order)."""

from __future__ import annotations

import os
import sys
import time
from collections import Counter
from collections.abc import Iterable, Iterator

import numpy as np

from megahash.data.preprocess.common import DataError
from megahash.data.preprocess.encoding import ChunkEncoder, ChunkResult, EncoderConfig
from megahash.data.preprocess.long_documents import LAST, START, Document, pieces
from megahash.data.preprocess.ordered_pool import OrderedPool
from megahash.data.preprocess.sources import select_documents
from megahash.hashing.lsh import LSHModel
from megahash.hashing.words import EOS_ID, SPECIAL_TOKENS

WHOLE = START | LAST  # flags of a document that is one piece
FAIL_ENV = "MEGAHASH_PREPROCESS_FAIL_AFTER_DOCS"  # test hook: raise after writing this many documents


class InjectedFailure(DataError):
    """Raised by the ``MEGAHASH_PREPROCESS_FAIL_AFTER_DOCS`` test hook."""


# -- worker side: one encoder per process ------------------------------------------------------
_STATE: dict = {}


def _init_encoder(cfg: EncoderConfig, lsh: LSHModel | None) -> None:
    """Worker initializer: forked workers inherit the encoder built by ``encode_all`` (no second
    tokenizer load per worker) and only take their own id; otherwise (spawn) build one."""
    enc = _STATE.get("encoder")
    if enc is not None and enc.cfg is cfg:
        enc.worker = os.getpid()
    else:
        _STATE["encoder"] = ChunkEncoder(cfg, lsh)


def _encode_chunk(task: tuple[list[str], int, bytes | None]) -> ChunkResult:
    docs, n_count, flags = task
    res = _STATE["encoder"].encode(docs, n_count, flags)
    res.counted = n_count
    return res


def finish_encoder(_) -> Counter:
    return _STATE["encoder"].finish()


# -- documents --------------------------------------------------------------------------------
class DocStats:
    def __init__(self):
        self.read = 0
        self.empty = 0
        self.split = 0  # documents encoded in several pieces


def chunked_tasks(
    docs: Iterable[Document],
    stats: DocStats,
    max_docs: int,
    max_chars: int,
    count_limit: int | None = None,
    split_chars: int | None = None,
) -> Iterator[tuple[list[str], int, bytes | None]]:
    """``(chunk, n, flags)``: the non-empty documents in tasks of at most ``max_docs`` entries and
    ``max_chars`` characters (a longer entry alone). A document longer than ``split_chars``
    characters (or streamed) comes as its pieces (megahash/data/preprocess/long_documents.py), which
    may span tasks; ``flags`` has one byte per entry (kind | LAST), None when every entry is a whole
    document. The first ``n`` entries belong to the first ``count_limit`` selected source documents
    (empty ones included in that count; all of them when ``count_limit`` is None)."""
    split_chars = split_chars or max_chars
    chunk: list[str] = []
    flags = bytearray()
    size = counted = 0
    split = False
    for doc in docs:
        stats.read += 1
        counts = count_limit is None or stats.read <= count_limit
        parts = ((doc, WHOLE),) if isinstance(doc, str) and len(doc) <= split_chars else pieces(doc, split_chars)
        empty = True
        for text, f in parts:
            stats.split += f == LAST | 1 or f == LAST | 2  # the last piece of a split document
            if f == WHOLE and not text.strip():
                break
            empty = False
            if chunk and (len(chunk) >= max_docs or size + len(text) > max_chars):
                yield chunk, counted, bytes(flags) if split else None
                chunk, size, counted, split = [], 0, 0, False
                flags.clear()
            chunk.append(text)
            flags.append(f)
            split |= f != WHOLE
            size += len(text)
            counted += counts
        stats.empty += empty
    if chunk:
        yield chunk, counted, bytes(flags) if split else None


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


def encode_all(
    args, cfg, source, start, end, stats, writers, specs, words_mode, progress, lsh_pass, tokenizer=None
) -> dict:
    count_limit = args.lsh_sample_docs or None
    tasks = chunked_tasks(
        select_documents(source, start, end, stream=True),
        stats,
        args.chunk_docs,
        args.chunk_chars,
        count_limit,
        args.split_chars,
    )
    _STATE["encoder"] = ChunkEncoder(cfg, tokenizer=tokenizer)  # inherited by forked workers (see _init_encoder)
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
                    word_counts = np.concatenate(
                        [word_counts, np.zeros(max(len(word_list), 2 * len(word_counts)) - len(word_counts), np.int64)]
                    )
                np.add.at(word_counts, gids, np.bincount(tokens, minlength=len(gids)))
                tokens = gids.astype(np.int32)[tokens]
            lengths, continues = res.documents()  # pieces of a long document: one document
            writers["tokens"].add_documents(tokens, lengths, continues)
            for s in specs:
                if s.name not in deferred:
                    writers[s.name].add_documents(res.codes[s.name], lengths * s.width, continues)
            if lsh_pass is not None:
                lsh_pass.add(res, tokens)
            n_docs, n_tok = res.finished, int(res.lengths.sum())
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
