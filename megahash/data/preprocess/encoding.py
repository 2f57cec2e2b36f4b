"""Worker side of preprocessing: a chunk of documents -> token ids + code rows per hash spec.

One ``ChunkEncoder`` lives in each worker process (or in the main process with ``--workers 1``)
and keeps its ``CodeTable`` cache across chunks, so each distinct word is hashed about once per
worker. With a sentencepiece BPE model that allows it (``SentencePieceSegments``), a
``SegmentEncoder`` also encodes each distinct whitespace token once and assembles documents from
its per-token pieces and row ids (documents it cannot reproduce exactly are encoded whole). Specs
in ``EncoderConfig.deferred`` (LSH) are not hashed here: the result carries CodeTable row ids and
the worker's new strings, and the worker counts the words the LSH vocabulary needs (``finish``).
Outputs depend only on the documents, never on chunking or worker count: codes are pure
functions of strings, and word-table ids are assigned by the main process in document order.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from itertools import chain
from typing import Any

import numpy as np

from megahash.data.preprocess.common import InputError
from megahash.data.preprocess.long_documents import AFTER_CUT, KIND, LAST, START
from megahash.hashing.codes import ZERO_ROW, CodeTable
from megahash.hashing.lsh import LSHModel
from megahash.hashing.specs import HashSpec
from megahash.hashing.tokens import _MIXED, _SPACE, _SPECIAL, SP_SPACE, SubwordCoder
from megahash.hashing.words import EOS_ID, SPECIAL_TOKENS, WORD_RE, split_words
from megahash.tokenization import ROLES, load_tokenizer

WORDS = "words"


@dataclass
class TokenizerInfo:
    """What the meta records about the tokenizer."""

    kind: str  # "sentencepiece" | "hf" | "words"
    path: str | None
    sha256: str | None
    vocab_size: int | None  # None for words: known only at the end
    special_ids: dict | None = None  # role -> id (None: the word ids 0-4)
    special_tokens: dict | None = None
    file: str | None = None
    loaded: Any = field(default=None, repr=False, compare=False)  # the tokenizer object (reused by the encoder)

    @property
    def eos_id(self) -> int | None:
        return (self.special_ids or {}).get("eos", EOS_ID) if self.special_ids is not None else EOS_ID

    def to_meta(self) -> dict:
        ids = self.special_ids if self.special_ids is not None else {name: i for i, name in enumerate(ROLES)}
        toks = self.special_tokens if self.special_tokens is not None else dict(zip(ROLES, SPECIAL_TOKENS))
        out = {
            "kind": self.kind,
            "path": self.path,
            "sha256": self.sha256,
            "vocab_size": self.vocab_size,
            "special_ids": ids,
            "special_tokens": toks,
        }
        if self.file and self.file != self.path:
            out["file"] = self.file
        return out


def resolve_tokenizer(spec: str) -> TokenizerInfo:
    """``words``, or any tokenizer of :func:`megahash.tokenization.load_tokenizer` (a sentencepiece
    ``PREFIX``/``PREFIX.model``, a tokenizer.json, an HF tokenizer folder or name)."""
    if spec == WORDS:
        return TokenizerInfo(WORDS, None, None, None)
    tok = load_tokenizer(spec)
    return TokenizerInfo(
        tok.kind, spec, tok.sha256, tok.vocab_size, dict(tok.special_ids), dict(tok.special_tokens), tok.path, tok
    )


@dataclass
class EncoderConfig:
    """Everything a worker needs (picklable)."""

    tokenizer: str  # "words" or a .model path
    specs: list[HashSpec]
    hash_unit: str = "word"
    append_eos: bool = True
    key: bytes | None = b"en"
    token_dtype: str = "uint16"
    cache_entries: int = 1 << 21  # CodeTable strings (and half as many SegmentEncoder tokens) per worker
    cache_chars: int = 1 << 24  # and at most this many characters of them (each cache cleared past it)
    encode_threads: int = 1
    deferred: tuple = ()  # names of specs whose codes the main process computes after the pass (LSH)
    count_words: bool = False  # collect word counts of each task's first ``n_count`` documents
    segment_cache: bool = True  # sentencepiece: encode each distinct whitespace token once (when exact)


@dataclass
class ChunkResult:
    """Encoded chunk. Words streams carry local ids and the chunk's distinct words (local id 0 is EOS)."""

    lengths: np.ndarray  # tokens per kept document (incl. EOS)
    tokens: np.ndarray  # token ids (sentencepiece) or local word ids (words)
    codes: dict[str, np.ndarray] = field(default_factory=dict)  # spec name -> [tokens, width]
    words: list[str] | None = None
    empty: int = 0  # documents with no tokens (skipped)
    # deferred specs, subword streams: per-token CodeTable row ids (0 = special) of this worker, and
    # the strings of the rows the worker added since its previous result (rows len(seen)+1, ...)
    rows: np.ndarray | None = None
    new_strings: list[str] | None = None
    worker: int = 0  # id of the worker process (its pid)
    generation: int = 0  # CodeTable generation of ``rows`` (a new one restarts the row numbering)
    counted: int = 0  # leading documents of the task whose words are counted (set by the caller)
    kept: Sequence[int] | None = None  # (while encoding pieces) the entries of ``lengths``
    # pieces of long documents (megahash/data/preprocess/long_documents.py): None when every entry of
    # ``lengths`` is a whole document; else per entry whether it continues the previous entry's
    # document (the first one: the previous result's last), and whether the last entry's document
    # goes on in the next result
    joins: np.ndarray | None = None
    open_end: bool = False

    def documents(self) -> tuple[np.ndarray, bool]:
        """``(lengths, continues)``: tokens per document, pieces merged; ``continues``: the first one
        continues the previous result's last document."""
        if self.joins is None or not len(self.lengths):
            return self.lengths, False
        first = np.flatnonzero(~self.joins)
        continues = bool(self.joins[0])
        heads = np.concatenate([[0], first]) if continues else first
        return np.add.reduceat(self.lengths, heads), continues

    @property
    def finished(self) -> int:
        """Documents this result completes."""
        if self.joins is None:
            return len(self.lengths)
        return int((~self.joins).sum()) + bool(len(self.joins) and self.joins[0]) - self.open_end


