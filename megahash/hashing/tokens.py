"""Which string a token's code hashes: token streams -> ``CodeTable`` row ids.

Vocabulary-free word streams (``word_stream_row_ids``): a token is a HashFormers word; its code is the
hash of that word.

Sentencepiece subword streams (``SubwordCoder``), two hash units:

* ``subword``: the hash of the piece itself, leading "▁" stripped, lowercased ("▁" alone hashes as "▁").
* ``word`` (default): the hash of the HashFormers word the piece belongs to, so every piece of
  "▁play" "ing" gets the code of "playing". Pieces are grouped into sentencepiece words (a group
  starts at a piece beginning with "▁", at a document start, and around special pieces); the
  group's text ("▁" read as a space) is split with ``\\w+|[^\\w\\s]+``; a piece takes the first word
  overlapping its characters, a whitespace-only piece the next word of the group (else "▁"), and
  the word is lowercased. A group "▁hello" "," thus gives "hello" and ",".

Special pieces (control, unknown, byte-fallback, unused, and the five specials ``<s> <pad> </s>
<unk> <mask>``) get the all-zero row 0 and are groups of their own.

Implementation: when every piece of a group is a space piece, a word piece (``\\w+`` after the
"▁") or a punctuation piece (``[^\\w\\s]+``) -- all pieces of usual sentencepiece models, which
split at script boundaries -- the rule above is the same as taking runs of same-kind pieces (a
space piece joins the run after it), so words are found with vectorised numpy over the token ids
and only distinct multi-piece runs are turned into strings. Groups with other pieces go through
the regex (``group_words``). Both caches are keyed by piece ids, so each distinct run/group is
analysed once per worker (until the ``CodeTable`` is cleared).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import numpy as np

from megahash.hashing.codes import ZERO_ROW, CodeTable
from megahash.hashing.words import NUM_SPECIAL, SPECIAL_TOKENS, WORD_RE

SP_SPACE = "\u2581"
HASH_UNITS = ("word", "subword")


def subword_string(piece: str) -> str:
    """Hash string of a piece under the ``subword`` unit."""
    s = piece.lstrip(SP_SPACE).lower()
    return s if s else SP_SPACE


def group_words(pieces: Sequence[str]) -> list[str]:
    """Hash strings of the pieces of one sentencepiece word under the ``word`` unit: each piece
    takes the first word of the group's text that ends after the piece starts (a word overlapping
    the piece, else the next one), or "▁" if there is none."""
    return group_words_many([pieces])[0]


def group_words_many(groups: Sequence[Sequence[str]]) -> list[list[str]]:
    """``group_words`` of many groups with one regex pass over their texts joined by newlines."""
    texts = ["".join(p).replace(SP_SPACE, " ") for p in groups]
    text = "\n".join(texts)  # a newline is whitespace: no word crosses two groups
    lowered = text.lower()
    if len(lowered) != len(text):  # lowercasing moved offsets somewhere: do groups one by one
        return [_group_words_one(p) for p in groups]
    spans = [(m.start(), m.end(), m.group()) for m in WORD_RE.finditer(lowered)]
    out, pos, k, n = [], 0, 0, len(spans)
    for pieces, t in zip(groups, texts):
        end = pos + len(t)
        words = []
        for p in pieces:
            while k < n and spans[k][1] <= pos:
                k += 1
            words.append(spans[k][2] if k < n and spans[k][0] < end else SP_SPACE)
            pos += len(p)
        out.append(words)
        pos = end + 1
    return out


def _group_words_one(pieces: Sequence[str]) -> list[str]:
    text = "".join(pieces).replace(SP_SPACE, " ")
    lowered = text.lower()
    if len(lowered) == len(text):
        text = lowered
    spans = [(m.end(), m.group().lower()) for m in WORD_RE.finditer(text)]
    out, pos, k, n = [], 0, 0, len(spans)
    for p in pieces:
        while k < n and spans[k][0] <= pos:
            k += 1
        out.append(spans[k][1] if k < n else SP_SPACE)
        pos += len(p)
    return out


def row_hash(keys: np.ndarray) -> np.ndarray:
    """FNV-style 64-bit hash of each row of an int64 matrix (wrapping arithmetic)."""
    h = np.zeros(len(keys), np.uint64)
    for c in range(keys.shape[1]):
        h = h * np.uint64(0x100000001B3) ^ keys[:, c].astype(np.uint64)
    return h


_SPACE, _WORD, _PUNCT, _MIXED, _SPECIAL = 0, 1, 2, 3, 4
MAX_CACHED_PIECES = 16  # runs/groups of more pieces are not cached (SubwordCoder._multi_rows)
_W_RE = re.compile(r"\w+")
_P_RE = re.compile(r"[^\w\s]+")


def _piece_class(body: str) -> int:
    if not body:
        return _SPACE
    if _W_RE.fullmatch(body):
        return _WORD
    if _P_RE.fullmatch(body):
        return _PUNCT
    return _MIXED


class SubwordCoder:
    """Row ids for subword token ids (``sp``: a ``SentencePieceProcessor``, or any
    :class:`megahash.tokenization.MegahashTokenizer`, whose ``hash_pieces`` spell every token in
    sentencepiece style: byte-level BPE's "Ġ" or WordPiece's missing "##" become a leading "▁")."""

    def __init__(self, sp, table: CodeTable, unit: str = "word"):
        if unit not in HASH_UNITS:
            raise ValueError(f"hash unit must be one of {HASH_UNITS}, got {unit!r}")
        self.table, self.unit = table, unit
        if hasattr(sp, "hash_pieces"):  # a megahash.tokenization tokenizer (any kind): its pieces and specials
            self.pieces = list(sp.hash_pieces)
            special = np.asarray(sp.special_flags, dtype=bool).tolist()
            if getattr(sp, "kind", "") == "sentencepiece":
                special = [f or p in SPECIAL_TOKENS for f, p in zip(special, self.pieces)]
        else:
            size = sp.get_piece_size()
            self.pieces = [sp.id_to_piece(i) for i in range(size)]
            special = [
                sp.is_control(i)
                or sp.is_unknown(i)
                or sp.is_unused(i)
                or sp.is_byte(i)
                or self.pieces[i] in SPECIAL_TOKENS
                for i in range(size)
            ]
        self.special = np.array(special, dtype=bool)
        self.starts = self.special | np.array([p.startswith(SP_SPACE) for p in self.pieces], dtype=bool)
        self.bodies = [p.replace(SP_SPACE, " ").lstrip(" ") for p in self.pieces]
        self.cls = np.array([_piece_class(b) for b in self.bodies], dtype=np.int8)
        self.cls[self.special] = _SPECIAL
        self._generation = None

    def _sync(self) -> None:
        if self._generation != self.table.generation:
            self._generation = self.table.generation
            self._piece_rows = np.where(self.special, ZERO_ROW, -1).astype(np.int64)
            self._gmap: dict[int, int] = {}  # 64-bit group key -> slot
            self._gkeys = np.full((0, 1), -1, np.int32)  # slot -> piece ids (-1 padded), checked exactly
            self._grows = np.zeros((0, 1), np.int32)  # slot -> row ids of the pieces
            self._gsize = 0

    def _piece_table(self, tokens: np.ndarray) -> np.ndarray:
        """Row ids of pieces hashed on their own (subword unit, or one-piece groups of the word unit)."""
        need = np.unique(tokens[self._piece_rows[tokens] < 0]).tolist()
        if need:
            pieces = [self.pieces[i] for i in need]
            if self.unit == "subword":
                strings = [subword_string(p) for p in pieces]
            else:
                strings = [words[0] for words in group_words_many([[p] for p in pieces])]
            self._piece_rows[need] = self.table.lookup(strings)
        return self._piece_rows[tokens]

    def row_ids(self, tokens: np.ndarray, doc_starts: Sequence[int] = (0,)) -> np.ndarray:
        """Row ids ``int64 [len(tokens)]`` for concatenated documents starting at ``doc_starts``."""
        self._sync()
        tokens = np.asarray(tokens, dtype=np.int64)
        if len(tokens) == 0:
            return np.zeros(0, np.int64)
        if self.unit == "subword":
            return self._piece_table(tokens)
        start = self.starts[tokens]
        start[1:] |= self.special[tokens[:-1]]
        start[np.asarray(doc_starts, dtype=np.int64)] = True
        n = len(tokens)
        cls = self.cls[tokens]
        # runs: a group start, a change between word and punctuation pieces, not after a space piece
        run_start = start.copy()
        run_start[1:] |= (cls[:-1] != _SPACE) & (cls[1:] != cls[:-1])
        gid = np.cumsum(start) - 1
        mixed_group = np.bincount(gid, weights=cls == _MIXED) > 0
        mixed = mixed_group[gid]
        rstart = np.flatnonzero(run_start)
        rlen = np.diff(np.append(rstart, n))
        solo = (rlen == 1)[np.cumsum(run_start) - 1] & ~mixed
        out = np.empty(n, np.int64)
        out[solo] = self._piece_table(tokens[solo])  # one-piece runs: the piece's own word
        multi = (rlen > 1) & ~mixed[rstart]
        if multi.any():
            sel = np.repeat(multi, rlen)
            out[sel] = self._multi_rows(tokens, rstart[multi], rlen[multi], self._run_words)
        if mixed.any():
            gstart = np.flatnonzero(start)
            glen = np.diff(np.append(gstart, n))
            out[mixed] = self._multi_rows(tokens, gstart[mixed_group], glen[mixed_group], self._group_words)
        return out

    def _group_words(self, groups: list[list[int]]) -> list[list[str]]:
        return group_words_many([[self.pieces[i] for i in g] for g in groups])

    def _run_words(self, runs: list[list[int]]) -> list[list[str]]:
        """Hash strings of runs of word (or punctuation) pieces: their joined text, lowercased."""
        return [[word] * len(run) for word, run in zip(self._run_strings(runs), runs)]

    def _run_strings(self, runs: list[list[int]]) -> list[str]:
        """The hash string of each run (``_run_words`` without the repetition per piece). Run texts
        hold no whitespace (word and punctuation piece bodies), so they are lowercased together,
        joined by newlines (lowercasing never creates or removes whitespace, and the final-sigma
        rule does not look across it)."""
        get = self.bodies.__getitem__
        texts = ["".join(map(get, run)) for run in runs]
        lowered = "\n".join(texts).lower().split("\n")
        if len(lowered) != len(texts):  # pragma: no cover - guarded by the comment above
            lowered = [t.lower() for t in texts]
        return [w or SP_SPACE for w in lowered]

    def _multi_rows(self, tokens: np.ndarray, gstart: np.ndarray, glen: np.ndarray, words_of) -> np.ndarray:
        """Row ids of the tokens of multi-piece runs/groups (in token order); ``words_of(list of
        piece-id lists)`` gives their hash strings. Units of at most ``MAX_CACHED_PIECES`` pieces are
        deduplicated with a vectorised 64-bit key of their piece ids, looked up in a slot cache, and
        the keys are compared exactly (on a collision the call falls back to exact byte keys); longer
        ones (a word of thousands of pieces in text without spaces) are hashed one by one, uncached,
        so the cache's key matrix stays ``slots x MAX_CACHED_PIECES``. Runs never contain mixed
        pieces and mixed groups always do, so both share the cache."""
        long = glen > MAX_CACHED_PIECES
        if long.any():
            out = np.empty(int(glen.sum()), np.int64)
            mine = np.repeat(long, glen)
            if not long.all():
                out[~mine] = self._multi_rows(tokens, gstart[~long], glen[~long], words_of)
            units = [tokens[a : a + n].tolist() for a, n in zip(gstart[long].tolist(), glen[long].tolist())]
            if words_of == self._run_words:
                rows = np.repeat(self.table.lookup(self._run_strings(units)), glen[long])
            else:
                rows = self.table.lookup([w for words in words_of(units) for w in words])
            out[mine] = rows
            return out
        if self._gsize > self.table.max_entries:  # the slot cache is bounded like the table
            self._generation = None
            self._sync()
        g = len(gstart)
        width = int(glen.max())
        sel = np.repeat(np.arange(g), glen)
        first_tok = np.zeros(g, np.int64)
        np.cumsum(glen[:-1], out=first_tok[1:])
        pos = np.arange(len(sel)) - first_tok[sel]
        keys = np.full((g, width), -1, np.int64)
        keys[sel, pos] = tokens[gstart[sel] + pos]
        uh, first, inv = np.unique(row_hash(keys), return_index=True, return_inverse=True)
        inv = inv.reshape(-1)
        ukeys, ulen = keys[first], glen[first]
        if not np.array_equal(ukeys[inv], keys):
            return self._multi_rows_exact(keys, glen, sel, pos, words_of)
        gmap = self._gmap
        slots = np.fromiter((gmap.get(x, -1) for x in uh.tolist()), np.int64, count=len(uh))
        found = slots >= 0
        self._reserve(self._gsize, width)
        if found.any():
            stored = self._gkeys[slots[found]]
            if not (np.array_equal(stored[:, :width], ukeys[found]) and (stored[:, width:] == -1).all()):
                return self._multi_rows_exact(keys, glen, sel, pos, words_of)
        new = np.flatnonzero(~found)
        if len(new):
            nl = ulen[new]
            flat = ukeys[new][np.arange(width) < nl[:, None]].tolist()  # row-major: the pieces of each group
            ends = np.cumsum(nl).tolist()
            groups = [flat[e - n : e] for e, n in zip(ends, nl.tolist())]
            if words_of == self._run_words:  # one word per run: look it up once, repeat per piece
                rows = np.repeat(self.table.lookup(self._run_strings(groups)), ulen[new])
            else:
                rows = self.table.lookup([w for words in words_of(groups) for w in words])
            start = self._gsize
            self._reserve(start + len(new), width)
            self._gkeys[start : start + len(new), :width] = ukeys[new]
            lens = ulen[new]
            s2 = np.repeat(np.arange(len(new)), lens)
            offs = np.zeros(len(new), np.int64)
            np.cumsum(lens[:-1], out=offs[1:])
            self._grows[start + s2, np.arange(len(s2)) - offs[s2]] = rows
            for i, x in enumerate(uh[new].tolist()):
                gmap[x] = start + i
            slots[new] = start + np.arange(len(new))
            self._gsize += len(new)
        return self._grows[slots[inv[sel]], pos]

    def _reserve(self, size: int, width: int) -> None:
        cap, w = self._gkeys.shape
        if size <= cap and width <= w:
            return
        cap, w = max(size, 2 * cap, 1024), max(width, w)
        keys = np.full((cap, w), -1, np.int32)
        rows = np.zeros((cap, w), np.int32)
        keys[: self._gsize, : self._gkeys.shape[1]] = self._gkeys[: self._gsize]
        rows[: self._gsize, : self._grows.shape[1]] = self._grows[: self._gsize]
        self._gkeys, self._grows = keys, rows

    def _multi_rows_exact(self, keys, glen, sel, pos, words_of) -> np.ndarray:
        """Uncached exact path (only taken on a 64-bit key collision)."""
        index: dict[bytes, int] = {}
        inv = np.fromiter((index.setdefault(r.tobytes(), len(index)) for r in keys), np.int64, count=len(keys))
        first = np.unique(inv, return_index=True)[1]
        words = words_of([keys[i, : glen[i]].tolist() for i in first.tolist()])
        rows = self.table.lookup([w for ws in words for w in ws])
        urows = np.zeros((len(first), keys.shape[1]), np.int64)
        k = 0
        for u, ws in enumerate(words):
            urows[u, : len(ws)] = rows[k : k + len(ws)]
            k += len(ws)
        return urows[inv[sel], pos]


def word_stream_row_ids(table: CodeTable, tokens: np.ndarray, words: Sequence[str]) -> np.ndarray:
    """Row ids for a vocabulary-free word stream: token id -> ``words[id]`` -> its code; ids of the
    special tokens (0-4) get the zero row."""
    tokens = np.asarray(tokens, dtype=np.int64)
    out = np.full(len(tokens), ZERO_ROW, np.int64)
    real = tokens >= NUM_SPECIAL
    out[real] = table.lookup([words[t] for t in tokens[real].tolist()])
    return out
