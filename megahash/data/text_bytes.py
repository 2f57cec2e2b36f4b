"""Bits per byte: the UTF-8 bytes of the text a token loss is computed over, counted per token.

    bpb = sum of token NLL (nats) / (ln 2 * bytes)                       (lm-eval's ``bits_per_byte``)

lm-eval (``lm_eval/api/metrics.py``: ``bits_per_byte(items) = -weighted_mean(items) / log(2)``, items
(loglikelihood, bytes); ``ConfigurableTask.process_results`` of ``loglikelihood_rolling`` tasks counts
``len(doc.encode("utf-8"))`` of the document text) divides a document's log-likelihood by the bytes of
its text. A validation sequence cuts documents anywhere, so megahash counts the bytes per predicted
token: the bytes each label token adds to the detokenized text (:class:`TokenBytes`). Over a whole
document this is ``len(text.encode())`` whenever the tokenizer is lossless (``decode(encode(text)) ==
text``, megahash's default tokenizer and byte-level BPE): special ids (the data stage's end-of-document
separators; special-token strings in a text are ordinary pieces, megahash.tokenization) add no bytes,
byte pieces ``<0xNN>`` one, and the space a sentencepiece-style tokenizer puts before a document's first
piece (``add_dummy_prefix``) is not counted after a special id. A lossy tokenizer (NFKC) counts the
normalised text's bytes; word streams (``data.tokenizer=words``) have no text to count: no bpb.
"""

from __future__ import annotations

import math
import sys

import numpy as np

SP_SPACE = "\u2581"


def bits_per_byte(nll_nats: float, n_bytes: float) -> float:
    """bpb = NLL / (ln 2 * bytes) (lm-eval's ``bits_per_byte``); nan without bytes."""
    return nll_nats / (math.log(2) * n_bytes) if n_bytes > 0 else float("nan")


def perplexity(loss_nats: float) -> float | None:
    """exp(mean token loss); None past a float's range (an overflowing or nan loss: JSON has no infinity)."""
    return math.exp(loss_nats) if loss_nats < math.log(sys.float_info.max) else None


def _piece_bytes(piece: str) -> bytes:
    return piece.replace(SP_SPACE, " ").encode("utf-8")


def _sentencepiece_table(tok) -> tuple[np.ndarray, np.ndarray]:
    sp = tok.sp
    n = tok.vocab_size
    size, space = np.zeros(n, np.int64), np.zeros(n, bool)
    for i in range(n):
        if sp.is_byte(i):
            size[i] = 1
            space[i] = sp.id_to_piece(i) == "<0x20>"
        elif not (sp.is_control(i) or sp.is_unknown(i) or sp.is_unused(i)):
            raw = _piece_bytes(sp.id_to_piece(i))
            size[i], space[i] = len(raw), raw[:1] == b" "
    return size, space


def _hf_table(tok) -> tuple[np.ndarray, np.ndarray]:
    from megahash.tokenization import _byte_decoder, _types

    n = tok.vocab_size
    size, space = np.zeros(n, np.int64), np.zeros(n, bool)
    added = {int(a["id"]): a for a in tok.json.get("added_tokens") or []}
    byte_level = "ByteLevel" in _types(tok.json.get("pre_tokenizer")) | _types(tok.json.get("decoder"))
    wordpiece = (tok.json.get("model") or {}).get("type") == "WordPiece"
    bd = _byte_decoder()
    for i, t in enumerate(tok.piece_names):
        if not t or tok.special_flags[i] and not (t.startswith("<0x") and len(t) == 6):
            continue
        if i in added:
            raw = added[i]["content"].encode("utf-8")
        elif byte_level:
            raw = bytes(bd.get(c, 0x3F) for c in t)
        elif t.startswith("<0x") and len(t) == 6 and t.endswith(">"):
            raw = bytes([int(t[3:5], 16)])
        elif wordpiece:  # lossy: "##x" continues a word, any other piece starts one after a space
            raw = t[2:].encode("utf-8") if t.startswith("##") else b" " + t.encode("utf-8")
        else:
            raw = _piece_bytes(t)
        size[i], space[i] = len(raw), raw[:1] == b" "
    return size, space


class TokenBytes:
    """Bytes per token id of a subword tokenizer (:mod:`megahash.tokenization`; module docstring)."""

    def __init__(self, tok):
        self.size, self.space = (_sentencepiece_table if tok.kind == "sentencepiece" else _hf_table)(tok)
        self.special = np.asarray(tok.special_flags, bool).copy()
        self.special &= self.size == 0  # byte pieces are flagged special for hashing, but are text
        probe = tok.encode("a")  # a tokenizer that adds a space before a text's first piece spells "a" as " a"
        self.dummy = int(self.size[probe].sum()) == 2
        self._torch = None

    def count(self, ids) -> int:
        """UTF-8 bytes of a text encoded alone (its first token starts a document)."""
        ids = np.asarray(ids, np.int64)
        if not len(ids):
            return 0
        prev = np.concatenate([[True], self.special[ids[:-1]]])
        return int(self.size[ids].sum() - (self.dummy & self.space[ids] & prev).sum())

    def label_bytes(self, tokens, labels):
        """Bytes per position of a batch (torch): what label ``t`` adds to the text after input ``t``."""
        import torch

        if self._torch is None or self._torch[0].device != labels.device:
            self._torch = tuple(torch.as_tensor(a, device=labels.device) for a in (self.size, self.space, self.special))
        size, space, special = self._torch
        n = size.numel()
        lab, inp = labels.clamp(0, n - 1), tokens.clamp(0, n - 1)
        out = size[lab]
        if self.dummy:
            out = out - (space[lab] & special[inp]).long()
        return out


def token_bytes_for(cfg, meta: dict | None = None) -> TokenBytes | None:
    """The :class:`TokenBytes` of a run's tokenizer (``data.tokenizer``, else the shard meta's); None for a
    word stream or when no tokenizer can be loaded (no bits per byte then)."""
    from megahash.errors import DataError
    from megahash.tokenization import WORDS, load_tokenizer

    meta = meta or {}
    made = meta.get("tokenizer") or {}
    spec = cfg.data.tokenizer or made.get("path") or ""
    if not spec or spec == WORDS:
        return None
    try:
        return TokenBytes(load_tokenizer(spec))
    except DataError:
        return None