# -- sentencepiece: encode each distinct whitespace token once ---------------------------------
def _darts_ascii_keys(blob: bytes) -> list[bytes] | None:
    """Keys made only of ASCII bytes in a sentencepiece precompiled character map (a darts-clone
    double array after a little-endian uint32 size; unit: bit 8 has-leaf, label in bits 0-7 (and
    31), offset ``(u >> 10) << ((u & 512) >> 6)``), or None if the blob cannot be read."""
    if not blob:
        return []
    if len(blob) < 4:
        return None
    size = int.from_bytes(blob[:4], "little")
    if size % 4 or size + 4 > len(blob):
        return None
    units = np.frombuffer(blob[4 : 4 + size], "<u4").astype(np.int64)
    if not len(units):
        return None

    def offset(u: int) -> int:
        return (u >> 10) << ((u & (1 << 9)) >> 6)

    keys: list[bytes] = []
    stack = [(offset(int(units[0])), b"")]
    seen = 0
    while stack:
        pos, prefix = stack.pop()
        seen += 1
        if seen > 100_000 or len(prefix) > 64:
            return None
        for b in range(1, 128):
            child = pos ^ b
            if child >= len(units):
                continue
            u = int(units[child])
            if (u & ((1 << 31) | 0xFF)) != b:
                continue
            if (u >> 8) & 1:
                keys.append(prefix + bytes([b]))
            stack.append((child ^ offset(u), prefix + bytes([b])))
    return keys


