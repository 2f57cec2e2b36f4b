"""HashFormers-LSH: locality-sensitive word codes from character n-grams (thesis sec. 2.3.3 and 2.3.5).

Features (sec. 2.3.3, footnote 4): a word is a bag of its character n-grams, n = 1..4, over code
points, without boundary markers; element ``x_g`` is how often n-gram ``g`` occurs in the word
("weighted by the frequency of the character n-grams of the token"). Only the ``K`` most frequent
n-grams of the corpus are features (default K = 50,000; ties broken by the n-gram string), so the
n-gram vocabulary is corpus dependent and is saved with the shards. A word none of whose n-grams is
in the vocabulary has ``x = 0``: all its bits are 0 and its bucket is 0.

Bits (sec. 2.3.5): T hyperplanes ``r_j`` with i.i.d. N(0, 1) entries,
``R = Generator(PCG64(seed)).standard_normal((K, T), dtype=float32)`` (row = n-gram, column = plane);
bit ``j`` is ``[x . r_j > 0]`` (the thesis' ``sgn(sgn(x . r_j) + 1)`` with a zero dot product
mapped to 0), packed T/8 bytes MSB first like the MD5 codes.

Buckets (sec. 2.3.3, circulant hyperplanes): one stored vector ``eta`` of length ``L = max(K, N)``,
``Generator(PCG64([seed, 1])).standard_normal(L, dtype=float32)``. Hyperplane ``b`` (b = 0..N-1)
is ``eta`` cyclically shifted left by ``b + 1``: ``r^b[g] = eta[(g + b + 1) mod L]``; so ``b = 0`` is the
thesis' ``r^1 = [eta_2, ..., eta_L, eta_1]`` and every plane has the same L2 norm. The bucket is
``argmax_b x . r^b`` (first index on ties). With N <= K this is exactly the thesis; ``L = max(K, N)``
only keeps the N planes distinct when N > K.

A projection ``x . r`` is computed as the float32 sum of ``r[g]`` over the word's in-vocabulary n-gram
occurrences in ``word_ngrams`` order (an n-gram occurring c times is added c times), with element-wise
numpy adds (no BLAS reductions), so a word's code does not depend on the batch it is hashed in, the
number of worker processes, or the machine. The random matrices are regenerated from the seed on demand and
are also saved (``save``/``load``, a byte-deterministic .npz) because numpy does not promise the
same random stream across its versions.
"""
from __future__ import annotations

import io
import zipfile
from collections import Counter
from typing import Iterable, Mapping, Sequence, Union

import numpy as np

NGRAM_ORDERS = (1, 2, 3, 4)
DEFAULT_NGRAM_VOCAB = 50_000
DEFAULT_SEED = 1234
LSH_FORMAT_VERSION = 1


def word_ngrams(word: str, orders: Sequence[int] = NGRAM_ORDERS) -> list[str]:
    """All character n-grams of ``word`` for n in ``orders`` (n ascending, then position)."""
    out = []
    for n in orders:
        out.extend(word[i : i + n] for i in range(len(word) - n + 1))
    return out


def _flat_ngrams(words: Sequence[str], orders: Sequence[int]) -> tuple[list[str], np.ndarray]:
    """All n-grams of all words (each word in ``word_ngrams`` order) and the count per word."""
    grams = [w[i : i + n] for w in words for n in orders for i in range(len(w) - n + 1)]
    lengths = np.fromiter(map(len, words), dtype=np.int64, count=len(words))
    per = sum(np.maximum(lengths - n + 1, 0) for n in orders) if len(words) else np.zeros(0, np.int64)
    return grams, np.asarray(per, dtype=np.int64)


def count_ngrams(
    word_counts: Union[Mapping[str, int], Iterable[tuple[str, int]]],
    orders: Sequence[int] = NGRAM_ORDERS,
    block: int = 100_000,
) -> Counter:
    """Corpus n-gram counts: every n-gram occurrence of every word, weighted by the word's count."""
    items = list(word_counts.items() if isinstance(word_counts, Mapping) else word_counts)
    index: dict[str, int] = {}
    totals = np.zeros(0, np.int64)
    for s in range(0, len(items), block):
        words = [w for w, _ in items[s : s + block]]
        weights = np.array([c for _, c in items[s : s + block]], dtype=np.int64)
        grams, per = _flat_ngrams(words, orders)
        gid = np.fromiter((index.setdefault(g, len(index)) for g in grams), dtype=np.int64, count=len(grams))
        add = np.bincount(gid, weights=np.repeat(weights, per), minlength=len(index)).astype(np.int64)
        totals = np.concatenate([totals, np.zeros(len(index) - len(totals), np.int64)]) + add
    return Counter(dict(zip(index, totals.tolist())))


