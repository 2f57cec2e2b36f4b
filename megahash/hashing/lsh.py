"""HashFormers-LSH: locality-sensitive word codes from character n-grams ([Xue25] sec. 2.3.3 and 2.3.5).

Features (sec. 2.3.3, footnote 4): a word is a bag of its character n-grams, n = 1..4, over code
points, without boundary markers; element ``x_g`` is how often n-gram ``g`` occurs in the word
("weighted by the frequency of the character n-grams of the token"). Only the ``K`` most frequent
n-grams of the corpus are features (default K = 50,000; ties broken by the n-gram string), so the
n-gram vocabulary is corpus dependent and is saved with the shards. A word none of whose n-grams is
in the vocabulary has ``x = 0``: all its bits are 0 and its bucket is 0.

Bits (sec. 2.3.5): T hyperplanes ``r_j`` with i.i.d. N(0, 1) entries,
``R = Generator(PCG64(seed)).standard_normal((K, T), dtype=float32)`` (row = n-gram, column = plane);
bit ``j`` is ``[x . r_j > 0]`` (the [Xue25] ``sgn(sgn(x . r_j) + 1)`` with a zero dot product
mapped to 0), packed T/8 bytes MSB first like the MD5 codes.

Buckets (sec. 2.3.3, circulant hyperplanes): one stored vector ``eta`` of length ``L = max(K, N)``,
``Generator(PCG64([seed, 1])).standard_normal(L, dtype=float32)``. Hyperplane ``b`` (b = 0..N-1)
is ``eta`` cyclically shifted left by ``b + 1``: ``r^b[g] = eta[(g + b + 1) mod L]``; so ``b = 0`` is the
[Xue25] ``r^1 = [eta_2, ..., eta_L, eta_1]`` and every plane has the same L2 norm. The bucket is
``argmax_b x . r^b`` (first index on ties). With N <= K this is exactly [Xue25]; ``L = max(K, N)``
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
from collections.abc import Iterable, Mapping, Sequence

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


class _NgramKeys:
    """Vectorised n-grams: every character n-gram of a batch of words as one int64 key, in
    ``word_ngrams`` order. A key holds the n-gram's characters as base-``B`` digits (digit = rank of
    the code point in ``alphabet`` + 1, most significant first, 0-padded to the longest order), so
    keys are equal iff the n-grams are, and compare like the strings (code point order, a prefix
    first). ``None`` from ``build`` when that does not fit (``B ** max(orders) >= 2**63``, a NUL
    character, or orders outside 1..8); callers then use the per-string Python code."""

    __slots__ = ("alphabet", "base", "width", "lut", "keys", "per")

    @staticmethod
    def codepoints(words: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        """Code points of ``"".join(words)`` (``uint32``) and the length of each word."""
        cps = np.frombuffer("".join(words).encode("utf-32-le", "surrogatepass"), dtype="<u4")
        lengths = np.fromiter(map(len, words), dtype=np.int64, count=len(words))
        return cps, lengths

    @classmethod
    def build(cls, cps: np.ndarray, lengths: np.ndarray, orders: Sequence[int], extra_cps=None, ordered: bool = True):
        """Keys of all n-grams of the words with code points ``cps`` (concatenated) and ``lengths``;
        ``ordered=False`` leaves them grouped by order (``keys``) with their word indices (``per``
        then holds the word index of each key) instead of in ``word_ngrams`` order."""
        orders = [int(n) for n in orders]
        if not orders or min(orders) < 1 or max(orders) > 8:
            return None
        width = max(orders)
        extra = np.zeros(0, np.uint32) if extra_cps is None else np.asarray(extra_cps, np.uint32)
        top = max(int(cps.max()) if len(cps) else 0, int(extra.max()) if len(extra) else 0)
        present = np.zeros(top + 1, bool)
        present[cps] = True
        present[extra] = True
        if present[0]:
            return None
        alphabet = np.flatnonzero(present).astype(np.uint32)
        base = len(alphabet) + 1
        if base**width >= 2**63:
            return None
        self = cls()
        self.alphabet, self.base, self.width = alphabet, base, width
        self.lut = np.zeros(top + 1, np.int64)  # code point -> digit (0 for NUL / padding)
        self.lut[alphabet] = np.arange(1, base, dtype=np.int64)
        digits = np.zeros(len(cps) + width, np.int64)
        digits[: len(cps)] = self.lut[cps]
        n_words = len(lengths)
        starts = np.zeros(n_words, np.int64)
        if n_words > 1:
            np.cumsum(lengths[:-1], out=starts[1:])
        word_of = np.repeat(np.arange(n_words), lengths)
        local = np.arange(len(cps), dtype=np.int64) - starts[word_of]  # position inside the word
        remain = lengths[word_of] - local  # characters from here to the end of the word
        prefix = [None] * (width + 1)  # prefix[n][p]: key of the n-gram starting at p
        acc = np.zeros(len(cps), np.int64)
        for j in range(width):
            acc = acc + digits[j : j + len(cps)] * base ** (width - 1 - j)
            prefix[j + 1] = acc
        if not ordered:
            sel = [np.flatnonzero(remain >= n) for n in orders]
            self.keys = np.concatenate([prefix[n][p] for n, p in zip(orders, sel)])
            self.per = word_of[np.concatenate(sel)]
            return self
        counts = [np.maximum(lengths - n + 1, 0) for n in orders]
        per = np.zeros(n_words, np.int64)
        for c in counts:
            per += c
        offs = np.zeros(n_words, np.int64)
        if n_words > 1:
            np.cumsum(per[:-1], out=offs[1:])
        keys = np.empty(int(per.sum()), np.int64)
        block = offs.copy()  # where the next order's n-grams of each word go
        for n, c in zip(orders, counts):
            pos = np.flatnonzero(remain >= n)
            w = word_of[pos]
            keys[block[w] + local[pos]] = prefix[n][pos]
            block += c
        self.keys, self.per = keys, per
        return self

    def encode_codepoints(self, cps: np.ndarray) -> np.ndarray:
        """Keys of n-grams given as ``uint32 [k, width]`` code points (0-padded, characters in ``alphabet``)."""
        key = np.zeros(len(cps), np.int64)
        for j in range(self.width):
            key = key * self.base + self.lut[cps[:, j]]
        return key

    def decode(self, keys: np.ndarray) -> list[str]:
        """The n-gram strings of ``keys``."""
        keys = np.asarray(keys, np.int64)
        cps = np.zeros((len(keys), self.width), "<u4")
        for j in range(self.width):
            d = (keys // self.base ** (self.width - 1 - j)) % self.base
            cps[:, j] = np.where(d > 0, self.alphabet[np.maximum(d - 1, 0)], 0)
        return cps.view(f"<U{self.width}").reshape(len(keys)).tolist()


def _sort_with_index(keys: np.ndarray, limit: int) -> tuple[np.ndarray, np.ndarray]:
    """``keys`` sorted (ties by position) and the positions they came from; packs ``key * n +
    position`` into one int64 sort when ``limit * n < 2**63`` (keys are in ``[0, limit)``)."""
    n = len(keys)
    if n and limit * n < 2**63:
        packed = np.sort(keys * n + np.arange(n, dtype=np.int64))
        sk = packed // n
        return sk, packed - sk * n
    order = np.argsort(keys, kind="stable")
    return keys[order], order


_BLOCK_CHARS = 1 << 22  # characters of words per block of n-gram keys (bounds the memory)


def _word_blocks(lengths: np.ndarray, block_chars: int) -> list[tuple[int, int]]:
    """``[start, end)`` word ranges of about ``block_chars`` characters each."""
    ends = np.cumsum(lengths)
    bounds, start = [], 0
    while start < len(lengths):
        done = int(ends[start - 1]) if start else 0
        end = max(int(np.searchsorted(ends, done + block_chars, side="right")), start + 1)
        bounds.append((start, end))
        start = end
    return bounds


def _top_ngrams_fast(
    words: Sequence[str], weights: np.ndarray, size: int, orders: Sequence[int], block_chars: int = _BLOCK_CHARS
):
    """``top_ngrams(count_ngrams(dict(zip(words, weights))), size)`` with numpy; None if the
    n-grams do not fit int64 keys (see ``_NgramKeys``). Words are taken in blocks of about
    ``block_chars`` characters, all keyed with one alphabet, and the per-block totals merged."""
    weights = np.asarray(weights, np.int64)
    blocks = _word_blocks(np.fromiter(map(len, words), np.int64, count=len(words)), block_chars)
    alphabet = None
    if len(blocks) > 1:  # one alphabet for all blocks, so that their keys agree
        parts = [np.unique(_NgramKeys.codepoints(words[a:b])[0]) for a, b in blocks]
        alphabet = np.unique(np.concatenate(parts)).astype(np.uint32)
    uniqs, totals, nk = [], [], None
    for a, b in blocks:
        cps, lengths = _NgramKeys.codepoints(words[a:b])
        nk = _NgramKeys.build(cps, lengths, orders, extra_cps=alphabet, ordered=False)
        if nk is None:
            return None
        if not len(nk.keys):
            continue
        ks, pos = _sort_with_index(nk.keys, nk.base**nk.width)
        first = np.flatnonzero(np.concatenate([[True], ks[1:] != ks[:-1]]))
        uniqs.append(ks[first])
        totals.append(np.add.reduceat(weights[a:b][nk.per[pos]], first))  # exact int64 sums
    if not uniqs:
        return []
    uniq, total = uniqs[0], totals[0]
    if len(uniqs) > 1:
        ks, pos = _sort_with_index(np.concatenate(uniqs), nk.base**nk.width)
        first = np.flatnonzero(np.concatenate([[True], ks[1:] != ks[:-1]]))
        uniq, total = ks[first], np.add.reduceat(np.concatenate(totals)[pos], first)
    top = np.lexsort((uniq, -total))[:size]  # count descending, then the n-gram string
    return nk.decode(uniq[top])


def count_ngrams(
    word_counts: Mapping[str, int] | Iterable[tuple[str, int]],
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
        self._vocab_cache = None  # see _vocab_arrays

    # construction / persistence -------------------------------------------------------------
    @classmethod
    def from_word_counts(
        cls,
        word_counts: Mapping[str, int] | Iterable[tuple[str, int]],
        vocab_size: int = DEFAULT_NGRAM_VOCAB,
        seed: int = DEFAULT_SEED,
        orders: Sequence[int] = NGRAM_ORDERS,
    ) -> LSHModel:
        """Build the top-``vocab_size`` n-gram vocabulary from corpus word counts."""
        if isinstance(word_counts, Mapping):
            pairs, words, values, distinct = word_counts, list(word_counts), word_counts.values(), True
        else:  # (word, count) pairs: a repeated word counts once per pair
            pairs = list(word_counts)
            words, values = [w for w, _ in pairs], [c for _, c in pairs]
            distinct = len(set(words)) == len(words)
        try:
            weights = np.fromiter(values, np.int64, count=len(words)) if distinct else None
        except (OverflowError, TypeError, ValueError):
            weights = None
        longest = max(map(len, words), default=0)
        # numpy path when all n-gram totals are exact in int64 (else, and for unusual characters, the
        # per-string path; both give the same vocabulary)
        if weights is not None and float(np.abs(weights.astype(np.float64)).sum()) * (longest + 1) < 2.0**62:
            fast = _top_ngrams_fast(words, weights, vocab_size, orders)
            if fast is not None:
                return cls(fast, seed, orders)
        return cls(top_ngrams(count_ngrams(pairs, orders), vocab_size), seed, orders)

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
            planes = np.zeros((self.vocab_size + 1, num_bits), np.float32)  # last row zero (padding)
            rng = np.random.Generator(np.random.PCG64(self.seed))  # = make_hyperplanes, written in place
            rng.standard_normal((self.vocab_size, num_bits), dtype=np.float32, out=planes[:-1])
            self._planes[num_bits] = planes
        return self._planes[num_bits]

    def save(self, path, bits: Sequence[int] = (), buckets: Sequence[int] = ()) -> None:
        """Write vocabulary, seed and the planes for ``bits``/``buckets`` to a deterministic .npz (with the
        n-grams' lengths when one ends in NUL: numpy's string arrays drop trailing NULs)."""
        arrays = {
            "format_version": np.array(LSH_FORMAT_VERSION, np.int64),
            "seed": np.array(self.seed, np.int64),
            "orders": np.array(self.orders, np.int64),
            "ngrams": np.array(self.ngrams, dtype=f"<U{max(self.orders)}"),
        }
        if any(g.endswith("\0") for g in self.ngrams):  # numpy's str arrays drop trailing NULs: keep them
            arrays["ngram_lengths"] = np.array([len(g) for g in self.ngrams], np.int64)
        for t in sorted(set(bits)):
            arrays[f"hyperplanes_{t}"] = self.hyperplanes(t)
        for n in sorted(set(buckets)):
            arrays[f"eta_{n}"] = self.eta(n)
        save_npz_deterministic(path, arrays)

    @classmethod
    def load(cls, path) -> LSHModel:
        """Read a model written by ``save``; stored planes are used as they are. A damaged file (not a zip, a bad
        CRC, cut short, an array missing or misnamed, another NumPy file: a ``.npy`` array, bytes numpy takes for a
        pickle) is a ValueError naming it, as a wrong version is."""
        import zipfile

        def unreadable(why: str) -> ValueError:
            return ValueError(f"{path}: not a readable LSH model ({why})")

        try:
            z = np.load(path, allow_pickle=False)
        except ValueError as e:  # neither a zip nor a .npy: np.load took it for a pickle (and advises allow_pickle)
            raise unreadable("not a NumPy .npz archive" if "pickled" in str(e) else f"ValueError: {e}") from None
        except (zipfile.BadZipFile, EOFError) as e:
            raise unreadable(f"{type(e).__name__}: {e}") from None
        if not isinstance(z, np.lib.npyio.NpzFile):  # a .npy array (np.save) under the archive's name
            raise unreadable("a single NumPy array, not an .npz archive")
        with z:
            try:
                return cls._load(path, z)
            except (zipfile.BadZipFile, EOFError, KeyError, IndexError) as e:
                raise unreadable(f"{type(e).__name__}: {e}") from None
            except ValueError as e:
                if str(e).startswith(f"{path}: "):  # a wrong version, duplicate n-grams: they name the file
                    raise
                raise unreadable(f"ValueError: {e}") from None

    @classmethod
    def _load(cls, path, z) -> LSHModel:
        version = int(z["format_version"])
        if version != LSH_FORMAT_VERSION:
            raise ValueError(f"{path}: LSH format version {version}, expected {LSH_FORMAT_VERSION}")
        ngrams = [str(g) for g in z["ngrams"]]
        if "ngram_lengths" in z.files:  # n-grams that end in NUL ("\0"), which numpy stored without it
            ngrams = [g.ljust(int(n), "\0") for g, n in zip(ngrams, z["ngram_lengths"])]
        try:
            model = cls(ngrams, int(z["seed"]), [int(n) for n in z["orders"]])
        except ValueError as e:  # duplicates: n-grams ending in NUL written before they were kept
            raise ValueError(
                f"{path}: {e}; rewrite the shards with data_tools/preprocess_data.py --overwrite"
            ) from None
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
        fast = self._flat_ids_fast(words)
        if fast is not None:
            return fast
        grams, per = _flat_ngrams(words, self.orders)
        get, pad = self.index.get, self.vocab_size
        return np.fromiter((get(g, pad) for g in grams), dtype=np.int64, count=len(grams)), per

    def _vocab_arrays(self):
        """Vocabulary n-grams usable as keys: (code points [k, width], their vocabulary ids), or
        None when a vocabulary string holds a NUL (the key encoding cannot represent it)."""
        if self._vocab_cache is None:
            width = max(self.orders) if self.orders else 0
            lengths = set(self.orders)
            ok = [i for i, g in enumerate(self.ngrams) if len(g) in lengths]
            if any("\0" in self.ngrams[i] for i in ok) or not width:
                self._vocab_cache = (None,)
            else:
                arr = np.array([self.ngrams[i] for i in ok], dtype=f"<U{width}")
                cps = arr.view("<u4").reshape(len(ok), width)
                self._vocab_cache = (cps, np.array(ok, np.int64))
        return None if self._vocab_cache[0] is None else self._vocab_cache

    def _flat_ids_fast(self, words: Sequence[str]):
        vocab = self._vocab_arrays()
        if vocab is None:
            return None
        vcps, vids = vocab
        cps, lengths = _NgramKeys.codepoints(words)
        nk = _NgramKeys.build(cps, lengths, self.orders, extra_cps=vcps[vcps > 0])
        if nk is None:
            return None
        pad = self.vocab_size
        if not len(vids):
            return np.full(len(nk.keys), pad, np.int64), nk.per
        vkeys = nk.encode_codepoints(vcps)
        order = np.argsort(vkeys, kind="stable")
        vk, vid = vkeys[order], vids[order]
        ids = np.full(len(nk.keys), pad, np.int64)
        if len(nk.keys):  # look up each distinct n-gram once (a sort beats a binary search per occurrence)
            ks, pos = _sort_with_index(nk.keys, nk.base**nk.width)
            first = np.flatnonzero(np.concatenate([[True], ks[1:] != ks[:-1]]))
            uniq = ks[first]
            j = np.minimum(np.searchsorted(vk, uniq), len(vk) - 1)
            found = np.where(vk[j] == uniq, vid[j], pad)
            ids[pos] = np.repeat(found, np.diff(np.append(first, len(ks))))
        return ids, nk.per

    def project(self, words: Sequence[str], num_bits: int, block: int = 2048) -> np.ndarray:
        """``float32 [B, T]`` dot products ``x . r_j``, each the float32 sum of ``r_j[g]`` over the
        word's n-gram occurrences in order (out-of-vocabulary ones add the zero row): element-wise
        numpy adds, so a word's value does not depend on the batch it is hashed in."""
        if len(words) <= 65536:
            return self.project_ids(*self.flat_ids(words), num_bits, block=block)
        return np.concatenate(
            [self.project(words[s : s + 65536], num_bits, block) for s in range(0, len(words), 65536)]
        )

    def project_ids(self, ids: np.ndarray, per: np.ndarray, num_bits: int, block: int = 2048) -> np.ndarray:
        """``project`` from ``flat_ids`` output."""
        planes = self._planes_ext(num_bits)
        out = np.zeros((len(per), num_bits), dtype=np.float32)
        if not len(per):
            return out
        offs = np.zeros(len(per), np.int64)
        np.cumsum(per[:-1], out=offs[1:])
        order = np.argsort(-per, kind="stable")  # longest first: step k touches a prefix
        acc = np.zeros((min(block, len(per)), num_bits), dtype=np.float32)
        tmp = np.empty_like(acc)
        for s in range(0, len(per), block):  # blocks of words keep the accumulator in cache
            sel = order[s : s + block]
            p, o = per[sel], offs[sel]
            m = len(sel)
            acc[:m] = 0
            neg = -p
            for k in range(int(p[0])):
                n_k = int(np.searchsorted(neg, -k, side="left"))  # words with more than k n-grams
                np.take(planes, ids[o[:n_k] + k], axis=0, out=tmp[:n_k])
                np.add(acc[:n_k], tmp[:n_k], out=acc[:n_k])
            out[sel] = acc[:m]
        return out

    def bits(self, words: Sequence[str], num_bits: int) -> np.ndarray:
        """Packed LSH codes ``uint8 [B, T/8]``, bit j = [x . r_j > 0], MSB first."""
        if num_bits % 8:
            raise ValueError(f"LSH bits must be a multiple of 8, got {num_bits}")
        return np.packbits(self.project(words, num_bits) > 0, axis=1)

    def buckets(self, words: Sequence[str], num_buckets: int) -> np.ndarray:
        """Circulant-LSH bucket ids ``int64 [B]`` = argmax_b x . r^b (one word at a time: the
        N-wide sums over its n-gram occurrences use contiguous slices of [eta, eta])."""
        return self.buckets_ids(*self.flat_ids(words), num_buckets)

    def buckets_ids(self, ids: np.ndarray, per: np.ndarray, num_buckets: int) -> np.ndarray:
        """``buckets`` from ``flat_ids`` output."""
        eta = self.eta(num_buckets)
        eta2 = np.concatenate([eta, eta])
        proj = np.empty(num_buckets, np.float32)
        out = np.zeros(len(per), dtype=np.int64)
        offs = np.concatenate([[0], np.cumsum(per)]).tolist()
        pad = self.vocab_size
        for b in range(len(per)):
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