class SentencePieceSegments:
    """Whether and how a sentencepiece model may encode each whitespace token of a document on its
    own (``available``), which documents need no normalization check (``plain``), and the
    identity-normalizer processor that encodes a token ("▁" + token) exactly as the model sees it
    inside a document (``raw``: :meth:`megahash.tokenization.SentencePieceTokenizer.unnormalized`).

    Why per-token encoding is exact: sentencepiece encodes ``model(normalize(doc))``. For a BPE
    model whose pieces contain "▁" only as their first character, BPE only ever merges two adjacent
    symbols into a piece of the vocabulary, so no symbol spans a "▁" that is not its first
    character: the merges inside each "▁"-delimited segment of the normalized text do not depend
    on the other segments (the agenda orders pairs by score, then position, which keeps the order
    inside a segment); and with "▁" an ordinary piece, no unknown piece precedes a segment's
    leading "▁" piece, so sentencepiece's merging of adjacent unknown pieces never crosses a
    segment either. Hence ``model("▁a▁b") == model("▁a") + model("▁b")``. A document may be
    encoded per token when ``normalize(doc) == "▁" + "▁".join(doc.split())``: checked with
    ``normalize`` unless the document is ``plain`` (ASCII, only characters that the model's
    character map provably leaves alone or maps to a space, there being no multi-character ASCII
    rule); other documents are encoded whole. Unigram models are excluded: their Viterbi search
    sums float32 scores along the whole document, so a segment's best path can depend on what
    precedes it."""

    def __init__(self, tok, pieces: list[str] | None = None):
        self.available = False
        self.raw = None
        self._plain = None
        sp = tok.sp  # a megahash.tokenization.SentencePieceTokenizer: its processor and model
        try:
            proto = tok.model_proto()
            if not hasattr(sp, "normalize") or proto.trainer_spec.model_type != proto.trainer_spec.BPE:
                return
            space = sp.piece_to_id(SP_SPACE)
            if sp.id_to_piece(space) != SP_SPACE or any(
                f(space) for f in (sp.is_unknown, sp.is_control, sp.is_byte, sp.is_unused)
            ):
                return
            pieces = pieces if pieces is not None else [sp.id_to_piece(i) for i in range(sp.get_piece_size())]
            for i, piece in enumerate(pieces):  # pieces that BPE can produce: "▁" first only, no whitespace
                if (SP_SPACE in piece[1:] or piece.split() != [piece]) and not (
                    sp.is_control(i) or sp.is_unknown(i) or sp.is_byte(i)
                ):
                    return
            if sp.normalize("a") != SP_SPACE + "a" or sp.normalize("  a \t b \n") != SP_SPACE + "a" + SP_SPACE + "b":
                return
            self.raw = tok.unnormalized()
            probe = ["hello", "a" + SP_SPACE + "b", "x"]
            if [self.raw.encode(SP_SPACE + w) for w in probe] != [sp.encode(w) for w in probe]:
                return
            self.available = True
            self._plain = self._plain_pattern(sp, proto.normalizer_spec.precompiled_charsmap)
        except (OSError, ValueError, IndexError, TypeError, RuntimeError):
            self.available = False

    @staticmethod
    def _plain_pattern(sp, charsmap: bytes) -> bytes | None:
        """The ASCII characters that need no ``normalize`` check (each maps to itself, or is
        whitespace for both ``str.split`` and the model), if the model's character map has no rule
        for a sequence of several ASCII characters; else None."""
        keys = _darts_ascii_keys(charsmap)
        if keys is None or any(len(k) > 1 for k in keys):
            return None
        allowed = []
        for c in map(chr, range(1, 128)):
            want = "a" + SP_SPACE + "b" if c.isspace() else "a" + c + "b"
            if sp.normalize("a" + c + "b") == SP_SPACE + want:
                allowed.append(c)
        return "".join(allowed).encode("ascii") if allowed else None

    def plain(self, doc: str) -> bool:
        """True if ``normalize(doc) == "▁" + "▁".join(doc.split())`` is known without calling it:
        ``doc`` is ASCII and deleting the allowed characters leaves nothing."""
        return self._plain is not None and doc.isascii() and not doc.encode("ascii").translate(None, self._plain)


class GrowArray:
    """Append-only numpy array with amortised growth."""

    def __init__(self, dtype, size: int = 0):
        self.data = np.zeros(max(1024, size), dtype)
        self.size = 0

    def extend(self, values: np.ndarray) -> None:
        end = self.size + len(values)
        if end > len(self.data):
            grown = np.zeros(max(end, 2 * len(self.data)), self.data.dtype)
            grown[: self.size] = self.data[: self.size]
            self.data = grown
        self.data[self.size : end] = values
        self.size = end

    def view(self) -> np.ndarray:
        return self.data[: self.size]


