"""Batched word -> code rows for a set of hash specs, each unique string hashed once.

``hash_words`` computes the rows of one spec for a list of strings. ``CodeTable`` is the cache the
preprocessor uses: it maps strings to row ids (row 0 is the all-zero row of special tokens; the
model embeds specials with its own small table), hashes all strings it has not seen in one batch per
``lookup`` call, and gathers rows with numpy indexing.
"""
from __future__ import annotations

from typing import Iterable, Optional, Sequence

import numpy as np

from megahash.hashing.lsh import LSHModel
from megahash.hashing.md5 import DEFAULT_KEY, md5_bits, md5_buckets
from megahash.hashing.rolling import rolling_codes
from megahash.hashing.specs import HashSpec

ZERO_ROW = 0  # row id of special tokens


def hash_words(
    spec: HashSpec, words: Sequence[str], key: Optional[bytes] = DEFAULT_KEY, lsh: Optional[LSHModel] = None
) -> np.ndarray:
    """Code rows ``[len(words), spec.width]`` of ``spec.dtype`` for ``words`` (no special handling)."""
    kind, p = spec.kind, spec.params
    if kind in ("lsh", "lsh-bucket") and lsh is None:
        raise ValueError(f"hash spec {spec.name!r} needs an LSH model (n-gram vocabulary + planes)")
    if kind == "md5":
        out = md5_bits(words, key)
    elif kind == "md5-bucket":
        out = md5_buckets(words, p["buckets"], key)
    elif kind == "lsh":
        out = lsh.bits(words, p["bits"])
    elif kind == "lsh-bucket":
        out = lsh.buckets(words, p["buckets"])
    elif kind == "rolling":
        out = rolling_codes(words, p["n"], p["max_len"])
    else:  # pragma: no cover - specs are validated by parse_hash_spec
        raise ValueError(f"unknown hash kind {kind!r}")
    return np.ascontiguousarray(out.reshape(len(words), spec.width), dtype=spec.dtype)


class CodeTable:
    """Cache ``string -> row id`` with one growing row array per spec; row 0 is all zeros."""

    def __init__(
        self,
        specs: Iterable[HashSpec],
        key: Optional[bytes] = DEFAULT_KEY,
        lsh: Optional[LSHModel] = None,
        max_entries: int = 1 << 21,
    ):
        self.specs = list(specs)
        self.key = key
        self.lsh = lsh
        self.max_entries = max_entries
        self.generation = -1  # bumped by clear(): row ids of an older generation are invalid
        self.clear()

    def clear(self) -> None:
        """Forget every string (row ids handed out before are invalid afterwards)."""
        self._index: dict[str, int] = {}
        self._rows = {s.name: np.zeros((1024, s.width), s.dtype) for s in self.specs}
        self._size = 1
        self.generation += 1

    def maybe_reset(self) -> bool:
        """Clear the cache when it holds more than ``max_entries`` strings; call between batches."""
        if self._size > self.max_entries:
            self.clear()
            return True
        return False

    def __len__(self) -> int:
        return self._size - 1

    def lookup(self, strings: Sequence[str]) -> np.ndarray:
        """Row ids ``int64 [len(strings)]``; unseen strings are hashed together in one batch."""
        index = self._index
        missing = [s for s in dict.fromkeys(strings) if s not in index]
        if missing:
            self._add(missing)
        return np.fromiter((index[s] for s in strings), dtype=np.int64, count=len(strings))

    def _add(self, strings: list[str]) -> None:
        start, end = self._size, self._size + len(strings)
        for spec in self.specs:
            rows = self._rows[spec.name]
            if end > len(rows):
                grown = np.zeros((max(end, 2 * len(rows)), spec.width), spec.dtype)
                grown[:start] = rows[:start]
                self._rows[spec.name] = rows = grown
            rows[start:end] = hash_words(spec, strings, self.key, self.lsh)
        for i, s in enumerate(strings):
            self._index[s] = start + i
        self._size = end

    def rows(self, name: str, ids: np.ndarray) -> np.ndarray:
        """Gather code rows ``[len(ids), width]`` of spec ``name`` for row ids ``ids``."""
        return self._rows[name][ids]
