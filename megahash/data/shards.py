"""Reader of preprocessed shards: the token ``IndexedDataset``, one side ``IndexedDataset`` per hash
spec (same documents, ``width`` elements per token), and ``PREFIX_meta.json`` (see docs/data.md).

    shards = ShardSet.open("data/shk/shk")
    ids = shards.tokens.get(doc, offset, length)                   # token ids
    codes = shards.hash_codes("md5", doc, offset, length)          # uint8 [length, 16]

megatron-core's ``IndexedDataset`` is imported when a ShardSet is opened, not at module import.
"""

from __future__ import annotations

import io
import os
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from megahash.data.verify import META_SUFFIX, TOKENS_SUFFIX, base_prefix, read_meta
from megahash.errors import DataError
from megahash.hashing.codes import CodeTable
from megahash.hashing.lsh import LSHModel
from megahash.hashing.specs import HashSpec, parse_hash_spec
from megahash.hashing.tokens import SubwordCoder, word_stream_row_ids
from megahash.hashing.words import NUM_SPECIAL

_KEPT: dict[type, type] = {}  # a megatron-core reader class -> its subclass that leaves its memory map open


def _close_files_only(reader) -> None:
    """``__del__`` of a kept reader: its open files (``_MMapBinReader``'s), not its maps."""
    for value in vars(reader).values():
        if isinstance(value, io.IOBase):
            value.close()


def _keep_maps_open(dataset):
    """``dataset`` (megatron-core's ``IndexedDataset``) with readers that do not close their memory maps when
    collected. megatron-core's ``_IndexReader`` and ``_MMapBinReader`` close them in ``__del__``, under the arrays
    they returned (``get``, ``[i]``, ``sequence_lengths`` are views of the maps), so an array that outlived its
    dataset read unmapped memory: ``ShardSet.open(p).tokens.get(0)`` was a segmentation fault. Left open, a map
    goes when the last array of it does (numpy holds the map; the reader's file is closed). The dataset pickles as before (its state is its
    path; the readers are built again)."""
    for reader in list(vars(dataset).values()):
        cls = type(reader)
        if cls.__module__.startswith("megatron.") and "__del__" in vars(cls):
            kept = _KEPT.setdefault(cls, type(cls.__name__, (cls,), {"__del__": _close_files_only}))
            reader.__class__ = kept
    return dataset


def read_word_table(path: str) -> list[str]:
    """Words of a ``PREFIX_words.tsv`` in id order."""
    words: list[str] = []
    with open(path, encoding="utf-8") as f:
        next(f, None)  # header
        for i, line in enumerate(f):
            ident, word, _ = line.rstrip("\n").split("\t")
            if int(ident) != i:
                raise DataError(f"{path}: word table ids are not 0..n-1 at line {i + 2}")
            words.append(word)
    return words


