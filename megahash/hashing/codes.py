"""Batched word -> code rows for a set of hash specs, each unique string hashed once.

``hash_words`` computes the rows of one spec for a list of strings. ``CodeTable`` is the cache the
preprocessor uses: it maps strings to row ids (row 0 is the all-zero row of special tokens; the
model embeds specials with its own small table), hashes all strings it has not seen in one batch per
``lookup`` call, and gathers rows with numpy indexing.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable, Sequence
from itertools import repeat

import numpy as np

from megahash.hashing.lsh import LSHModel
from megahash.hashing.md5 import DEFAULT_KEY, MD5_BYTES
from megahash.hashing.rolling import rolling_codes
from megahash.hashing.specs import HashSpec

ZERO_ROW = 0  # row id of special tokens


def hash_words(
    spec: HashSpec, words: Sequence[str], key: bytes | None = DEFAULT_KEY, lsh: LSHModel | None = None
) -> np.ndarray:
    """Code rows ``[len(words), spec.width]`` of ``spec.dtype`` for ``words`` (no special handling)."""
    kind, p = spec.kind, spec.params
    if kind in ("lsh", "lsh-bucket") and lsh is None:
        raise ValueError(f"hash spec {spec.name!r} needs an LSH model (n-gram vocabulary + planes)")
    if kind == "md5":
        out = np.frombuffer(md5_digests_batch(words, key), dtype=np.uint8).reshape(len(words), MD5_BYTES)
    elif kind == "md5-bucket":
        buf, n, frm = md5_digests_batch(words, key), p["buckets"], int.from_bytes
        out = np.array([frm(buf[i : i + MD5_BYTES], "big") % n for i in range(0, len(buf), MD5_BYTES)], np.int64)
    elif kind == "lsh":
        out = lsh.bits(words, p["bits"])
    elif kind == "lsh-bucket":
        out = lsh.buckets(words, p["buckets"])
    elif kind == "rolling":
        out = rolling_codes(words, p["n"], p["max_len"])
    else:  # pragma: no cover - specs are validated by parse_hash_spec
        raise ValueError(f"unknown hash kind {kind!r}")
    return np.ascontiguousarray(out.reshape(len(words), spec.width), dtype=spec.dtype)


def md5_digests_batch(words: Sequence[str], key: bytes | None = DEFAULT_KEY) -> bytes:
    """``megahash.hashing.md5.md5_digests``: concatenated HMAC-MD5(key, UTF-8 of word) (plain MD5
    for ``key=None``), computed by copying one keyed state per word, which is several times faster
    than a one-shot ``hmac.digest`` per word (that sets the key up each time)."""
    base = hashlib.md5() if key is None else hmac.new(key, digestmod="md5")
    copy = base.copy
    out = []
    append = out.append
    for w in words:
        h = copy()
        h.update(w.encode("utf-8", "surrogatepass"))
        append(h.digest())
    return b"".join(out)


class CodeTable:
    """Cache ``string -> row id`` with one growing row array per spec; row 0 is all zeros."""

    def __init__(
        self,
        specs: Iterable[HashSpec],
        key: bytes | None = DEFAULT_KEY,
        lsh: LSHModel | None = None,
        max_entries: int = 1 << 21,
        max_chars: int = 1 << 24,
    ):
        self.specs = list(specs)
        self.key = key
        self.lsh = lsh
        self.max_entries = max_entries
        self.max_chars = max_chars
        self.generation = -1  # bumped by clear(): row ids of an older generation are invalid
        self.clear()

    def clear(self) -> None:
        """Forget every string (row ids handed out before are invalid afterwards)."""
        self._index: dict[str, int] = {}
        self._strings: list[str] = [""]  # row id -> string (row 0: specials)
        self._rows = {s.name: np.zeros((1024, s.width), s.dtype) for s in self.specs}
        self._size = 1
        self._chars = 0
        self.generation += 1

    def full(self) -> bool:
        """True when ``maybe_reset`` would clear the cache."""
        return self._size > self.max_entries or self._chars > self.max_chars

    def maybe_reset(self) -> bool:
        """Clear the cache when it holds more than ``max_entries`` strings or ``max_chars`` characters
        (a memory bound whatever the strings' lengths); call between batches."""
        if self.full():
            self.clear()
            return True
        return False

    def __len__(self) -> int:
        return self._size - 1

    def lookup(self, strings: Sequence[str]) -> np.ndarray:
        """Row ids ``int64 [len(strings)]``; unseen strings are hashed together in one batch."""
        index = self._index
        ids = np.fromiter(map(index.get, strings, repeat(-1)), dtype=np.int64, count=len(strings))
        miss = np.flatnonzero(ids < 0)
        if len(miss):
            missing = [strings[i] for i in miss.tolist()]
            self._add(list(dict.fromkeys(missing)))  # in order of first occurrence
            ids[miss] = np.fromiter(map(index.__getitem__, missing), dtype=np.int64, count=len(missing))
        return ids

    def _add(self, strings: list[str]) -> None:
        start, end = self._size, self._size + len(strings)
        for spec in self.specs:
            rows = self._rows[spec.name]
            if end > len(rows):
                grown = np.zeros((max(end, 2 * len(rows)), spec.width), spec.dtype)
                grown[:start] = rows[:start]
                self._rows[spec.name] = rows = grown
            rows[start:end] = hash_words(spec, strings, self.key, self.lsh)
        self._index.update(zip(strings, range(start, end)))
        self._strings.extend(strings)
        self._size = end
        self._chars += sum(map(len, strings))

    def strings_from(self, row: int) -> list[str]:
        """Strings of rows ``row, row + 1, ...`` (in row order) of the current generation."""
        return self._strings[row:]

    def rows(self, name: str, ids: np.ndarray) -> np.ndarray:
        """Gather code rows ``[len(ids), width]`` of spec ``name`` for row ids ``ids``."""
        return self._rows[name][ids]
