"""Raw text -> the token ids and word-hash codes a megahash checkpoint reads.

A checkpoint's resolved config names its data (``data.prefix``) and tokenizer (``data.tokenizer``);
the data stage wrote ``PREFIX_meta.json`` beside the shards with the tokenizer path, the stream
kind (sentencepiece subwords or vocabulary-free words), the hash unit and, per hash spec, the MD5
key or LSH seed; LSH specs also need ``PREFIX_lsh.npz`` (n-gram vocabulary and planes) and word
streams ``PREFIX_words.tsv`` (id -> word). :func:`load_codec` reads all of that, so evaluation
hashes text exactly as the shards were hashed:

- subword streams: ids of the run's tokenizer (:func:`megahash.tokenization.load_tokenizer`, any
  kind, as the data stage encodes); codes via :class:`megahash.hashing.SubwordCoder` over the
  whole token sequence (the ``word`` hash unit gives every piece the code of the HashFormers word
  it belongs to, so a code can depend on the neighbouring pieces);
- word streams (``data.tokenizer=words``): ``split_words`` (lowercase, ``\\w+|[^\\w\\s]+``); ids from
  the word table (:class:`megahash.tokenization.WordTable`; unknown words -> ``<unk>`` = 3), codes
  from the word strings themselves, so a hash embedding still sees unseen words as themselves;
- special tokens (the ``</s>`` = 2 prefix that stands for "start of a document", padding ``<pad>``
  = 1) get all-zero codes, as in the shards.

Codes are only computed when the model reads them (``model.embedding`` other than ``vocab``, or a
hash-code head); their spec is ``model.embed.hash_spec``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from megahash.data.verify import base_prefix, check_listed_file, read_meta
from megahash.errors import CheckpointError, ConfigError, DataError

BOS_ID, PAD_ID, EOS_ID, UNK_ID = 0, 1, 2, 3
NUM_SPECIAL = 5


@dataclass
class Encoded:
    """Token ids (and, for word streams, the word string of every token)."""

    ids: list[int]
    words: list[str] | None = None

    def __len__(self) -> int:
        return len(self.ids)

    def __add__(self, other: Encoded) -> Encoded:
        words = None if self.words is None or other.words is None else self.words + other.words
        return Encoded(self.ids + other.ids, words)

    def __getitem__(self, sl: slice) -> Encoded:
        return Encoded(self.ids[sl], None if self.words is None else self.words[sl])


def first_prefix(prefixes: Sequence[str]) -> str | None:
    """The first shard prefix of ``data.prefix`` (entries may be ``"weight prefix"`` pairs or a
    flat ``[w1, p1, w2, p2]`` list)."""
    for entry in prefixes or []:
        parts = str(entry).split()
        for p in parts:
            try:
                float(p)
            except ValueError:
                return p
    return None


def needs_codes(cfg) -> bool:
    """True when the model reads word-hash codes (hash embedding or hash-code head); the registry's
    capability (:func:`megahash.catalog.reads_hash_codes`) is the one owner of the fact."""
    from megahash import catalog

    return catalog.reads_hash_codes(cfg)


@dataclass
class TextCodec:
    """Tokenizer + hasher of one checkpoint (see the module docstring)."""

    kind: str  # "sentencepiece" | "hf" | "words"
    vocab_size: int  # real (unpadded) vocabulary: pieces, or the word table size
    sp: object = None  # megahash.tokenization.MegahashTokenizer (any subword kind)
    word_list: list[str] | None = None
    spec: object = None  # HashSpec or None
    table: object = None  # CodeTable or None
    coder: object = None  # SubwordCoder or None
    description: dict = field(default_factory=dict)

    def __post_init__(self):
        self.word_table = self.word_index = None
        if self.word_list:
            from megahash.tokenization import WordTable

            self.word_table = WordTable(self.word_list)
            self.word_index = self.word_table.index  # word -> id (specials excluded)
        if self.sp is not None:
            self.special_ids = dict(self.sp.special_ids)
            self.eos_id = self.sp.eos_id  # None: a tokenizer without one (generation then stops at no id)
            self.pad_id = self.sp.pad_id
            self.special_flags = np.asarray(self.sp.special_flags, dtype=bool)
        else:
            self.special_ids = {"bos": BOS_ID, "pad": PAD_ID, "eos": EOS_ID, "unk": UNK_ID, "mask": 4}
            self.eos_id, self.pad_id = EOS_ID, PAD_ID
            self.special_flags = None

    # ------------------------------------------------------------------ text <-> tokens
    def encode(self, text: str) -> Encoded:
        if self.kind == "words":
            words = self.word_table.split(text)
            return Encoded(self.word_table.ids(words), words)
        return Encoded(list(self.sp.encode(text)))

    def decode(self, ids: Sequence[int]) -> str:
        if self.kind == "words":
            return " ".join(self.word_list[i] for i in ids if NUM_SPECIAL <= i < len(self.word_list))
        return self.sp.decode([int(i) for i in ids if 0 <= i < self.vocab_size])

    def is_special(self, token_id: int) -> bool:
        if self.special_flags is None:
            return token_id < NUM_SPECIAL
        return 0 <= token_id < len(self.special_flags) and bool(self.special_flags[token_id])

    def prefix(self) -> Encoded:
        """What a text is conditioned on before its first token: the document separator the shards put between
        documents (eos), else the tokenizer's bos, else nothing, so that the first token of a text is context
        only and scored tokens start at the second (a tokenizer without specials; lm-eval's ``hf`` model takes
        bos, then eos, and fails without either). Before, id 2 was taken, an ordinary piece of such a tokenizer."""
        for role in ("eos", "bos"):
            if self.special_ids.get(role) is not None:
                return self.special(self.special_ids[role])
        return Encoded([], None if self.kind != "words" else [])

    def special(self, token_id: int, n: int = 1) -> Encoded:
        """``n`` copies of a special token (zero codes)."""
        return Encoded([token_id] * n, None if self.kind != "words" else [""] * n)

    def token_word(self, token_id: int) -> str:
        """Word string of a generated word-stream token ("" for specials)."""
        if self.kind != "words" or token_id < NUM_SPECIAL or token_id >= len(self.word_list):
            return ""
        return self.word_list[token_id]

    # ------------------------------------------------------------------ hash codes
    @property
    def code_width(self) -> int:
        return self.spec.width if self.spec is not None else 0

    def codes(self, enc: Encoded) -> np.ndarray | None:
        """Codes [n, width] of a token sequence (None when the model reads none). Special ids
        (< 5) get zero codes."""
        if self.spec is None:
            return None
        ids = np.asarray(enc.ids, dtype=np.int64)
        if len(ids) == 0:
            return np.zeros((0, self.spec.width), self.spec.dtype)
        self.table.maybe_reset()
        if self.kind == "words":
            words = enc.words if enc.words is not None else [self.token_word(int(i)) for i in ids]
            rows = np.zeros(len(ids), np.int64)
            real = [i for i, w in enumerate(words) if w]
            if real:
                rows[real] = self.table.lookup([words[i] for i in real])
        else:
            rows = self.coder.row_ids(ids, [0])
            rows[self.coder.special[np.clip(ids, 0, len(self.coder.special) - 1)] | (ids < 0)] = 0
        return self.table.rows(self.spec.name, rows)


def load_codec(
    cfg, ckpt_dir: Path | None = None, tokenizer: str | None = None, model_vocab: int | None = None
) -> TextCodec:
    """The :class:`TextCodec` of a checkpoint's config (``tokenizer`` overrides ``data.tokenizer``)."""
    prefix = first_prefix(cfg.data.prefix)
    meta = read_meta(prefix, required=False)
    tok = tokenizer or cfg.data.tokenizer or (meta.get("tokenizer") or {}).get("path") or ""
    if not tok and (meta.get("stream") or {}).get("kind") == "words":
        tok = "words"
    desc = {"tokenizer": tok, "prefix": prefix, "meta": bool(meta)}
    word_list = sp = None
    if tok == "words":
        kind = "words"
        name = (meta.get("stream") or {}).get("word_table")
        if not prefix or not name:
            raise DataError(
                f"a word-stream checkpoint needs its word table (PREFIX_words.tsv beside data.prefix "
                f"{prefix!r}); none found"
            )
        path = os.path.join(os.path.dirname(base_prefix(prefix)), name)
        if not os.path.isfile(path):
            raise DataError(f"word table {path} not found (written by data_tools/preprocess_data.py --tokenizer words)")
        from megahash.data.shards import read_word_table

        word_list = read_word_table(path)
        vocab = len(word_list)
        desc["word_table"] = path
    else:
        if not tok:
            raise ConfigError("the checkpoint's config names no tokenizer (data.tokenizer); pass --tokenizer")
        from megahash.tokenization import TokenizerError, load_tokenizer

        bases = [] if ckpt_dir is None else [ckpt_dir.parent, ckpt_dir]
        try:
            sp = load_tokenizer(tok, bases)
        except TokenizerError as e:
            if str(e).startswith("tokenizer not found"):
                raise DataError(
                    f"tokenizer model {tok!r} not found; pass --tokenizer PATH (a sentencepiece .model, "
                    f"tokenizer.json, Hugging Face tokenizer folder or name)"
                ) from None
            raise DataError(f"{e}; pass --tokenizer PATH") from None
        kind, vocab = sp.kind, sp.vocab_size
        trained = {r: i for r, i in (cfg.data.special_ids or {}).items() if i is not None}
        theirs = {r: sp.special_ids.get(r) for r in trained}
        if tokenizer and theirs != trained:  # --tokenizer: the checkpoint's ids (data.special_ids) mean other tokens
            raise CheckpointError(
                f"tokenizer {sp.path} has special ids {theirs}, the checkpoint was trained with {trained}: "
                f"it is not the run's tokenizer; pass the tokenizer the run was trained with (data.tokenizer)"
            )
        desc["tokenizer"] = sp.path
        desc["tokenizer_kind"] = sp.kind
    if model_vocab is not None and vocab > model_vocab:
        raise CheckpointError(
            f"the tokenizer has {vocab} entries but the checkpoint's vocabulary has {model_vocab}: "
            f"checkpoint and tokenizer/config do not match"
        )
    spec = table = coder = None
    if needs_codes(cfg):
        from megahash.hashing.codes import CodeTable
        from megahash.hashing.specs import parse_hash_spec

        try:
            spec = parse_hash_spec(cfg.model.embed.hash_spec)
        except ValueError as e:
            raise ConfigError(f"model.embed.hash_spec: {e}") from None
        entry = next((s for s in meta.get("hash_specs", []) if s.get("name") == spec.name), {})
        key = str(entry.get("key", "en")).encode("utf-8")
        lsh = None
        if spec.kind in ("lsh", "lsh-bucket"):
            info = meta.get("lsh") or {}
            if not prefix or not info.get("file"):
                raise DataError(
                    f"hash spec {spec.name} needs the LSH planes of the shards (PREFIX_lsh.npz and PREFIX_meta.json "
                    f"beside data.prefix {prefix!r})"
                )
            from megahash.hashing.lsh import LSHModel

            lsh_path = os.path.join(os.path.dirname(base_prefix(prefix)), info["file"])
            if not os.path.isfile(lsh_path):
                raise DataError(f"LSH planes {lsh_path} not found")
            # the planes the side shards were hashed with: another build's (same name, other corpus) or a damaged
            # file would give every word other codes than the model trained on, with no error
            check_listed_file(prefix, meta, info["file"], checksums=True)
            try:
                lsh = LSHModel.load(lsh_path)
            except ValueError as e:
                raise DataError(f"{e}; rebuild the set with data_tools/preprocess_data.py --overwrite") from None
            desc["lsh"] = lsh_path
        table = CodeTable([spec], key=key, lsh=lsh)
        if kind != "words":
            from megahash.hashing.tokens import SubwordCoder

            unit = (meta.get("stream") or {}).get("hash_unit", "word")
            coder = SubwordCoder(sp, table, unit)
            desc["hash_unit"] = unit
        desc.update({"hash_spec": spec.name, "md5_key": key.decode("utf-8", "replace")})
    return TextCodec(kind, vocab, sp=sp, word_list=word_list, spec=spec, table=table, coder=coder, description=desc)


def load_model(path, overrides: list[str] | None = None, weights: str = "live"):
    """:func:`megahash.checkpoint.weights.load_for_inference` (one-line CheckpointError on bad weights);
    ``weights``: live, ema or a quantized artifact's path (``load_chosen``)."""
    from megahash.checkpoint.weights import load_for_inference

    return load_for_inference(path, list(overrides or []), weights=weights)