class _Index(dict):
    """``str -> id`` (1, 2, ...) that gives unseen keys the next id on lookup and records them."""

    def __init__(self):
        super().__init__()
        self.new: list[str] = []

    def __missing__(self, key: str) -> int:
        value = self[key] = len(self) + 1
        self.new.append(key)
        return value


class SegmentEncoder:
    """Sentencepiece ids and CodeTable row ids per whitespace token, each distinct token encoded
    (by ``SentencePieceSegments.raw``) and hashed once per worker; entry 0 is EOS. Also counts the
    tokens of the documents it is told to count (``word_counts``)."""

    def __init__(
        self,
        info: SentencePieceSegments,
        coder: SubwordCoder | None,
        token_dtype: np.dtype,
        encode_threads: int,
        eos: int = EOS_ID,
    ):
        self.info, self.coder, self.threads = info, coder, encode_threads
        self.eos = eos
        self.token_dtype = token_dtype
        self.flushed: Counter = Counter()  # word counts of entries dropped by clear()
        self.index = _Index()
        self.chars = 0  # characters of the cached tokens
        self.clear()

    def clear(self) -> None:
        """Forget all entries (their counts are kept); call before the CodeTable is cleared."""
        if self.index:
            self.flushed.update(self._current_word_counts())
        self.index = _Index()
        self.chars = 0
        self.pieces = GrowArray(self.token_dtype)
        self.rows = GrowArray(np.int32)  # CodeTable row ids (< 2**31: the table holds at most cache_entries)
        self.off = GrowArray(np.int64)
        self.len = GrowArray(np.int64)
        self.counts = GrowArray(np.int64)
        self.simple = GrowArray(bool)  # word counts readable from the row ids (see word_counts)
        self.pieces.extend(np.array([self.eos], self.token_dtype))
        self.rows.extend(np.array([ZERO_ROW], np.int32))
        self.off.extend(np.zeros(1, np.int64))
        self.len.extend(np.ones(1, np.int64))
        self.counts.extend(np.zeros(1, np.int64))
        self.simple.extend(np.zeros(1, bool))

    def __len__(self) -> int:
        return len(self.index)

    def _add(self, strings: list[str]) -> None:
        self.chars += sum(map(len, strings))
        encoded = self.info.raw.encode([SP_SPACE + s for s in strings], num_threads=self.threads)
        lens = np.fromiter(map(len, encoded), np.int64, count=len(encoded))
        flat = np.fromiter(chain.from_iterable(encoded), np.int64, count=int(lens.sum()))
        offs = np.zeros(len(lens), np.int64)
        np.cumsum(lens[:-1], out=offs[1:])
        simple = np.zeros(len(strings), bool)
        if self.coder is not None:
            self.rows.extend(self._rows(strings, flat, lens, offs, simple))
        self.off.extend(offs + self.pieces.size)
        self.pieces.extend(flat.astype(self.token_dtype))
        self.len.extend(lens)
        self.counts.extend(np.zeros(len(strings), np.int64))
        self.simple.extend(simple)

    def _rows(
        self, strings: list[str], flat: np.ndarray, lens: np.ndarray, offs: np.ndarray, simple: np.ndarray
    ) -> np.ndarray:
        """CodeTable row ids of the pieces ``flat`` of new entries (``SubwordCoder.row_ids`` with every
        entry a document: its first piece starts with "▁", so it starts a group in any document).

        Word unit, ``simple`` entries (set here): ASCII tokens whose pieces are word or punctuation
        pieces plus maybe a leading "▁" piece. Their groups are the whole token and split into runs
        of word pieces and of punctuation pieces (a leading "▁" piece joins the first run); a run's
        hash string is its lowercased text, which for such a token is exactly the sequence of regex
        words of the lowercased token. So all their strings come from one regex pass over the
        tokens, in order, one per run."""
        if not len(flat):
            return np.zeros(0, np.int64)
        coder = self.coder
        if coder.unit != "word":
            return coder.row_ids(flat, offs[lens > 0])
        cls = coder.cls[flat]
        entry = np.repeat(np.arange(len(lens)), lens)
        first = np.zeros(len(flat), bool)
        first[offs[lens > 0]] = True
        bad = (cls == _MIXED) | (cls == _SPECIAL) | ((cls == _SPACE) & ~first)
        simple[:] = (np.bincount(entry, weights=bad, minlength=len(lens)) == 0) & (lens > 0)
        simple &= np.fromiter(map(str.isascii, strings), bool, count=len(strings))
        rows = np.zeros(len(flat), np.int64)
        mine = simple[entry]
        if simple.any():
            run = first.copy()  # run starts (SubwordCoder.row_ids: a class change not after a "▁" piece)
            run[1:] |= (cls[:-1] != _SPACE) & (cls[1:] != cls[:-1])
            starts = np.flatnonzero(run & mine)  # a run ends at the next run start or at its entry's end
            ends = np.minimum(np.append(starts[1:], len(flat)), (offs + lens)[entry[starts]])
            texts = [strings[i] for i in np.flatnonzero(simple).tolist()]
            words = WORD_RE.findall("\n".join(texts).lower())
            if len(words) == len(starts):
                rows[mine] = np.repeat(coder.table.lookup(words), ends - starts)
            else:  # pragma: no cover - cannot happen (see the docstring); stay exact anyway
                simple[:] = False
                mine[:] = False
        if not mine.all():
            rest = ~mine
            sub_lens = np.where(simple, 0, lens)
            sub_offs = np.zeros(len(lens), np.int64)
            np.cumsum(sub_lens[:-1], out=sub_offs[1:])
            rows[rest] = coder.row_ids(flat[rest], sub_offs[sub_lens > 0])
        return rows

    def ids(self, tokens: Iterable[str], count: int) -> np.ndarray:
        """Entry ids of ``count`` whitespace tokens (adding new ones)."""
        ids = np.fromiter(map(self.index.__getitem__, tokens), np.int64, count=count)
        if self.index.new:  # they got ids len(index) - len(new) + 1, ... in this order
            new, self.index.new = self.index.new, []
            self._add(new)
        return ids

    def count(self, ids: np.ndarray) -> None:
        n = self.counts.size
        self.counts.data[:n] += np.bincount(ids, minlength=n)

    def gather(self, sel: np.ndarray) -> tuple[np.ndarray, np.ndarray | None, np.ndarray]:
        """Token ids, row ids (None without a coder) and piece counts of the entries ``sel``."""
        lens = self.len.data[sel]
        ends = np.cumsum(lens)
        total = int(ends[-1]) if len(ends) else 0
        idx = np.repeat(self.off.data[sel] - (ends - lens), lens) + np.arange(total, dtype=np.int64)
        rows = self.rows.data[idx] if self.coder is not None else None
        return self.pieces.data[idx], rows, lens

    def word_counts(self) -> Counter:
        """HashFormers word counts of the tokens counted so far (``count_words`` of the counted
        documents). A ``simple`` entry -- an ASCII token whose pieces are word or punctuation pieces
        (and a leading "▁" piece), hashed with the word unit -- has as its words exactly the hash
        strings of its runs of pieces (a run's string is its lowercased text, and for such a token
        the runs are the regex matches), so its words are read off the row ids: one per change of
        row. Other entries are lowercased and split (``words_of_tokens``)."""
        out = self._current_word_counts()
        out.update(self.flushed)
        return out

    def _current_word_counts(self) -> Counter:
        counts = self.counts.view()
        used = counts > 0
        out: Counter = Counter()
        fast = self.simple.view() & used
        if fast.any():
            lens = self.len.view()
            entry = np.repeat(np.arange(len(lens)), lens)
            rows = self.rows.view()
            start = np.ones(len(rows), bool)
            start[1:] = rows[1:] != rows[:-1]
            start[self.off.view()] = True
            pick = start & fast[entry]
            totals = np.zeros(int(rows.max()) + 1, np.int64)
            np.add.at(totals, rows[pick], counts[entry[pick]])
            strings = self.coder.table.strings_from(0)
            hit = np.flatnonzero(totals)
            out.update(dict(zip([strings[i] for i in hit.tolist()], totals[hit].tolist())))
        slow = np.flatnonzero(used & ~self.simple.view())
        if len(slow):
            strings = list(self.index)  # entry i <-> strings[i - 1]
            out.update(words_of_tokens([strings[i - 1] for i in slow.tolist()], counts[slow].tolist()))
        return out


