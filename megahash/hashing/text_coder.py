"""Raw text -> the token ids and word-hash codes a megahash model reads (numpy only; no torch).

The text side of a Hugging Face folder written by ``megahash export-hf``: copied there as
``hashing_megahash.py`` together with the rest of :mod:`megahash.hashing` (verbatim, imports made
relative by :mod:`megahash.convert.remote_code`), so the folder hashes with the data stage's own code.
Hash embeddings read precomputed word codes (``hash_codes`` [b, s, width]); this module computes
them exactly as the data stage wrote the side shards:

* word streams: the HashFormers words (:func:`megahash.hashing.words.split_words`); special ids get
  all-zero codes;
* sentencepiece streams: the ``word`` hash unit gives a piece the code of the HashFormers word it
  belongs to (:func:`megahash.hashing.tokens.group_words`; groups start at a piece beginning with
  "\u2581", at the document start and around special pieces); the ``subword`` unit hashes the piece
  itself (:func:`megahash.hashing.tokens.subword_string`);
* the codes of a hash spec: :func:`megahash.hashing.codes.hash_words` (md5, md5-bucketN, lshT with
  the shards' ``PREFIX_lsh.npz`` copied as ``megahash_lsh.npz``, lsh-bucketN, rollingN).

``TextCoder.from_pretrained(folder)`` reads ``megahash_hashing.json`` (written by the export) and
the files it names; ``encode(text) -> (ids, words)`` and ``codes(ids, words=None) -> [n, width]``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

import numpy as np

from megahash.hashing.codes import hash_words
from megahash.hashing.lsh import LSHModel
from megahash.hashing.specs import HashSpec, parse_hash_spec
from megahash.hashing.tokens import SP_SPACE, group_words, subword_string
from megahash.hashing.words import NUM_SPECIAL, SPECIAL_TOKENS, UNK_ID, split_words

HASHING_FILE = "megahash_hashing.json"


# ----------------------------------------------------------------------------------- sentencepiece pieces -> words


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

    def __init__(
        self,
        kind: str,
        spec: HashSpec | None = None,
        key: bytes | None = b"en",
        lsh: LSHModel | None = None,
        pieces=None,
        special=None,
        unit: str = "word",
        words=None,
        sp_model: str | None = None,
        tokenizer_json: str | None = None,
    ):
        self.kind, self.spec, self.key, self.lsh = kind, spec, key, lsh
        self.pieces, self.special, self.unit = pieces, special, unit
        self.words = words
        self.word_index = {w: i for i, w in enumerate(words)} if words is not None else None
        self.sp_model = sp_model
        self.tokenizer_json = tokenizer_json  # kind "hf": the tokenizers file (special strings are text)
        self._sp = None
        self._cache: dict = {}
        self.files: tuple = (None, [])  # (folder, file names) of from_pretrained: what save_pretrained copies

    @classmethod
    def from_pretrained(cls, folder: str) -> TextCoder:
        with open(os.path.join(folder, HASHING_FILE), encoding="utf-8") as f:
            meta = json.load(f)
        spec = parse_hash_spec(meta["hash_spec"]) if meta.get("hash_spec") else None
        key = meta.get("md5_key", "en")
        lsh = LSHModel.load(os.path.join(folder, meta["lsh_file"])) if meta.get("lsh_file") else None
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
        coder = cls(
            meta["kind"],
            spec,
            None if key is None else key.encode("utf-8"),
            lsh,
            pieces,
            special,
            meta.get("hash_unit", "word"),
            words,
            sp_model,
            tok_json,
        )
        names = ("lsh_file", "pieces_file", "words_file", "sp_model", "tokenizer_json")
        coder.files = (str(folder), [HASHING_FILE, *(meta[k] for k in names if meta.get(k))])
        return coder

    def save_pretrained(self, folder: str) -> list:
        """Copy the files this coder was read from (``megahash_hashing.json`` and the files it names) into
        ``folder``, so that ``TextCoder.from_pretrained(folder)`` reads the same coder; the names copied."""
        source, names = self.files
        if source is None:
            raise ValueError("this TextCoder was not read from a folder (TextCoder.from_pretrained): nothing to copy")
        os.makedirs(folder, exist_ok=True)
        for name in names:
            src, dst = os.path.join(source, name), os.path.join(folder, name)
            if os.path.abspath(src) != os.path.abspath(dst):
                with open(src, "rb") as f_in, open(dst, "wb") as f_out:
                    f_out.write(f_in.read())
        return list(names)

    @property
    def width(self) -> int:
        return self.spec.width if self.spec else 0

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
    def strings(self, ids: Sequence[int], words: Sequence[str] | None = None) -> list:
        """Hash string of every token ("" for special tokens, which get zero codes)."""
        ids = [int(i) for i in ids]
        if self.kind == "words":
            if words is None:  # generated tokens: the word of the table entry
                words = [self.words[i] if NUM_SPECIAL <= i < len(self.words) else "" for i in ids]
            return [w or "" for w in words]  # unknown words (<unk> ids) keep their own code
        return piece_strings(ids, self.pieces, self.special, self.unit)

    def codes(self, ids: Sequence[int], words: Sequence[str] | None = None) -> np.ndarray | None:
        """Codes [len(ids), width] (dtype of the spec) of a token sequence; None without a spec."""
        if self.spec is None:
            return None
        strings = self.strings(ids, words)
        out = np.zeros((len(strings), self.spec.width), dtype=self.spec.dtype)
        todo = [s for s in dict.fromkeys(strings) if s and s not in self._cache]
        if todo:
            for s, row in zip(todo, hash_words(self.spec, todo, self.key, self.lsh)):
                self._cache[s] = row
        for t, s in enumerate(strings):
            if s:
                out[t] = self._cache[s]
        return out
