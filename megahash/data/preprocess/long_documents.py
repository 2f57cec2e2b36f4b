"""Documents of any length in bounded memory: streamed text and pieces of at most ``max_chars`` characters.

A source yields a document as a ``str`` or, when it is too long to hold (a line longer than the read
block, a text block or a JSON value growing past the limit), as a :class:`TextStream`: an iterator of
text fragments read lazily from the file. :func:`pieces` turns either into pieces of at most
``max_chars`` characters that stay ONE document downstream (one sequence in the shards, the EOS after
its last piece only). Each piece records how it continues the text before it (``kind``):

* ``START``: the first piece of a document;
* ``AFTER_SPACE``: the previous piece ended just before a whitespace character that this piece starts
  with. The cut is the last single space between two non-space characters in the piece's
  ``max_chars`` characters, else the last whitespace character followed by a non-space one (a cut
  *before* the last character of a whitespace run). Such a cut is a word and pre-token boundary of
  sentencepiece (``\u2581`` starts a piece), GPT-2-style byte-level BPE (``" word"`` is a pre-token)
  and the HashFormers words, so the pieces tokenize and hash as the whole text does
  (:meth:`megahash.tokenization.MegahashTokenizer.encode_pieces` encodes a continuation without the
  tokenizer's word-start prefix);
* ``AFTER_CUT``: no whitespace boundary in the window: a hard cut after ``max_chars`` characters (moved
  back before combining marks, never inside a character: Python strings hold code points, and the
  readers cut bytes only at UTF-8 character starts, :func:`utf8_cut`). The word at the cut becomes two
  words: two groups of pieces, two word codes.

A document's leading whitespace run is kept up to its last ``max_chars`` characters (a run longer than
that is all the document would hold so far, and its start is dropped); a document of whitespace alone
yields no piece (an empty document, skipped and counted like a blank one).
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Iterable, Iterator

START, AFTER_SPACE, AFTER_CUT = 0, 1, 2
LAST = 4  # flag: the piece ends its document
KIND = 3  # mask of the kind bits
_SINGLE_SPACE = re.compile(r"(?<=\S) (?=\S)")
_SPACE_BEFORE_TEXT = re.compile(r"\s(?=\S)")
_NON_SPACE = re.compile(r"\S")
_WINDOWS = (1 << 12, 1 << 16)  # tail windows searched first for the last boundary (then the whole piece)


class TextStream:
    """One document as lazily read text fragments (each a few MiB at most). Iterate it once, before
    the next document of its source (it reads from the source's open file)."""

    __slots__ = ("_fragments",)

    def __init__(self, fragments: Iterable[str]):
        self._fragments = fragments

    def __iter__(self) -> Iterator[str]:
        return iter(self._fragments)

    def drain(self) -> None:
        """Read (and drop) the rest: the source's next document starts after it."""
        for _ in self._fragments:
            pass

    def text(self) -> str:
        """The whole text (unbounded: for callers that need it whole)."""
        return "".join(self._fragments)


Document = str | TextStream


def whole(doc: Document) -> str:
    return doc if isinstance(doc, str) else doc.text()


def utf8_cut(data: bytes) -> int:
    """Largest ``i >= len(data) - 3`` such that ``data[i:]`` starts a UTF-8 character (or the whole
    length when ``data`` ends on a complete one): decoding ``data[:i]`` and ``data[i:]`` apart gives
    the text (and the U+FFFD replacements) decoding them together gives."""
    n = len(data)
    for i in range(n - 1, max(n - 4, -1), -1):
        b = data[i]
        if b < 0x80:
            return n
        if b >= 0xC0:  # a lead byte: complete if its sequence fits
            need = 2 if b < 0xE0 else 3 if b < 0xF0 else 4
            return n if n - i >= need else i
    return n  # only continuation bytes at the end: invalid anyway, replaced one by one


def find_cut(text: str, start: int, max_chars: int) -> tuple[int, int]:
    """``(i, kind)``: the piece of ``text`` from ``start`` (more than ``max_chars`` characters remain)
    ends before ``i``, ``start < i <= start + max_chars``, and ``kind`` says how the rest continues it
    (module docstring)."""
    end = start + max_chars
    for pattern in (_SINGLE_SPACE, _SPACE_BEFORE_TEXT):
        for w in (*_WINDOWS, max_chars):
            lo = max(start + 1, end - w)
            last = None
            for match in pattern.finditer(text, lo, end + 1):
                last = match
            if last is not None:
                return last.start(), AFTER_SPACE
            if lo == start + 1:
                break
    i = end
    while i > end - 32 and i > start + 1 and unicodedata.combining(text[i]):  # a base character keeps its marks
        i -= 1
    return (end if unicodedata.combining(text[i]) else i), AFTER_CUT


def pieces(doc: Document, max_chars: int) -> Iterator[tuple[str, int]]:
    """``(text, flags)`` of the pieces of ``doc`` (module docstring); ``flags`` = kind | ``LAST`` on the
    last piece. A ``str`` of at most ``max_chars`` characters with non-space text is one piece."""
    if isinstance(doc, str):
        if len(doc) <= max_chars:
            if doc and not doc.isspace():
                yield doc, START | LAST
            return
        fragments: Iterable[str] = (doc,)
    else:
        fragments = doc
    buf, kind, started = "", START, False
    for frag in fragments:
        if not started:  # leading whitespace: keep its last max_chars characters
            m = _NON_SPACE.search(frag)
            if m is None:
                buf = (buf + frag)[-max_chars:]
                continue
            started = True
            drop = len(buf) + m.start() - max_chars
            buf = (buf + frag)[drop:] if drop > 0 else buf + frag
        else:
            buf = buf + frag if buf else frag
        pos = 0
        while len(buf) - pos > max_chars:
            i, next_kind = find_cut(buf, pos, max_chars)
            yield buf[pos:i], kind
            pos, kind = i, next_kind
        buf = buf[pos:] if pos else buf
    if started and buf:
        yield buf, kind | LAST