@dataclass
class ShardSet:
    """Token shard + hash side shards of one preprocessing run."""

    prefix: str
    tokens: Any  # megatron.core.datasets.indexed_dataset.IndexedDataset
    meta: dict
    side: dict  # spec name -> (IndexedDataset, HashSpec)

    @classmethod
    def open(cls, prefix: str, specs: Sequence[str] | None = None) -> ShardSet:
        """Open ``PREFIX`` (``PREFIX_text_document`` also accepted); ``specs`` limits the side shards."""
        prefix = base_prefix(prefix)
        meta_path = prefix + META_SUFFIX
        meta = read_meta(prefix)  # one line if missing (an incomplete set), corrupt or of another format
        with warnings.catch_warnings():  # megatron-core warns about optional CUDA extensions on import
            warnings.simplefilter("ignore")
            from megatron.core.datasets.indexed_dataset import IndexedDataset

        def load(path_prefix: str):
            for ext in (".bin", ".idx"):
                if not os.path.exists(path_prefix + ext):
                    raise DataError(f"missing shard file {path_prefix + ext}")
            return _keep_maps_open(IndexedDataset(path_prefix))

        tokens = load(prefix + TOKENS_SUFFIX)
        known = {d["name"]: d for d in meta.get("hash_specs", [])}
        wanted = list(known) if specs is None else list(specs)
        side = {}
        for name in wanted:
            if name not in known:
                raise DataError(f"hash spec {name!r} not in shards {prefix!r} (have: {', '.join(known) or 'none'})")
            spec = parse_hash_spec(name)
            d = known[name]
            if d["width"] != spec.width or d["dtype"] != spec.dtype.name:
                raise DataError(
                    f"{meta_path}: spec {name!r} has width/dtype {d['width']}/{d['dtype']}, expected {spec.width}/{spec.dtype.name}"
                )
            side[name] = (load(f"{prefix}_hash_{name}"), spec)
        return cls(prefix, tokens, meta, side)

    # basic facts ------------------------------------------------------------------------------
    @property
    def num_documents(self) -> int:
        return len(self.tokens)

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.sequence_lengths.sum())

    @property
    def stream_kind(self) -> str:
        """``subword`` (ids of a tokenizer of :mod:`megahash.tokenization`) or ``words`` (word-table ids)."""
        return self.meta["stream"]["kind"]

    def spec(self, name: str) -> HashSpec:
        return self._side(name)[1]

    def _side(self, name: str):
        try:
            return self.side[name]
        except KeyError:
            raise DataError(f"hash spec {name!r} not opened (have: {', '.join(self.side) or 'none'})") from None

    def hash_codes(self, spec_name: str, doc_id: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Codes of tokens ``[offset, offset + length)`` of document ``doc_id``: ``[length, width]``."""
        dataset, spec = self._side(spec_name)
        if length is None:
            length = int(self.tokens.sequence_lengths[doc_id]) - offset
        flat = dataset.get(doc_id, offset * spec.width, length * spec.width)
        return flat.reshape(length, spec.width)

    def word_table(self) -> list[str]:
        """Id -> word of a words stream (``PREFIX_words.tsv``)."""
        name = self.meta["stream"].get("word_table")
        if not name:
            raise DataError(f"shards {self.prefix!r} are a {self.stream_kind} stream without a word table")
        return read_word_table(os.path.join(os.path.dirname(self.prefix), name))

    def tokenizer(self, override: str | None = None):
        """The tokenizer of a subword stream (:func:`megahash.tokenization.load_tokenizer`, any kind):
        ``override``, else the meta's spec (tried as given, beside the shards, then the file it
        resolved to at preprocessing)."""
        from megahash.tokenization import TokenizerError, load_tokenizer

        info = self.meta.get("tokenizer") or {}
        specs = [override] if override else list(dict.fromkeys(s for s in (info.get("path"), info.get("file")) if s))
        err = "the meta names none"
        for spec in specs:
            try:
                return load_tokenizer(spec, [os.path.dirname(self.prefix)])
            except TokenizerError as e:
                err = str(e)
        raise DataError(f"cannot load the tokenizer of these shards: {err} (pass the tokenizer they were made with)")

    def lsh_model(self) -> LSHModel | None:
        """The LSH n-gram vocabulary and planes saved with the shards (None without lsh specs)."""
        info = self.meta.get("lsh")
        if not info:
            return None
        return LSHModel.load(os.path.join(os.path.dirname(self.prefix), info["file"]))

    def decode(self, doc_id: int, tokenizer: str | None = None, max_tokens: int | None = None) -> str:
        """Text of a document: its tokenizer's decode, or the words joined by spaces."""
        length = None if max_tokens is None else min(max_tokens, int(self.tokens.sequence_lengths[doc_id]))
        ids = self.tokens.get(doc_id, 0, length)
        if self.stream_kind == "words":
            words = self.word_table()
            return " ".join(words[int(i)] for i in ids)
        return self.tokenizer(tokenizer).decode([int(i) for i in ids])

    # verification -----------------------------------------------------------------------------
    def verify(self, sample_docs: int = 8, checksums: bool = True, tokenizer: str | None = None) -> dict:
        """Check checksums, side-shard alignment and recomputed codes of ``sample_docs`` documents.
        Raises ``DataError`` (one line) on the first mismatch; returns a summary dict."""
        from megahash.data.verify import verify_set

        try:  # files, sizes, checksums, headers, counts and side-shard alignment: megahash/data/verify.py
            verify_set(self.prefix, "full" if checksums else "cheap", specs=list(self.side), meta=self.meta)
        except DataError as e:
            raise DataError(f"verify: {e}") from None
        n = self.num_documents
        lengths = np.asarray(self.tokens.sequence_lengths, dtype=np.int64)
        docs = (
            np.unique(np.linspace(0, n - 1, num=min(sample_docs, n)).astype(np.int64)).tolist()
            if sample_docs > 0
            else []
        )
        checked_tokens = self._verify_codes(docs, tokenizer) if self.side and docs else 0
        return {
            "documents": n,
            "tokens": int(lengths.sum()),
            "checked_files": len(self.meta.get("files", {})) if checksums else 0,
            "checked_documents": len(docs) if self.side else 0,
            "checked_tokens": checked_tokens,
            "side_shards": list(self.side),
        }

    def _verify_codes(self, docs: list[int], tokenizer: str | None) -> int:
        specs = [spec for _, spec in self.side.values()]
        key = next((d.get("key") for d in self.meta["hash_specs"] if "key" in d), "en")
        table = CodeTable(specs, key=key.encode("utf-8"), lsh=self.lsh_model())
        if self.stream_kind == "words":
            words = self.word_table()
            rows_of = lambda toks: word_stream_row_ids(table, toks, words)  # noqa: E731
        else:
            tok = self.tokenizer(tokenizer)
            want = self.meta["tokenizer"].get("sha256")
            if want and tok.sha256 != want:
                raise DataError(
                    f"verify: tokenizer {tok.path} is not the one these shards were made with (sha256 differs)"
                )
            coder = SubwordCoder(tok, table, self.meta["stream"]["hash_unit"])
            rows_of = lambda toks: coder.row_ids(toks, [0])  # noqa: E731
        total = 0
        eos = self.meta["stream"]["eos_id"] if self.meta["stream"].get("append_eos") else None
        for d in docs:
            toks = np.asarray(self.tokens.get(d), dtype=np.int64)
            if eos is not None and (len(toks) == 0 or toks[-1] != eos):
                raise DataError(f"verify: document {d} does not end with EOS id {eos}")
            if self.stream_kind == "words" and np.any(toks[:-1] < NUM_SPECIAL) and eos is not None:
                raise DataError(f"verify: document {d} has a special id inside a words stream")
            rows = rows_of(toks)
            for name in self.side:
                want = table.rows(name, rows)
                got = self.hash_codes(name, d, 0, len(toks))
                if not np.array_equal(want, got):
                    t = int(np.flatnonzero(np.any(want != got, axis=1))[0])
                    raise DataError(
                        f"verify: {name!r} codes of document {d} token {t} do not match the recomputed hash"
                    )
            total += len(toks)
        return total
