"""Hash spec grammar: which word codes a side shard holds ([Xue25] sec. 2.3; [Cohn23]).

=================  ==========  =====  =====  ==============================================
spec               kind        dtype  width  code of one token
=================  ==========  =====  =====  ==============================================
``md5``            md5         uint8  16     128 HMAC-MD5 bits, packed MSB first
``md5-bucketN``    md5-bucket  int32  1      HMAC-MD5 value mod N (Emb(N))
``lshT``           lsh         uint8  T/8    T hyperplane bits, packed MSB first (T % 8 == 0)
``lsh-bucketN``    lsh-bucket  int32  1      circulant-LSH argmax bucket in [0, N)
``rollingN``       rolling     int32  W      i-gram rolling hashes, i = 1..N, words cut to 16
``rollingN-lenL``  rolling     int32  W      same with words cut to L chars; W = Σ (L - i + 1)
=================  ==========  =====  =====  ==============================================
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from megahash.hashing.md5 import MD5_BITS, MD5_BYTES
from megahash.hashing.rolling import DEFAULT_MAX_LEN, rolling_width

VALID_FORMS = "md5, md5-bucketN, lshT (T a multiple of 8), lsh-bucketN, rollingN, rollingN-lenL"
_MAX_BUCKETS = 2**31 - 1

_PATTERNS = [
    (re.compile(r"md5"), "md5"),
    (re.compile(r"md5-bucket([1-9][0-9]*)"), "md5-bucket"),
    (re.compile(r"lsh([1-9][0-9]*)"), "lsh"),
    (re.compile(r"lsh-bucket([1-9][0-9]*)"), "lsh-bucket"),
    (re.compile(r"rolling([1-9][0-9]*)(?:-len([1-9][0-9]*))?"), "rolling"),
]


@dataclass(frozen=True)
class HashSpec:
    """One side-shard code: ``width`` elements of ``dtype`` per token."""

    name: str
    kind: str
    width: int
    dtype: np.dtype
    params: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    @property
    def is_bits(self) -> bool:
        """True for packed bit codes (md5, lshT)."""
        return self.kind in ("md5", "lsh")

    @property
    def num_bits(self) -> int:
        """Bits per token for bit codes (8 · width), 0 otherwise."""
        return 8 * self.width if self.is_bits else 0

    @property
    def value_range(self) -> tuple[int, int] | None:
        """``[low, high)`` of the code values (None: every value of the dtype is valid): a bucket spec's buckets,
        the rolling hash's modulus (-1 pads the partitions of short words)."""
        if self.kind in ("md5-bucket", "lsh-bucket"):
            return 0, int(self.params["buckets"])
        if self.kind == "rolling":
            from megahash.hashing.rolling import ROLLING_M

            return -1, ROLLING_M
        return None

    def to_meta(self) -> dict[str, Any]:
        """JSON-able description (name, kind, width, dtype, params)."""
        return {
            "name": self.name,
            "kind": self.kind,
            "width": self.width,
            "dtype": self.dtype.name,
            "params": dict(self.params),
        }


def _bad(text: str, why: str = "") -> ValueError:
    extra = f" ({why})" if why else ""
    return ValueError(f"unknown hash spec {text!r}{extra}; valid forms: {VALID_FORMS}")


def parse_hash_spec(text: str) -> HashSpec:
    """Parse one spec such as ``md5``, ``lsh128``, ``md5-bucket50000``, ``rolling3``."""
    name = text.strip().lower()
    for pattern, kind in _PATTERNS:
        m = pattern.fullmatch(name)
        if not m:
            continue
        if kind == "md5":
            return HashSpec(name, kind, MD5_BYTES, np.dtype(np.uint8), {"bits": MD5_BITS})
        if kind in ("md5-bucket", "lsh-bucket"):
            n = int(m.group(1))
            if n > _MAX_BUCKETS:
                raise _bad(text, f"N must be < 2^31, got {n}")
            return HashSpec(name, kind, 1, np.dtype(np.int32), {"buckets": n})
        if kind == "lsh":
            t = int(m.group(1))
            if t % 8 or t > 8192:
                raise _bad(text, f"T must be a multiple of 8 and <= 8192, got {t}")
            return HashSpec(name, kind, t // 8, np.dtype(np.uint8), {"bits": t})
        n = int(m.group(1))
        max_len = int(m.group(2)) if m.group(2) else DEFAULT_MAX_LEN
        if n > 16 or max_len > 256 or n > max_len:
            raise _bad(text, f"need N <= 16, L <= 256, N <= L; got N={n}, L={max_len}")
        return HashSpec(name, kind, rolling_width(n, max_len), np.dtype(np.int32), {"n": n, "max_len": max_len})
    raise _bad(text)


def parse_hash_specs(text: str) -> list[HashSpec]:
    """Parse a comma-separated list (``"md5,lsh128"``); empty text gives []; duplicates are an error."""
    specs = [parse_hash_spec(part) for part in text.split(",") if part.strip()]
    names = [s.name for s in specs]
    for n in names:
        if names.count(n) > 1:
            raise ValueError(f"hash spec {n!r} given twice")
    return specs
