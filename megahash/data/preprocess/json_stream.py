"""The string under one key of a JSON object, read from text fragments in bounded memory.

A JSON lines record too long to hold (a line longer than the read block) is parsed here instead of by
``json.loads``: :func:`object_text` yields the decoded text of ``key`` in pieces as it reads them, and
reads the rest of the record to the end, checking it is one JSON object. Memory: the current fragment
plus a few characters held back (an escape split by a fragment end, a ``\\uD83D`` high surrogate
waiting for its low half). String bodies are decoded by ``json.loads`` in chunks that never end inside
an escape or between the halves of a surrogate pair, so the text (lone surrogates included) is
``json.loads``'s. Differences from ``json.loads`` of the whole line, both refused in one line: the key
appearing twice (``json.loads`` keeps the last value; the first one was already passed on), nesting
deeper than ``MAX_DEPTH``; a number longer than ``MAX_NUMBER`` characters (``json.loads`` refuses
integers past 4,300 digits too).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator

MAX_DEPTH = 10_000
MAX_NUMBER = 1 << 16
MAX_KEY = 256  # characters of a key kept for comparing and for the error message
_WS = re.compile(r"[ \t\n\r]*")
_STRING_BODY = re.compile(r'[^"\\]*(?:\\.[^"\\]*)*', re.S)
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][-+]?[0-9]+)?")
_NUMBER_CHARS = re.compile(r"[-+0-9.eE]*")


class JSONStreamError(ValueError):
    """Invalid JSON (the message says what and where, like ``json.JSONDecodeError.msg``)."""


class KeyTypeError(ValueError):
    """The key's value is not a string or null (``type_name`` names the JSON type)."""

    def __init__(self, type_name: str):
        super().__init__(type_name)
        self.type_name = type_name


class MissingKey(ValueError):
    """The object has no such key; ``keys`` are the keys it has (the first 50)."""

    def __init__(self, keys: list[str]):
        super().__init__(", ".join(keys))
        self.keys = keys


def _safe_end(s: str, lo: int, end: int) -> int:
    """Largest ``e <= end`` such that the string body ``s[lo:e]`` does not end inside an escape or on a
    high-surrogate escape whose low half may follow."""
    e = end
    while True:
        j = s.rfind("\\", max(lo, e - 12), e)
        if j < 0:
            return e
        k = j
        while k > lo and s[k - 1] == "\\":
            k -= 1
        if (j - k) % 2:  # the second backslash of an escaped backslash: complete
            return e
        if j + 1 >= e or (s[j + 1] == "u" and j + 6 > e):
            e = j  # an escape cut by the end
            continue
        if s[j + 1] == "u" and "d800" <= s[j + 2 : j + 6].lower() <= "dbff" and e - (j + 6) < 6:
            e = j  # a high surrogate whose low half may come next
            continue
        return e


