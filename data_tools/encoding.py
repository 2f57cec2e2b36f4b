"""Worker side of preprocessing: a chunk of documents -> token ids + code rows per hash spec.

One ``ChunkEncoder`` lives in each worker process (or in the main process with ``--workers 1``)
and keeps its ``CodeTable`` cache across chunks, so each distinct word is hashed about once per
worker. Outputs depend only on the documents, never on chunking or worker count: codes are pure
functions of strings, and word-table ids are assigned by the main process in document order.
"""
from __future__ import annotations

import os
from collections import Counter
from itertools import chain
from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np

from data_tools.common import InputError, sha256_file
from megahash.hashing.codes import ZERO_ROW, CodeTable
from megahash.hashing.lsh import LSHModel
from megahash.hashing.specs import HashSpec
from megahash.hashing.tokens import SubwordCoder
from megahash.hashing.words import EOS_ID, SPECIAL_TOKENS, WORD_RE, split_words

WORDS = "words"


@dataclass
class TokenizerInfo:
    """What the meta records about the tokenizer."""

    kind: str  # "sentencepiece" | "words"
    path: Optional[str]
    sha256: Optional[str]
    vocab_size: Optional[int]  # None for words: known only at the end

    def to_meta(self) -> dict:
        ids = {name: i for i, name in enumerate(["bos", "pad", "eos", "unk", "mask"])}
        return {"kind": self.kind, "path": self.path, "sha256": self.sha256, "vocab_size": self.vocab_size,
                "special_ids": ids, "special_tokens": list(SPECIAL_TOKENS)}


def load_sentencepiece(path: str):
    """``SentencePieceProcessor`` for ``path`` (one-line error if missing/corrupt)."""
    import sentencepiece as spm

    try:
        return spm.SentencePieceProcessor(model_file=path)
    except (OSError, RuntimeError) as e:
        raise InputError(f"cannot load sentencepiece model {path!r}: {str(e).splitlines()[0] if str(e) else e}") from None


def resolve_tokenizer(spec: str) -> TokenizerInfo:
    """``words`` or a sentencepiece model path (``PREFIX`` or ``PREFIX.model``)."""
    if spec == WORDS:
        return TokenizerInfo(WORDS, None, None, None)
    path = spec if os.path.isfile(spec) or spec.endswith(".model") else spec + ".model"
    if not os.path.isfile(path):
        raise InputError(f"tokenizer not found: {spec!r} (give a sentencepiece .model file or 'words')")
    sp = load_sentencepiece(path)
    return TokenizerInfo("sentencepiece", spec, sha256_file(path), sp.get_piece_size())


@dataclass
class EncoderConfig:
    """Everything a worker needs (picklable)."""

    tokenizer: str  # "words" or a .model path
    specs: list[HashSpec]
    hash_unit: str = "word"
    append_eos: bool = True
    key: Optional[bytes] = b"en"
    token_dtype: str = "uint16"
    cache_entries: int = 1 << 21
    encode_threads: int = 1


@dataclass
class ChunkResult:
    """Encoded chunk. Words streams carry local ids and the chunk's distinct words (local id 0 is EOS)."""

    lengths: np.ndarray  # tokens per kept document (incl. EOS)
    tokens: np.ndarray  # token ids (sentencepiece) or local word ids (words)
    codes: dict[str, np.ndarray] = field(default_factory=dict)  # spec name -> [tokens, width]
    words: Optional[list[str]] = None
    empty: int = 0  # documents with no tokens (skipped)


class ChunkEncoder:
    """Tokenise a chunk of documents and hash its tokens (see module docstring)."""

    def __init__(self, cfg: EncoderConfig, lsh: Optional[LSHModel] = None):
        self.cfg = cfg
        self.table = CodeTable(cfg.specs, key=cfg.key, lsh=lsh, max_entries=cfg.cache_entries)
        self.sp = None
        if cfg.tokenizer != WORDS:
            path = cfg.tokenizer if os.path.isfile(cfg.tokenizer) else cfg.tokenizer + ".model"
            self.sp = load_sentencepiece(path)
            self.coder = SubwordCoder(self.sp, self.table, cfg.hash_unit)
        self.token_dtype = np.dtype(cfg.token_dtype)

    def encode(self, docs: Sequence[str]) -> ChunkResult:
        self.table.maybe_reset()
        return self._encode_words(docs) if self.sp is None else self._encode_subwords(docs)

    def _codes(self, row_ids: np.ndarray) -> dict[str, np.ndarray]:
        return {s.name: self.table.rows(s.name, row_ids) for s in self.cfg.specs}

    def _encode_subwords(self, docs: Sequence[str]) -> ChunkResult:
        id_lists = self.sp.encode(list(docs), num_threads=self.cfg.encode_threads)
        eos = [EOS_ID] if self.cfg.append_eos else []
        kept = [ids + eos for ids in id_lists if ids]
        lengths = np.fromiter((len(x) for x in kept), dtype=np.int64, count=len(kept))
        tokens = np.fromiter(chain.from_iterable(kept), dtype=np.int64, count=int(lengths.sum()))
        starts = np.zeros(len(kept), np.int64)
        np.cumsum(lengths[:-1], out=starts[1:])
        codes = self._codes(self.coder.row_ids(tokens, starts)) if self.cfg.specs else {}
        return ChunkResult(lengths, tokens.astype(self.token_dtype), codes, empty=len(id_lists) - len(kept))

    def _encode_words(self, docs: Sequence[str]) -> ChunkResult:
        local: dict[str, int] = {SPECIAL_TOKENS[EOS_ID]: 0}  # split_words never yields "</s>"
        ids: list[int] = []
        lengths: list[int] = []
        eos = self.cfg.append_eos
        empty = 0
        for doc in docs:
            words = split_words(doc)
            if not words:
                empty += 1
                continue
            ids.extend([local.setdefault(w, len(local)) for w in words])
            if eos:
                ids.append(0)
            lengths.append(len(words) + eos)
        uniq = list(local)
        local_ids = np.array(ids, dtype=np.int32)
        codes = {}
        if self.cfg.specs:
            rows = np.empty(len(uniq), np.int64)
            rows[0] = ZERO_ROW
            rows[1:] = self.table.lookup(uniq[1:])
            codes = self._codes(rows[local_ids])
        return ChunkResult(np.array(lengths, np.int64), local_ids, codes, words=uniq, empty=empty)


def count_words(docs: Sequence[str]) -> Counter:
    """HashFormers word counts of a chunk (first pass for the LSH n-gram vocabulary). Same result
    as counting ``split_words(doc)``: the regex never matches across whitespace, so whitespace
    tokens are counted first (in C) and each distinct one is split once."""
    tokens: Counter = Counter()
    for doc in docs:
        tokens.update(doc.lower().split())
    words: Counter = Counter()
    for tok, n in tokens.items():
        if tok.isalnum():  # one \w+ word
            words[tok] += n
        else:
            for w in WORD_RE.findall(tok):
                words[w] += n
    return words
