"""EELBERT dynamic hash embedding inputs: polynomial rolling hashes of character i-grams ([Cohn23],
arXiv 2310.20144).

Hash of a string ``s`` of code points (the equation of [Cohn23])::

    H(s) = s[0]·p^(len-1) + s[1]·p^(len-2) + ... + s[len-2]·p + s[len-1]   (mod m),  p = 31, m = 1e9+7

computed by Horner's rule, with ``s[k] = ord(char)``. [Julian23]'s JAX snippet does not compute this
equation: its scan starts from ``value = s[0]``, ``power = len`` and adds ``(s[k] - 96)·power`` with
``power *= p``, i.e. ``s[0] + Σ_{k>=1} (s[k]-96)·len·p^(k-1)``. We follow the stated equation (the
standard polynomial rolling hash), not that snippet.

Per word, ``rolling_codes`` stores every i-gram hash for i = 1..n of the word truncated to
``max_len`` characters: partition i holds ``max_len - i + 1`` int32 slots (hashes in position order,
then -1 padding), so the row width is ``Σ_i (max_len - i + 1)`` (45 for n = 3, max_len = 16). All hash
values are < m < 2^31. The model layer turns a row into the embedding: seeded outer product, mod b,
map to [-1, 1], mean over the i-grams of each i, partition i of d (``rolling_embedding_from_codes``
is the numpy reference of that step; ``rolling_embedding`` is [Julian23]'s whole function).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

ROLLING_P = 31
ROLLING_M = 1_000_000_007
DEFAULT_N = 3
DEFAULT_MAX_LEN = 16
PAD = -1


def rolling_hash(s: str, p: int = ROLLING_P, m: int = ROLLING_M) -> int:
    """``Σ_k ord(s[k])·p^(len-1-k) mod m`` (Horner's rule)."""
    h = 0
    for ch in s:
        h = (h * p + ord(ch)) % m
    return h


def rolling_partitions(n: int = DEFAULT_N, max_len: int = DEFAULT_MAX_LEN) -> list[tuple[int, int]]:
    """``(start, size)`` of the slots of i = 1..n in a code row."""
    out, start = [], 0
    for i in range(1, n + 1):
        size = max(0, max_len - i + 1)
        out.append((start, size))
        start += size
    return out


def rolling_width(n: int = DEFAULT_N, max_len: int = DEFAULT_MAX_LEN) -> int:
    """Row width ``Σ_{i=1..n} (max_len - i + 1)``."""
    return sum(size for _, size in rolling_partitions(n, max_len))


def _word_row(word: str, n: int, max_len: int, p: int, m: int, parts) -> list[tuple[int, list[int]]]:
    cps = [ord(c) for c in word[:max_len]]
    length = len(cps)
    prefix = [0] * (length + 1)  # prefix[k] = H(cps[:k])
    for k, c in enumerate(cps):
        prefix[k + 1] = (prefix[k] * p + c) % m
    out = []
    for i in range(1, n + 1):
        pi = pow(p, i, m)
        out.append((parts[i - 1][0], [(prefix[k + i] - prefix[k] * pi) % m for k in range(length - i + 1)]))
    return out


def rolling_codes(
    words: Sequence[str],
    n: int = DEFAULT_N,
    max_len: int = DEFAULT_MAX_LEN,
    p: int = ROLLING_P,
    m: int = ROLLING_M,
) -> np.ndarray:
    """``int32 [len(words), rolling_width(n, max_len)]``: i-gram hashes per partition, -1 padded."""
    if m >= 2**31:
        raise ValueError("rolling hash modulus must be < 2^31 to fit int32 codes")
    parts = rolling_partitions(n, max_len)
    out = np.full((len(words), rolling_width(n, max_len)), PAD, dtype=np.int32)
    for b, w in enumerate(words):
        for start, values in _word_row(w, n, max_len, p, m, parts):
            if values:
                out[b, start : start + len(values)] = values
    return out


def rolling_seeds(d: int, n: int = DEFAULT_N, seed: int = 42) -> np.ndarray:
    """Seeded hash multipliers ``int64 [d // P, P]`` in [0, 2^32), P = n(n+1)/2 ([Julian23]'s ``h``)."""
    parts = n * (n + 1) // 2
    rng = np.random.Generator(np.random.PCG64(seed))
    return rng.integers(0, 2**32, size=(d // parts, parts), dtype=np.int64)


def rolling_embedding_from_codes(
    row: np.ndarray, d: int, n: int = DEFAULT_N, max_len: int = DEFAULT_MAX_LEN, seed: int = 42, b: int = ROLLING_M
) -> np.ndarray:
    """[Julian23]'s embedding from one code row: for each i, outer(hashes_i, h[:, run:run+i]) mod b,
    mapped to (-1, 1] by ``p - [p > b/2]·b`` then ``/(b/2)``, averaged over the i-grams, written to
    dims ``[run·d/P, (run+i)·d/P)``; an i with no i-grams leaves zeros. Returns ``float64 [d]``."""
    h = rolling_seeds(d, n, seed)
    per = h.shape[0]
    emb = np.zeros(d, dtype=np.float64)
    run = 0
    for i, (start, size) in enumerate(rolling_partitions(n, max_len), start=1):
        s = np.asarray(row[start : start + size], dtype=np.int64)
        s = s[s >= 0]
        if len(s):
            prod = s[:, None] * h[:, run : run + i].reshape(-1)[None, :]  # < 2^31 · 2^32: exact in int64
            q = (prod % b).astype(np.float64)
            q = q - (q > b / 2) * b
            emb[run * per : (run + i) * per] = (q / (b / 2)).mean(axis=0)
        run += i
    return emb


def rolling_embedding(
    word: str, d: int = 768, n: int = DEFAULT_N, seed: int = 42, b: int = ROLLING_M, max_len: int | None = None
) -> np.ndarray:
    """[Julian23]'s ``hash_embedding`` in numpy (no truncation unless ``max_len`` is given)."""
    max_len = len(word) if max_len is None else max_len
    return rolling_embedding_from_codes(rolling_codes([word], n, max_len)[0], d, n, max_len, seed, b)