def words_of_tokens(tokens: Sequence[str], counts: Sequence[int]) -> Counter:
    """HashFormers word counts from whitespace-token counts, each distinct token lowercased and split
    once. Same as ``count_words`` of the documents: lowercasing never creates or removes whitespace
    and Python's final-sigma rule never looks across whitespace, so lowercasing each token (here all
    of them at once, joined by newlines) equals lowercasing the document."""
    lowered = "\n".join(tokens).lower().split("\n")
    if len(lowered) != len(tokens):  # pragma: no cover - see the docstring
        lowered = [t.lower() for t in tokens]
    words: dict[str, int] = {}
    get = words.get
    findall = WORD_RE.findall
    for t, n in zip(lowered, counts):
        if t.isalnum():  # one \w+ word
            words[t] = get(t, 0) + n
        else:
            for w in findall(t):
                words[w] = get(w, 0) + n
    return Counter(words)


class ChunkEncoder:
    """Tokenise a chunk of documents and hash its tokens (see module docstring)."""

    def __init__(self, cfg: EncoderConfig, lsh: LSHModel | None = None, tokenizer=None):
        """``tokenizer``: the one ``cfg.tokenizer`` names, already loaded (else it is loaded here)."""
        self.cfg = cfg
        deferred = set(cfg.deferred)
        self.specs = [s for s in cfg.specs if s.name not in deferred]  # hashed here
        self.deferred = [s for s in cfg.specs if s.name in deferred]  # row ids + strings to the main process
        self.table = CodeTable(
            self.specs, key=cfg.key, lsh=lsh, max_entries=cfg.cache_entries, max_chars=cfg.cache_chars
        )
        self.sp = None
        self.segments = None
        self.worker = os.getpid()
        self._reported = 1  # table rows below this were reported to the main process
        self._generation = self.table.generation
        self.word_counts: Counter = Counter()  # words streams
        self.token_dtype = np.dtype(cfg.token_dtype)
        self.eos = EOS_ID
        if cfg.tokenizer != WORDS:
            self.sp = tokenizer or load_tokenizer(cfg.tokenizer)  # a megahash.tokenization tokenizer (any kind)
            self.eos = self.sp.eos_id
            if cfg.append_eos and self.eos is None:
                raise InputError(f"tokenizer {cfg.tokenizer!r} has no end-of-document token; pass --no-append-eos")
            self.coder = SubwordCoder(self.sp, self.table, cfg.hash_unit)
            if cfg.segment_cache and self.sp.kind == "sentencepiece":
                info = SentencePieceSegments(self.sp, self.coder.pieces)
                if info.available:
                    self.segments = SegmentEncoder(
                        info,
                        self.coder if cfg.specs else None,
                        self.token_dtype,
                        cfg.encode_threads,
                        self.eos if self.eos is not None else EOS_ID,
                    )

    def encode(self, docs: Sequence[str], n_count: int = 0, flags: bytes | None = None) -> ChunkResult:
        """Encode ``docs``; with ``cfg.count_words``, count the words of the first ``n_count``.
        ``flags`` (one per entry, megahash/data/preprocess/long_documents.py): the entries are pieces
        of documents (None: each a whole document); a piece continuing a document is encoded as its
        continuation, the EOS follows the ``LAST`` piece, and a piece without tokens is kept (empty)."""
        seg = self.segments
        if seg is not None and (
            self.table.full() or len(seg) > self.cfg.cache_entries // 2 or seg.chars > self.cfg.cache_chars
        ):
            seg.clear()  # before the table: its counts are read through the table's strings
        self.table.maybe_reset()
        pieces = None if flags is None else _Pieces(flags)
        if self.sp is None:
            res = self._encode_words(docs, pieces)
        elif seg is not None:
            res = self._encode_segments(docs, n_count if self.cfg.count_words else 0, pieces)
        else:
            res = self._encode_subwords(docs, pieces)
            if self.cfg.count_words and n_count:
                self.word_counts.update(count_words(docs[:n_count]))
        if pieces is not None:
            kept = res.kept
            res.joins = pieces.joins[kept]
            res.open_end = bool(len(kept)) and not pieces.last[kept[-1]]
            res.kept = None
        res.worker = self.worker
        if self.deferred and self.sp is not None:
            if self._generation != self.table.generation:
                self._generation, self._reported = self.table.generation, 1
            res.generation = self._generation
            res.new_strings = self.table.strings_from(self._reported)
            self._reported += len(res.new_strings)
        return res

    def finish(self) -> Counter:
        """Word counts of everything counted (subword streams; words streams count in the main process)."""
        if self.segments is not None:
            self.word_counts.update(self.segments.word_counts())
        return self.word_counts

    def _codes(self, row_ids: np.ndarray) -> dict[str, np.ndarray]:
        return {s.name: self.table.rows(s.name, row_ids) for s in self.specs}

    def _result(self, lengths, tokens, rows, empty) -> ChunkResult:
        codes = self._codes(rows) if self.specs else {}
        res = ChunkResult(lengths, tokens.astype(self.token_dtype, copy=False), codes, empty=empty)
        if self.deferred:
            res.rows = rows.astype(np.int32, copy=False)
        return res

    def _encode_subwords(self, docs: Sequence[str], pieces: _Pieces | None = None) -> ChunkResult:
        if pieces is None:
            id_lists = self.sp.encode_batch(list(docs), num_threads=self.cfg.encode_threads)
        else:
            id_lists = self.sp.encode_pieces(list(docs), pieces.kinds, num_threads=self.cfg.encode_threads)
        eos = [self.eos] if self.cfg.append_eos else []
        if pieces is None:
            kept_ids = [ids + eos for ids in id_lists if ids]
            kept = None
        else:  # a piece of a split document is kept even without tokens; its EOS after the last piece
            kept = [i for i, ids in enumerate(id_lists) if ids or not pieces.whole[i]]
            kept_ids = [id_lists[i] + eos if pieces.last[i] else id_lists[i] for i in kept]
        lengths = np.fromiter((len(x) for x in kept_ids), dtype=np.int64, count=len(kept_ids))
        tokens = np.fromiter(chain.from_iterable(kept_ids), dtype=np.int64, count=int(lengths.sum()))
        starts = np.zeros(len(kept_ids), np.int64)
        np.cumsum(lengths[:-1], out=starts[1:])
        rows = self.coder.row_ids(tokens, starts[lengths > 0]) if self.cfg.specs else None
        res = self._result(lengths, tokens, rows, len(id_lists) - len(kept_ids))
        res.kept = kept
        return res

    def _encode_segments(self, docs: Sequence[str], n_count: int, pieces: _Pieces | None = None) -> ChunkResult:
        """Like ``_encode_subwords``, from the per-token cache (documents it cannot reproduce
        exactly, and pieces after a hard cut, are encoded whole)."""
        seg = self.segments
        toks = [d.split() for d in docs]
        ntok = np.fromiter(map(len, toks), np.int64, count=len(toks))
        ids = seg.ids(chain.from_iterable(toks), int(ntok.sum()))
        if n_count:
            seg.count(ids[: int(ntok[:n_count].sum())])
        plain = seg.info.plain
        good = np.fromiter(map(plain, docs), bool, count=len(docs))
        cut = pieces.kind == AFTER_CUT if pieces is not None else np.zeros(len(docs), bool)
        good &= ~cut  # a piece after a hard cut starts inside a word: not a cached "\u2581" token
        check = np.flatnonzero(~good & ~cut).tolist()
        if check:  # normalize(doc) must be "▁" + the whitespace tokens joined by "▁"
            join = SP_SPACE.join
            normalized = self.sp.sp.normalize([docs[i] for i in check])
            good[check] = [n == SP_SPACE + join(toks[i]) for i, n in zip(check, normalized)]
        good &= ntok > 0
        starts = np.zeros(len(toks), np.int64)
        np.cumsum(ntok[:-1], out=starts[1:])
        eos = self.cfg.append_eos
        ends_doc = pieces.last if pieces is not None else np.ones(len(docs), bool)
        if good.all():
            with_eos = ends_doc if eos else np.zeros(len(docs), bool)
            sel = np.insert(ids, (starts + ntok)[with_eos], 0)
            tokens, rows, lens = seg.gather(sel)
            shift = np.zeros(len(docs), np.int64)
            np.cumsum(with_eos[:-1], out=shift[1:])
            lengths = np.add.reduceat(lens, starts + shift) if len(docs) else np.zeros(0, np.int64)
            res = self._result(lengths, tokens, rows, 0)
            res.kept = None if pieces is None else np.arange(len(docs))
            return res
        # some documents encoded whole: assemble document by document
        bad = np.flatnonzero(~good).tolist()
        texts = [docs[i] for i in bad]
        if pieces is None:
            encoded = self.sp.encode_batch(texts, num_threads=self.cfg.encode_threads)
        else:
            encoded = self.sp.encode_pieces(texts, [pieces.kinds[i] for i in bad], num_threads=self.cfg.encode_threads)
        whole = dict(zip(bad, encoded))
        parts_t, parts_r, lengths, kept = [], [], [], []
        empty = 0
        for d in range(len(docs)):
            if d in whole:
                t = np.array(whole[d], np.int64)
                if not len(t) and (pieces is None or pieces.whole[d]):
                    empty += 1
                    continue
                r = self.coder.row_ids(t, [0]) if seg.coder is not None else None
                if eos and ends_doc[d]:
                    t = np.append(t, self.eos)
                    r = np.append(r, ZERO_ROW) if r is not None else None
            else:
                sel = ids[starts[d] : starts[d] + ntok[d]]
                t, r, _ = seg.gather(np.append(sel, 0) if eos and ends_doc[d] else sel)
            parts_t.append(t.astype(self.token_dtype, copy=False))
            if r is not None:
                parts_r.append(r)
            lengths.append(len(t))
            kept.append(d)
        tokens = np.concatenate(parts_t) if parts_t else np.zeros(0, self.token_dtype)
        rows = (np.concatenate(parts_r) if parts_r else np.zeros(0, np.int64)) if seg.coder is not None else None
        res = self._result(np.array(lengths, np.int64), tokens, rows, empty)
        res.kept = kept
        return res

    def _encode_words(self, docs: Sequence[str], pieces: _Pieces | None = None) -> ChunkResult:
        local: dict[str, int] = {SPECIAL_TOKENS[EOS_ID]: 0}  # split_words never yields "</s>"
        ids: list[int] = []
        lengths: list[int] = []
        kept: list[int] = []
        eos = self.cfg.append_eos
        empty = 0
        for d, doc in enumerate(docs):
            words = split_words(doc)
            end = pieces is None or pieces.last[d]
            if not words and (pieces is None or pieces.whole[d]):
                empty += 1
                continue
            ids.extend([local.setdefault(w, len(local)) for w in words])
            if eos and end:
                ids.append(0)
            lengths.append(len(words) + (eos and end))
            kept.append(d)
        uniq = list(local)
        local_ids = np.array(ids, dtype=np.int32)
        codes = {}
        if self.specs:
            rows = np.empty(len(uniq), np.int64)
            rows[0] = ZERO_ROW
            rows[1:] = self.table.lookup(uniq[1:])
            codes = self._codes(rows[local_ids])
        res = ChunkResult(np.array(lengths, np.int64), local_ids, codes, words=uniq, empty=empty)
        res.kept = kept
        return res


class _Pieces:
    """The flags of a task's entries (megahash/data/preprocess/long_documents.py) as arrays."""

    def __init__(self, flags: bytes):
        f = np.frombuffer(flags, np.uint8)
        self.kind = f & KIND
        self.kinds = self.kind.tolist()
        self.last = (f & LAST) > 0
        self.whole = f == (START | LAST)
        self.joins = self.kind != START


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
