"""Raw text -> the token ids and word-hash codes a megahash model reads (numpy only; no torch).

Shipped inside every Hugging Face folder written by ``megahash export-hf`` (copied verbatim; a test
keeps it equal to ``megahash.hashing``, which it ports). Hash embeddings read precomputed word codes
(``hash_codes`` [b, s, width]); this module computes them exactly as the data stage wrote the side
shards:

* words: lowercase, regex ``\\w+|[^\\w\\s]+`` (HashFormers); special ids <s>=0 <pad>=1 </s>=2 <unk>=3
  <mask>=4 get all-zero codes;
* ``md5``: HMAC-MD5(key, word) bytes (128 bits, MSB first); ``md5-bucketN``: the digest as a
  big-endian integer modulo N;
* ``lshT``: bit j = [x . r_j > 0] over the word's character 1..4-grams (float32 sums in n-gram order),
  ``lsh-bucketN``: argmax over circulant planes; the n-gram vocabulary and planes come from the
  shards' ``PREFIX_lsh.npz`` (copied as ``megahash_lsh.npz``);
* ``rollingN[-lenL]``: polynomial rolling hashes of the word's i-grams (EELBERT);
* sentencepiece streams: the ``word`` hash unit gives a piece the code of the HashFormers word it
  belongs to (groups start at a piece beginning with "\u2581", at the document start and around
  special pieces; the group's text is split with the regex; a piece takes the first word that ends
  after it starts, else "\u2581"); the ``subword`` unit hashes the piece itself (leading "\u2581"
  stripped, lowercased).

``TextCoder.from_pretrained(folder)`` reads ``megahash_hashing.json`` (written by the export) and
the files it names; ``encode(text) -> (ids, words)`` and ``codes(ids, words=None) -> [n, width]``.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
from typing import Optional, Sequence

import numpy as np

SPECIAL_TOKENS = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]
BOS_ID, PAD_ID, EOS_ID, UNK_ID, MASK_ID = 0, 1, 2, 3, 4
NUM_SPECIAL = 5
WORD_RE = re.compile(r"\w+|[^\w\s]+")
SP_SPACE = "\u2581"
NGRAM_ORDERS = (1, 2, 3, 4)
ROLLING_P, ROLLING_M = 31, 1_000_000_007
HASHING_FILE = "megahash_hashing.json"


def split_words(text: str) -> list:
    """Lowercase ``text`` and return its HashFormers words."""
    return WORD_RE.findall(text.lower())


# ----------------------------------------------------------------------------------- hash specs

def parse_spec(name: str) -> dict:
    """``md5``, ``md5-bucketN``, ``lshT``, ``lsh-bucketN``, ``rollingN[-lenL]`` -> {kind, width, dtype, ...}."""
    s = name.strip().lower()
    if s == "md5":
        return {"name": s, "kind": "md5", "width": 16, "dtype": "uint8", "bits": 128}
    m = re.fullmatch(r"(md5|lsh)-bucket([1-9][0-9]*)", s)
    if m:
        return {"name": s, "kind": m.group(1) + "-bucket", "width": 1, "dtype": "int32", "buckets": int(m.group(2))}
    m = re.fullmatch(r"lsh([1-9][0-9]*)", s)
    if m and int(m.group(1)) % 8 == 0:
        t = int(m.group(1))
        return {"name": s, "kind": "lsh", "width": t // 8, "dtype": "uint8", "bits": t}
    m = re.fullmatch(r"rolling([1-9][0-9]*)(?:-len([1-9][0-9]*))?", s)
    if m:
        n, max_len = int(m.group(1)), int(m.group(2) or 16)
        return {"name": s, "kind": "rolling", "width": rolling_width(n, max_len), "dtype": "int32",
                "n": n, "max_len": max_len}
    raise ValueError(f"unknown hash spec {name!r}")


# ----------------------------------------------------------------------------------- MD5

def md5_bits(words: Sequence[str], key: Optional[bytes] = b"en") -> np.ndarray:
    """uint8 [n, 16]: the HMAC-MD5 digest bytes (plain MD5 when key is None)."""
    if key is None:
        buf = b"".join(hashlib.md5(w.encode("utf-8", "surrogatepass")).digest() for w in words)
    else:
        buf = b"".join(hmac.digest(key, w.encode("utf-8", "surrogatepass"), "md5") for w in words)
    return np.frombuffer(buf, dtype=np.uint8).reshape(len(words), 16).copy()


def md5_buckets(words: Sequence[str], num_buckets: int, key: Optional[bytes] = b"en") -> np.ndarray:
    """int64 [n]: the digest as a big-endian integer modulo N."""
    bits = md5_bits(words, key)
    return np.array([int.from_bytes(row.tobytes(), "big") % num_buckets for row in bits], dtype=np.int64)


# ----------------------------------------------------------------------------------- LSH

def word_ngrams(word: str, orders: Sequence[int] = NGRAM_ORDERS) -> list:
    out = []
    for n in orders:
        out.extend(word[i:i + n] for i in range(len(word) - n + 1))
    return out


class LSH:
    """n-gram vocabulary + seeded planes (``PREFIX_lsh.npz`` of the data stage)."""

    def __init__(self, ngrams: Sequence[str], seed: int, orders: Sequence[int] = NGRAM_ORDERS):
        self.ngrams = list(ngrams)
        self.seed = int(seed)
        self.orders = tuple(int(n) for n in orders)
        self.index = {g: i for i, g in enumerate(self.ngrams)}
        self.planes: dict = {}
        self.etas: dict = {}

    @classmethod
    def load(cls, path: str) -> "LSH":
        with np.load(path, allow_pickle=False) as z:
            model = cls([str(g) for g in z["ngrams"]], int(z["seed"]), [int(n) for n in z["orders"]])
            for name in z.files:
                if name.startswith("hyperplanes_"):
                    model.planes[int(name.split("_")[1])] = z[name].astype(np.float32)
                elif name.startswith("eta_"):
                    model.etas[int(name.split("_")[1])] = z[name].astype(np.float32)
        return model

    def hyperplanes(self, num_bits: int) -> np.ndarray:
        if num_bits not in self.planes:
            rng = np.random.Generator(np.random.PCG64(self.seed))
            self.planes[num_bits] = rng.standard_normal((len(self.ngrams), num_bits), dtype=np.float32)
        return self.planes[num_bits]

    def eta(self, num_buckets: int) -> np.ndarray:
        if num_buckets not in self.etas:
            rng = np.random.Generator(np.random.PCG64([self.seed, 1]))
            self.etas[num_buckets] = rng.standard_normal(max(len(self.ngrams), num_buckets), dtype=np.float32)
        return self.etas[num_buckets]

    def ids(self, word: str) -> list:
        """Vocabulary ids of the word's n-gram occurrences in order (out-of-vocabulary ones dropped:
        they add the zero row)."""
        get = self.index.get
        return [i for i in (get(g) for g in word_ngrams(word, self.orders)) if i is not None]

    def bits(self, words: Sequence[str], num_bits: int) -> np.ndarray:
        """uint8 [n, T/8]: bit j = [x . r_j > 0], the dot product a float32 sum in n-gram order."""
        planes = self.hyperplanes(num_bits)
        proj = np.zeros((len(words), num_bits), dtype=np.float32)
        for b, w in enumerate(words):
            acc = proj[b]
            for i in self.ids(w):
                np.add(acc, planes[i], out=acc)
        return np.packbits(proj > 0, axis=1)

    def buckets(self, words: Sequence[str], num_buckets: int) -> np.ndarray:
        """int64 [n]: argmax_b x . r^b with r^b[g] = eta[(g + b + 1) mod L]."""
        eta = self.eta(num_buckets)
        eta2 = np.concatenate([eta, eta])
        out = np.zeros(len(words), dtype=np.int64)
        proj = np.empty(num_buckets, np.float32)
        for b, w in enumerate(words):
            proj.fill(0)
            for j in self.ids(w):
                np.add(proj, eta2[j + 1:j + 1 + num_buckets], out=proj)
            out[b] = int(np.argmax(proj))
        return out


# ----------------------------------------------------------------------------------- rolling

def rolling_partitions(n: int, max_len: int) -> list:
    out, start = [], 0
    for i in range(1, n + 1):
        size = max(0, max_len - i + 1)
        out.append((start, size))
        start += size
    return out


def rolling_width(n: int, max_len: int) -> int:
    return sum(size for _, size in rolling_partitions(n, max_len))


def rolling_codes(words: Sequence[str], n: int, max_len: int) -> np.ndarray:
    """int32 [len(words), width]: i-gram rolling hashes per partition, -1 padded."""
    p, m = ROLLING_P, ROLLING_M
    parts = rolling_partitions(n, max_len)
    out = np.full((len(words), rolling_width(n, max_len)), -1, dtype=np.int32)
    for b, w in enumerate(words):
        cps = [ord(c) for c in w[:max_len]]
        prefix = [0] * (len(cps) + 1)
        for k, c in enumerate(cps):
            prefix[k + 1] = (prefix[k] * p + c) % m
        for i in range(1, n + 1):
            pi = pow(p, i, m)
            values = [(prefix[k + i] - prefix[k] * pi) % m for k in range(len(cps) - i + 1)]
            if values:
                start = parts[i - 1][0]
                out[b, start:start + len(values)] = values
    return out


def hash_words(spec: dict, words: Sequence[str], key: Optional[bytes] = b"en", lsh: Optional[LSH] = None) -> np.ndarray:
    """Code rows [len(words), width] of one spec (no special handling)."""
    kind = spec["kind"]
    if kind in ("lsh", "lsh-bucket") and lsh is None:
        raise ValueError(f"hash spec {spec['name']!r} needs the LSH planes (megahash_lsh.npz)")
    if kind == "md5":
        out = md5_bits(words, key)
    elif kind == "md5-bucket":
        out = md5_buckets(words, spec["buckets"], key)
    elif kind == "lsh":
        out = lsh.bits(words, spec["bits"])
    elif kind == "lsh-bucket":
        out = lsh.buckets(words, spec["buckets"])
    else:
        out = rolling_codes(words, spec["n"], spec["max_len"])
    return np.ascontiguousarray(np.asarray(out).reshape(len(words), spec["width"]), dtype=spec["dtype"])


# ----------------------------------------------------------------------------------- sentencepiece pieces -> words

def subword_string(piece: str) -> str:
    s = piece.lstrip(SP_SPACE).lower()
    return s if s else SP_SPACE


def group_words(pieces: Sequence[str]) -> list:
    """Hash strings of the pieces of one sentencepiece word (``word`` unit)."""
    text = "".join(pieces).replace(SP_SPACE, " ")
    lowered = text.lower()
    if len(lowered) == len(text):
        text = lowered
    spans = [(m.end(), m.group().lower()) for m in WORD_RE.finditer(text)]
    out, pos, k = [], 0, 0
    for p in pieces:
        while k < len(spans) and spans[k][0] <= pos:
            k += 1
        out.append(spans[k][1] if k < len(spans) else SP_SPACE)
        pos += len(p)
    return out


def piece_strings(ids: Sequence[int], pieces: Sequence[str], special: Sequence[bool], unit: str = "word") -> list:
    """Hash string of every token of a sentencepiece id sequence ("" = special: zero code)."""
    out = [""] * len(ids)
    if unit == "subword":
        for t, i in enumerate(ids):
            out[t] = "" if special[i] else subword_string(pieces[i])
        return out
    start = 0
    n = len(ids)
    while start < n:
        i = ids[start]
        if special[i]:
            start += 1
            continue
        end = start + 1
        while end < n and not special[ids[end]] and not pieces[ids[end]].startswith(SP_SPACE):
            end += 1
        out[start:end] = group_words([pieces[j] for j in ids[start:end]])
        start = end
    return out


# ----------------------------------------------------------------------------------- text coder

class TextCoder:
    """Tokenizer + hasher of one exported model (see the module docstring).

    kind "sentencepiece": ``pieces``/``special`` lists of the sentencepiece model (encoding needs
    the ``sentencepiece`` package and ``tokenizer.model``); kind "words": the word table (id -> word).
    ``spec`` None: the model reads no codes."""

    def __init__(self, kind: str, spec: Optional[dict] = None, key: Optional[bytes] = b"en", lsh: Optional[LSH] = None,
                 pieces=None, special=None, unit: str = "word", words=None, sp_model: Optional[str] = None,
                 tokenizer_json: Optional[str] = None):
        self.kind, self.spec, self.key, self.lsh = kind, spec, key, lsh
        self.pieces, self.special, self.unit = pieces, special, unit
        self.words = words
        self.word_index = {w: i for i, w in enumerate(words)} if words is not None else None
        self.sp_model = sp_model
        self.tokenizer_json = tokenizer_json  # kind "hf": the tokenizers file (special strings are text)
        self._sp = None
        self._cache: dict = {}

    @classmethod
    def from_pretrained(cls, folder: str) -> "TextCoder":
        with open(os.path.join(folder, HASHING_FILE), encoding="utf-8") as f:
            meta = json.load(f)
        spec = parse_spec(meta["hash_spec"]) if meta.get("hash_spec") else None
        key = meta.get("md5_key", "en")
        lsh = LSH.load(os.path.join(folder, meta["lsh_file"])) if meta.get("lsh_file") else None
        pieces = special = words = None
        if meta.get("pieces_file"):
            with open(os.path.join(folder, meta["pieces_file"]), encoding="utf-8") as f:
                p = json.load(f)
            pieces, special = p["pieces"], [bool(x) for x in p["special"]]
        if meta.get("words_file"):
            with open(os.path.join(folder, meta["words_file"]), encoding="utf-8") as f:
                words = json.load(f)
        sp_model = os.path.join(folder, meta["sp_model"]) if meta.get("sp_model") else None
        tok_json = os.path.join(folder, meta["tokenizer_json"]) if meta.get("tokenizer_json") else None
        return cls(meta["kind"], spec, None if key is None else key.encode("utf-8"), lsh, pieces, special,
                   meta.get("hash_unit", "word"), words, sp_model, tok_json)

    @property
    def width(self) -> int:
        return self.spec["width"] if self.spec else 0

    # -- text -> ids -------------------------------------------------------------------------
    def encode(self, text: str):
        """(ids, words): token ids of ``text`` and, for word streams, the word of every token."""
        if self.kind == "words":
            ws = split_words(text)
            ids = [UNK_ID if w in SPECIAL_TOKENS else self.word_index.get(w, UNK_ID) for w in ws]
            return ids, ws
        if self.tokenizer_json is not None:
            if self._sp is None:
                from tokenizers import Tokenizer

                self._sp = Tokenizer.from_file(self.tokenizer_json)
                self._sp.encode_special_tokens = True
            return list(self._sp.encode(text, add_special_tokens=False).ids), None
        if self._sp is None:
            import sentencepiece as spm  # only for encoding text; codes of ids need no tokenizer

            self._sp = spm.SentencePieceProcessor(model_file=self.sp_model)
        return list(self._sp.encode(text)), None

    # -- ids -> codes ------------------------------------------------------------------------
    def strings(self, ids: Sequence[int], words: Optional[Sequence[str]] = None) -> list:
        """Hash string of every token ("" for special tokens, which get zero codes)."""
        ids = [int(i) for i in ids]
        if self.kind == "words":
            if words is None:  # generated tokens: the word of the table entry
                words = [self.words[i] if NUM_SPECIAL <= i < len(self.words) else "" for i in ids]
            return [w or "" for w in words]  # unknown words (<unk> ids) keep their own code
        return piece_strings(ids, self.pieces, self.special, self.unit)

    def codes(self, ids: Sequence[int], words: Optional[Sequence[str]] = None) -> Optional[np.ndarray]:
        """Codes [len(ids), width] (dtype of the spec) of a token sequence; None without a spec."""
        if self.spec is None:
            return None
        strings = self.strings(ids, words)
        out = np.zeros((len(strings), self.spec["width"]), dtype=self.spec["dtype"])
        todo = [s for s in dict.fromkeys(strings) if s and s not in self._cache]
        if todo:
            for s, row in zip(todo, hash_words(self.spec, todo, self.key, self.lsh)):
                self._cache[s] = row
        for t, s in enumerate(strings):
            if s:
                out[t] = self._cache[s]
        return out
