"""LSH side shards of ``preprocess_data`` without a second pass over the corpus (:class:`LSHPass`),
hashing every distinct string once on a few threads (:class:`Threads`)."""

from __future__ import annotations

from collections import Counter

import numpy as np

from megahash.data.preprocess.encode_pass import finish_encoder
from megahash.data.preprocess.encoding import ChunkResult, GrowArray
from megahash.data.preprocess.ordered_pool import OrderedPool
from megahash.hashing.codes import hash_words
from megahash.hashing.lsh import NGRAM_ORDERS, LSHModel
from megahash.hashing.words import NUM_SPECIAL


class Threads:
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

    def __enter__(self) -> Threads:
        return self

    def __exit__(self, *exc) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True)


class _Int32s:
    """``int32`` values of a file read on demand (``x[a:b]``), not memory-mapped: pages of a mapped file
    count as resident, so a map of a large file would make the resident size grow with the corpus."""

    def __init__(self, path: str, offset: int = 0):
        self.path, self.offset = path, offset

    def __getitem__(self, sl: slice) -> np.ndarray:
        count = sl.stop - sl.start
        if count <= 0:
            return np.zeros(0, np.int32)
        return np.fromfile(self.path, dtype=np.int32, count=count, offset=self.offset + 4 * sl.start)


class LSHPass:
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
    WINDOW_DOCUMENTS = 1 << 20  # documents whose lengths are read at a time (from the token index)
    MEMORY_TOKENS = 1 << 22  # string ids of up to this many tokens stay in memory (16 MiB), then a file
    HASH_BLOCK = 1 << 16  # strings per hash_words call

    def __init__(self, ids_path: str, words_mode: bool):
        self.words_mode = words_mode
        self.ids_path = ids_path
        self.ids_file = None  # opened when the string ids outgrow MEMORY_TOKENS
        self.buffered: list[np.ndarray] | None = []  # string ids kept in memory (None once spilled)
        self.buffered_size = 0
        self.index: dict[str, int] = {}  # string -> id (1, 2, ...)
        self.maps: dict[int, list] = {}  # worker -> [generation, GrowArray: worker row -> string id]
        self.counted_documents = 0
        self.word_counts: Counter = Counter()
        self.sample_counts = GrowArray(np.int64)  # words streams: counts per word id
        self.word_list: list[str] = []  # words streams: the word table (set by encode_all)

    def add(self, res: ChunkResult, tokens: np.ndarray) -> None:
        """Record a chunk (``tokens``: the written ids; global word ids for words streams)."""
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
        new = np.fromiter(
            (setdefault(s, len(index) + 1) for s in res.new_strings), np.int32, count=len(res.new_strings)
        )
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
            for c in pool.broadcast(finish_encoder):
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
            "counting": "streaming first pass over the selected documents"
            if not args.lsh_sample_docs
            else f"first {args.lsh_sample_docs} selected documents",
        }
        return model, info

    def write_shards(self, lsh: LSHModel, specs, writers: dict, key: bytes, word_table, threads: Threads) -> None:
        if self.words_mode:
            strings = word_table[0]
            ids = _Int32s(writers["tokens"].bin_path)  # global word ids
            first = NUM_SPECIAL  # rows 0..4: the specials
            hashed = list(strings[NUM_SPECIAL:])
        elif self.buffered is not None:
            ids = np.concatenate(self.buffered) if self.buffered else np.zeros(0, np.int32)
            first = 1
            hashed = list(self.index)
        else:
            ids = _Int32s(self.ids_path)
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
        tokens = writers["tokens"]
        lengths = _Int32s(tokens.idx_path, offset=34)  # the documents: the token index's lengths (34: its header)
        base = 0
        for w0 in range(0, tokens.documents, self.WINDOW_DOCUMENTS):  # windows of whole documents: bounded arrays
            window = lengths[w0 : min(w0 + self.WINDOW_DOCUMENTS, tokens.documents)].astype(np.int64)
            ends = np.cumsum(window)
            starts = ends - window
            total = int(ends[-1])
            for a in range(0, max(total, 1), self.BLOCK_TOKENS):  # blocks of tokens: a long document in parts
                b = min(a + self.BLOCK_TOKENS, total)
                d0 = int(np.searchsorted(starts, a, side="left"))  # documents starting in the block ...
                d1 = len(starts) if b == total else int(np.searchsorted(starts, b, side="left"))
                continues = d0 > 0 and ends[d0 - 1] > a  # ... after the end of one that started before it
                d0 -= continues
                parts = np.minimum(ends[d0:d1], b) - np.maximum(starts[d0:d1], a)
                block = np.asarray(ids[base + a : base + b])
                for s in specs:
                    writers[s.name].add_documents(tables[s.name][block], parts * s.width, bool(continues))
            base += total
        del ids