def top_ngrams(ngram_counts: Mapping[str, int], size: int = DEFAULT_NGRAM_VOCAB) -> list[str]:
    """The ``size`` most frequent n-grams, ordered by count (descending) then string."""
    ranked = sorted(ngram_counts.items(), key=lambda kv: (-kv[1], kv[0]))
    return [g for g, _ in ranked[:size]]


def make_hyperplanes(vocab_size: int, num_bits: int, seed: int) -> np.ndarray:
    """``float32 [K, T]`` Gaussian hyperplanes (column j = plane j) from ``PCG64(seed)``."""
    rng = np.random.Generator(np.random.PCG64(seed))
    return rng.standard_normal((vocab_size, num_bits), dtype=np.float32)


def make_eta(vocab_size: int, num_buckets: int, seed: int) -> np.ndarray:
    """``float32 [max(K, N)]`` circulant base vector eta from ``PCG64([seed, 1])``."""
    rng = np.random.Generator(np.random.PCG64([seed, 1]))
    return rng.standard_normal(max(vocab_size, num_buckets), dtype=np.float32)


class LSHModel:
    """n-gram vocabulary plus the seeded random planes; hashes words to LSH bits or buckets."""

    def __init__(self, ngrams: Sequence[str], seed: int = DEFAULT_SEED, orders: Sequence[int] = NGRAM_ORDERS):
        self.ngrams = list(ngrams)
        self.seed = int(seed)
        self.orders = tuple(int(n) for n in orders)
        self.index = {g: i for i, g in enumerate(self.ngrams)}
        if len(self.index) != len(self.ngrams):
            raise ValueError("duplicate n-grams in the LSH vocabulary")
        self._planes: dict[int, np.ndarray] = {}  # T -> [K + 1, T] (last row zero, for padding)
        self._etas: dict[int, np.ndarray] = {}  # N -> [L]

    # construction / persistence -------------------------------------------------------------
    @classmethod
    def from_word_counts(
        cls,
        word_counts: Union[Mapping[str, int], Iterable[tuple[str, int]]],
        vocab_size: int = DEFAULT_NGRAM_VOCAB,
        seed: int = DEFAULT_SEED,
        orders: Sequence[int] = NGRAM_ORDERS,
    ) -> "LSHModel":
        """Build the top-``vocab_size`` n-gram vocabulary from corpus word counts."""
        return cls(top_ngrams(count_ngrams(word_counts, orders), vocab_size), seed, orders)

    @property
    def vocab_size(self) -> int:
        return len(self.ngrams)

    def hyperplanes(self, num_bits: int) -> np.ndarray:
        """``float32 [K, T]`` planes (stored ones if loaded, else regenerated from the seed)."""
        return self._planes_ext(num_bits)[:-1]

    def eta(self, num_buckets: int) -> np.ndarray:
        """``float32 [max(K, N)]`` circulant base vector."""
        if num_buckets not in self._etas:
            self._etas[num_buckets] = make_eta(self.vocab_size, num_buckets, self.seed)
        return self._etas[num_buckets]

    def _planes_ext(self, num_bits: int) -> np.ndarray:
        if num_bits not in self._planes:
            r = make_hyperplanes(self.vocab_size, num_bits, self.seed)
            self._planes[num_bits] = np.vstack([r, np.zeros((1, num_bits), np.float32)])
        return self._planes[num_bits]

    def save(self, path, bits: Sequence[int] = (), buckets: Sequence[int] = ()) -> None:
        """Write vocabulary, seed and the planes for ``bits``/``buckets`` to a deterministic .npz."""
        arrays = {
            "format_version": np.array(LSH_FORMAT_VERSION, np.int64),
            "seed": np.array(self.seed, np.int64),
            "orders": np.array(self.orders, np.int64),
            "ngrams": np.array(self.ngrams, dtype=f"<U{max(self.orders)}"),
        }
        for t in sorted(set(bits)):
            arrays[f"hyperplanes_{t}"] = self.hyperplanes(t)
        for n in sorted(set(buckets)):
            arrays[f"eta_{n}"] = self.eta(n)
        save_npz_deterministic(path, arrays)

    @classmethod
    def load(cls, path) -> "LSHModel":
        """Read a model written by ``save``; stored planes are used as they are."""
        with np.load(path, allow_pickle=False) as z:
            version = int(z["format_version"])
            if version != LSH_FORMAT_VERSION:
                raise ValueError(f"{path}: LSH format version {version}, expected {LSH_FORMAT_VERSION}")
            model = cls([str(g) for g in z["ngrams"]], int(z["seed"]), [int(n) for n in z["orders"]])
            for name in z.files:
                if name.startswith("hyperplanes_"):
                    r = z[name].astype(np.float32)
                    model._planes[int(name.split("_")[1])] = np.vstack([r, np.zeros((1, r.shape[1]), np.float32)])
                elif name.startswith("eta_"):
                    model._etas[int(name.split("_")[1])] = z[name].astype(np.float32)
        return model

    # hashing --------------------------------------------------------------------------------
    def flat_ids(self, words: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        """Vocabulary ids of every n-gram occurrence of every word, in ``word_ngrams`` order
        (an n-gram occurring c times appears c times: the frequency weighting of x), with K for
        n-grams outside the vocabulary; and the number of n-grams per word."""
        grams, per = _flat_ngrams(words, self.orders)
        get, pad = self.index.get, self.vocab_size
        return np.fromiter((get(g, pad) for g in grams), dtype=np.int64, count=len(grams)), per

    def project(self, words: Sequence[str], num_bits: int, block: int = 16384) -> np.ndarray:
        """``float32 [B, T]`` dot products ``x . r_j``, each the float32 sum of ``r_j[g]`` over the
        word's n-gram occurrences in order (out-of-vocabulary ones add the zero row): element-wise
        numpy adds, so a word's value does not depend on the batch it is hashed in."""
        planes = self._planes_ext(num_bits)
        out = np.zeros((len(words), num_bits), dtype=np.float32)
        for s in range(0, len(words), block):
            ids, per = self.flat_ids(words[s : s + block])
            offs = np.zeros(len(per), np.int64)
            np.cumsum(per[:-1], out=offs[1:])
            order = np.argsort(-per, kind="stable")  # longest first: step k touches a prefix
            offs, per_sorted = offs[order], per[order]
            acc = np.zeros((len(per), num_bits), dtype=np.float32)
            for k in range(int(per_sorted[0]) if len(per) else 0):
                n_k = int(np.searchsorted(-per_sorted, -k, side="left"))  # words with more than k n-grams
                acc[:n_k] += planes[ids[offs[:n_k] + k]]
            out[s + order] = acc
        return out

    def bits(self, words: Sequence[str], num_bits: int) -> np.ndarray:
        """Packed LSH codes ``uint8 [B, T/8]``, bit j = [x . r_j > 0], MSB first."""
        if num_bits % 8:
            raise ValueError(f"LSH bits must be a multiple of 8, got {num_bits}")
        return np.packbits(self.project(words, num_bits) > 0, axis=1)

    def buckets(self, words: Sequence[str], num_buckets: int) -> np.ndarray:
        """Circulant-LSH bucket ids ``int64 [B]`` = argmax_b x . r^b (one word at a time: the
        N-wide sums over its n-gram occurrences use contiguous slices of [eta, eta])."""
        eta = self.eta(num_buckets)
        eta2 = np.concatenate([eta, eta])
        proj = np.empty(num_buckets, np.float32)
        out = np.zeros(len(words), dtype=np.int64)
        ids, per = self.flat_ids(words)
        offs = np.concatenate([[0], np.cumsum(per)]).tolist()
        pad = self.vocab_size
        for b in range(len(words)):
            proj.fill(0)
            for j in ids[offs[b] : offs[b + 1]].tolist():
                if j != pad:
                    np.add(proj, eta2[j + 1 : j + 1 + num_buckets], out=proj)
            out[b] = int(np.argmax(proj))
        return out


def save_npz_deterministic(path, arrays: Mapping[str, np.ndarray]) -> None:
    """``np.savez`` with fixed zip timestamps and no compression: same arrays -> same bytes."""
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED) as zf:
        for name, arr in arrays.items():
            buf = io.BytesIO()
            np.lib.format.write_array(buf, np.asarray(arr), allow_pickle=False)
            info = zipfile.ZipInfo(name + ".npy", date_time=(1980, 1, 1, 0, 0, 0))
            info.compress_type = zipfile.ZIP_STORED
            info.external_attr = 0o644 << 16
            zf.writestr(info, buf.getvalue())

