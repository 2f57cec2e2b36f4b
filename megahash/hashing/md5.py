"""HashFormers-MD: 128-bit HMAC-MD5 word codes ([Xue25] sec. 2.3.2 and 2.3.5).

The code of a word is HMAC-MD5 with a secret key (default ``b"en"``, as in the reference code) over
the word's UTF-8 bytes. Its 128 bits are read most-significant first: bit ``j`` is
``(digest[j // 8] >> (7 - j % 8)) & 1``, so the packed form is the digest bytes as they are
(``np.packbits``/``np.unpackbits`` order). The Emb(N) bucket is ``int.from_bytes(digest, "big") % N``
(sec. 2.3.2: "transform its binary value into decimal and then compute the index i = v % N").
``key=None`` gives plain MD5 (not used by HashFormers; handy for checks against ``hashlib.md5``).
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence

import numpy as np

DEFAULT_KEY = b"en"
MD5_BITS = 128
MD5_BYTES = 16


def _utf8(word: str) -> bytes:
    return word.encode("utf-8", "surrogatepass")


def md5_digest(word: str, key: bytes | None = DEFAULT_KEY) -> bytes:
    """16-byte HMAC-MD5(key, word) (plain MD5 when ``key`` is None)."""
    if key is None:
        return hashlib.md5(_utf8(word)).digest()
    return hmac.digest(key, _utf8(word), "md5")


def md5_digests(words: Sequence[str], key: bytes | None = DEFAULT_KEY) -> bytes:
    """Concatenated digests of ``words`` (16 bytes each)."""
    if key is None:
        return b"".join(hashlib.md5(_utf8(w)).digest() for w in words)
    digest = hmac.digest
    return b"".join(digest(key, _utf8(w), "md5") for w in words)


def md5_bits(words: Sequence[str], key: bytes | None = DEFAULT_KEY) -> np.ndarray:
    """Packed codes ``uint8 [len(words), 16]``: the digest bytes, i.e. the 128 bits MSB first."""
    buf = md5_digests(words, key)
    return np.frombuffer(buf, dtype=np.uint8).reshape(len(words), MD5_BYTES).copy()


def md5_buckets(words: Sequence[str], num_buckets: int, key: bytes | None = DEFAULT_KEY) -> np.ndarray:
    """Emb(N) bucket ids ``int64 [len(words)]``: the digest as a big-endian integer modulo N."""
    if num_buckets < 1:
        raise ValueError(f"num_buckets must be >= 1, got {num_buckets}")
    buf = md5_digests(words, key)
    frm = int.from_bytes
    return np.array(
        [frm(buf[i : i + MD5_BYTES], "big") % num_buckets for i in range(0, len(buf), MD5_BYTES)],
        dtype=np.int64,
    ).reshape(len(words))