class _Parser:
    def __init__(self, fragments: Iterable[str]):
        self.it = iter(fragments)
        self.buf = ""
        self.pos = 0
        self.eof = False

    # -- buffer ------------------------------------------------------------------------------
    def fill(self, need: int = 1) -> bool:
        """At least ``need`` unread characters (True), unless the input ends first (False)."""
        while len(self.buf) - self.pos < need:
            if self.eof:
                return False
            frag = next(self.it, None)
            if frag is None:
                self.eof = True
                return len(self.buf) - self.pos >= need
            self.buf = self.buf[self.pos :] + frag
            self.pos = 0
        return True

    def peek(self) -> str:
        return self.buf[self.pos] if self.fill() else ""

    def ws(self) -> str:
        """Skip whitespace; the next character ('' at the end)."""
        while True:
            self.pos = _WS.match(self.buf, self.pos).end()
            if self.pos < len(self.buf):
                return self.buf[self.pos]
            if not self.fill():
                return ""

    def fail(self, what: str):
        raise JSONStreamError(what)

    def expect(self, c: str) -> None:
        got = self.ws()
        if got != c:
            self.fail(f"Expecting {_NAMES[c]}" if got else "Unexpected end of line")
        self.pos += 1

    # -- values ------------------------------------------------------------------------------
    def string(self) -> Iterator[str]:
        """The decoded body of the string at ``pos`` (its opening quote), in chunks."""
        self.pos += 1
        while True:
            end = _STRING_BODY.match(self.buf, self.pos).end()
            if end < len(self.buf) and self.buf[end] == '"':
                body, self.pos = self.buf[self.pos : end], end + 1
                if body:
                    yield self._decode(body)
                return
            safe = _safe_end(self.buf, self.pos, end)
            if safe > self.pos:
                body, self.pos = self.buf[self.pos : safe], safe
                yield self._decode(body)
            if not self.fill(len(self.buf) - self.pos + 1):
                self.fail("Unterminated string starting at a string of the record")

    def _decode(self, body: str) -> str:
        try:
            return json.loads('"' + body + '"')
        except json.JSONDecodeError as e:
            self.fail(e.msg)

    def key(self) -> str:
        if self.ws() != '"':
            self.fail("Expecting property name enclosed in double quotes")
        out, size = [], 0
        for chunk in self.string():
            if size < MAX_KEY:
                out.append(chunk[: MAX_KEY - size])
                size += len(out[-1])
        self.expect(":")
        return "".join(out) + ("..." if size >= MAX_KEY else "")

    def scalar(self, c: str) -> str:
        """Skip a string, number or literal starting with ``c``; its JSON type."""
        if c == '"':
            for _ in self.string():
                pass
            return "str"
        if c == "-" or c.isdigit():
            while True:
                end = _NUMBER_CHARS.match(self.buf, self.pos).end()
                if end < len(self.buf) or not self.fill(len(self.buf) - self.pos + 1):
                    break
                if end - self.pos > MAX_NUMBER:
                    self.fail(f"number longer than {MAX_NUMBER} characters")
            m = _NUMBER.match(self.buf, self.pos)
            if m is None or m.end() == self.pos:
                self.fail("Expecting value")
            is_float = any(ch in m.group() for ch in ".eE")
            self.pos = m.end()
            return "float" if is_float else "int"
        for word, name in (("true", "bool"), ("false", "bool"), ("null", "NoneType")):
            if c == word[0]:
                self.fill(len(word))
                if self.buf.startswith(word, self.pos):
                    self.pos += len(word)
                    return name
        self.fail("Expecting value")

    def skip(self) -> str:
        """Skip one value (any depth); its JSON type."""
        c = self.ws()
        if c not in "{[" or not c:
            return self.scalar(c) if c else self.fail("Expecting value")
        kind = "dict" if c == "{" else "list"
        stack: list[str] = []
        while True:
            c = self.ws()
            if c in "{[" and c:
                self.pos += 1
                close = "}" if c == "{" else "]"
                if self.ws() == close:
                    self.pos += 1
                else:
                    stack.append(close)
                    if len(stack) > MAX_DEPTH:
                        self.fail(f"nested deeper than {MAX_DEPTH} levels")
                    if close == "}":
                        self.key()
                    continue
            elif c:
                self.scalar(c)
            else:
                self.fail("Expecting value")
            while stack:  # after a value: a comma (next member) or the container's end
                c = self.ws()
                if c == ",":
                    self.pos += 1
                    if stack[-1] == "}":
                        self.key()
                    break
                if c != stack[-1]:
                    self.fail("Expecting ',' delimiter" if c else "Unexpected end of line")
                self.pos += 1
                stack.pop()
            if not stack:
                return kind


_NAMES = {":": "':' delimiter", "{": "'{'", ",": "',' delimiter"}


def object_text(fragments: Iterable[str], key: str) -> Iterator[str]:
    """Decoded text of the string under ``key`` in the one JSON object the fragments hold, in chunks
    (nothing for ``null``). Raises ``JSONStreamError`` (invalid JSON), ``TypeError`` (not an object:
    the message is the JSON type), ``KeyTypeError`` (a value other than a string or null) or
    ``MissingKey``."""
    p = _Parser(fragments)
    c = p.ws()
    if c != "{":
        if not c:
            p.fail("Expecting value")
        kind = p.skip()
        if p.ws():
            p.fail("Extra data")
        raise TypeError(kind)
    p.pos += 1
    keys: list[str] = []
    found = False
    wrong = None  # the key's value is of this other type (raised once the record is known to be valid)
    if p.ws() == "}":
        p.pos += 1
    else:
        while True:
            name = p.key()
            if len(keys) < 50:
                keys.append(name)
            if name == key:
                if found:
                    p.fail(f"key {key!r} appears twice (a record this long is read once)")
                found = True
                c = p.ws()
                if c == '"':
                    yield from p.string()
                else:
                    kind = p.skip()
                    wrong = kind if kind != "NoneType" else None
            else:
                p.skip()
            c = p.ws()
            p.pos += 1
            if c == "}":
                break
            if c != ",":
                p.fail("Expecting ',' delimiter" if c else "Unexpected end of line")
    if p.ws():
        p.fail("Extra data")
    if not found:
        raise MissingKey(keys)
    if wrong is not None:
        raise KeyTypeError(wrong)
