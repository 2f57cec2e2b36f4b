"""Verification of a shard set against its ``PREFIX_meta.json`` (one implementation for training and
``data_tools/inspect_shards.py --verify``).

Two levels (``data.verify``):

- ``cheap`` (always, before step 1): the meta exists and is readable; every file it lists exists with
  the byte size it records; every ``.idx`` (token shard and each hash side shard) has megatron-core's
  header (``MMIDIDX\\x00\\x00``, version 1), the dtype the meta records, one sequence per document,
  as many documents and tokens as the meta counts, pointers that follow from the lengths, and a
  ``.bin`` exactly as long as the index says; side-shard lengths are ``width`` x token lengths.
  Reads only the ``.idx`` files (memory-mapped) and file sizes: milliseconds for the test shards.
- ``full``: the above plus the sha256 of every file listed in the meta.

Every mismatch is one line (:class:`DataError`) naming the file and the fix. Pure numpy: the
``.idx`` layout is the one ``megahash/data/preprocess/indexed_writer.py`` writes (megatron-core's).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from dataclasses import dataclass

import numpy as np

from megahash.errors import DataError

INDEX_HEADER = b"MMIDIDX\x00\x00"
# megatron-core DType codes (indexed_dataset.DType)
DTYPE_OF_CODE = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
TOKENS_SUFFIX = "_text_document"
META_SUFFIX = "_meta.json"
SUPPORTED_FORMAT = 1
LEVELS = ("cheap", "full", "none")


def base_prefix(prefix: str) -> str:
    return prefix[: -len(TOKENS_SUFFIX)] if prefix.endswith(TOKENS_SUFFIX) else prefix


def token_path(prefix: str) -> str:
    """Shard prefix (as given to preprocess_data --output-prefix) -> megatron dataset path."""
    return prefix if prefix.endswith(TOKENS_SUFFIX) else prefix + TOKENS_SUFFIX


def blend_paths(prefixes: list[str]) -> tuple[list[str], list[float] | None]:
    """``data.prefix``: ``[p1, p2]`` or ``[w1, p1, w2, p2]`` (Megatron's --data-path form) -> (paths, weights)."""
    try:
        weights = [float(x) for x in prefixes[0::2]]
        paths = prefixes[1::2]
        if len(weights) == len(paths) and paths:
            return [token_path(p) for p in paths], weights
    except ValueError:
        pass
    return [token_path(p) for p in prefixes], None


def check_side_shards(paths: list[str], spec: str | None, embedding: str, meta: dict) -> None:
    """The side shard of hash spec ``spec`` (the one the model reads; None: none) exists for every set of the
    ``data.prefix`` blend; ``meta``: the first set's, whose specs the message offers."""
    if not spec:
        return
    for p in paths:
        side = f"{base_prefix(p)}_hash_{spec}"
        if not (os.path.isfile(side + ".bin") and os.path.isfile(side + ".idx")):
            have = sorted(s["name"] for s in meta.get("hash_specs", []) if isinstance(s, dict) and "name" in s)
            other = f"set model.embed.hash_spec to one of {have}" if have else "use a model without hash codes"
            raise DataError(
                f"model.embedding={embedding} reads hash spec {spec!r} but {side}.bin/.idx does not exist; "
                f"re-run preprocess_data.py with --word-hashes {spec} or {other}"
            )


def check_prefix(prefix: str) -> None:
    """The token shard's ``.bin``/``.idx`` exist (one line naming the command that builds them)."""
    path = token_path(prefix)
    for ext in (".bin", ".idx"):
        if not os.path.isfile(path + ext):
            raise DataError(
                f"data shard {path + ext} does not exist; build it with "
                f"`python data_tools/preprocess_data.py --output-prefix {base_prefix(prefix)} ...` or fix data.prefix"
            )


def _fix(prefix: str) -> str:
    return (
        f"rebuild the set with `python data_tools/preprocess_data.py --output-prefix {prefix} ...` "
        f"(or restore the file from where it came)"
    )


_HASHED: dict[tuple, str] = {}  # (path, device, inode, size, mtime_ns) -> sha256, files verified by this process


def sha256_file(path: str, remember: bool = False) -> str:
    """Hex sha256 of a file (the one implementation: shard metas, the data stage, checkpoints).
    ``remember``: a file hashed so before by this process and unchanged since (same inode, size and
    mtime) is not read again (shard verification: ``pretrain.py`` verifies ``data.verify=full`` sets
    before torch is imported and again when the data loader is built)."""
    st = os.stat(path)
    key = (os.path.abspath(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    if remember and key in _HASHED:
        return _HASHED[key]
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    if remember:
        _HASHED[key] = h.hexdigest()
    return h.hexdigest()


def read_meta(prefix: str | None, required: bool = True) -> dict:
    """The meta of a shard set (the one reader of ``PREFIX_meta.json``). A set without one is refused
    (preprocess writes it last, so its absence means the set is incomplete or not a megahash set);
    ``required=False``: {} without a prefix or a meta (callers looking up optional facts: the
    tokenizer, the stream), a meta that exists is still checked."""
    if not prefix and not required:
        return {}
    prefix = base_prefix(prefix)
    path = prefix + META_SUFFIX
    try:
        with open(path, encoding="utf-8") as f:
            meta = json.load(f)
    except FileNotFoundError:
        if not required:
            return {}
        if os.path.exists(prefix + TOKENS_SUFFIX + ".bin"):
            raise DataError(
                f"shard set {prefix} has no {os.path.basename(path)}: it is incomplete (an interrupted "
                f"preprocess?); re-run data_tools/preprocess_data.py with the same arguments"
            ) from None
        raise DataError(f"no shards at prefix {prefix!r} ({path} not found)") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise DataError(f"corrupt shard meta {path} ({e}); {_fix(prefix)}") from None
    if not isinstance(meta, dict) or meta.get("format_version") != SUPPORTED_FORMAT:
        got = meta.get("format_version") if isinstance(meta, dict) else None
        raise DataError(
            f"{path}: shard format {got!r}, this reader reads {SUPPORTED_FORMAT} (not a megahash shard meta, or one "
            f"of another version); rebuild the set with this megahash: "
            f"`python data_tools/preprocess_data.py --output-prefix {prefix} ...`"
        )
    bad = _misshapen_record(meta)
    if bad:
        raise DataError(f"damaged shard meta {path} ({bad}); {_fix(prefix)}")
    return meta


# the records preprocess writes (preprocess_data.py) and their JSON shapes; null stands for "none" where allowed
_RECORDS = {
    "stream": dict,
    "tokenizer": dict,
    "inputs": dict,
    "counts": dict,
    "files": dict,
    "hash_specs": list,
    "lsh": dict,
}
_REQUIRED = ("stream", "tokenizer")
_JSON_NAMES = {
    dict: "an object",
    list: "an array",
    str: "a string",
    int: "a number",
    float: "a number",
    bool: "a boolean",
}


def _misshapen_record(meta: dict) -> str | None:
    """What is wrong with the shape of a shard meta's records (None: nothing), so that every reader can index
    them (``meta["stream"]["kind"]``, ``meta["tokenizer"].get(...)``) without guarding each access."""
    for key, kind in _RECORDS.items():
        value = meta.get(key)
        if value is None and key not in _REQUIRED:
            continue
        if not isinstance(value, kind):
            got = _JSON_NAMES.get(type(value), "null") if key in meta else "missing"
            return f"its {key!r} record is {got}, not {_JSON_NAMES[kind]}"
    if not isinstance(meta["stream"].get("kind"), str):
        return "its stream record has no kind"
    if not all(isinstance(d, dict) and isinstance(d.get("name"), str) for d in meta.get("hash_specs") or []):
        return "a hash_specs entry is not an object with a name"
    return None


@dataclass
class IndexFile:
    """The parsed ``.idx`` of one ``IndexedDataset``."""

    path: str
    dtype: np.dtype
    lengths: np.ndarray  # int32 [n]
    pointers: np.ndarray  # int64 [n]
    document_indices: np.ndarray  # int64 [d]


def read_index(idx_path: str, fix: str) -> IndexFile:
    """Parse an ``.idx`` (memory-mapped arrays); DataError if its header or size is not megatron's."""
    try:
        size = os.path.getsize(idx_path)
        with open(idx_path, "rb") as f:
            head = f.read(9 + 8 + 1 + 8 + 8)
    except OSError as e:
        raise DataError(f"cannot read shard index {idx_path} ({e.strerror}); {fix}") from None
    if len(head) < 34 or head[:9] != INDEX_HEADER:
        raise DataError(f"{idx_path} is not a megatron-core IndexedDataset index (bad header); {fix}")
    (version,) = struct.unpack("<Q", head[9:17])
    code = head[17]
    n, d = struct.unpack("<QQ", head[18:34])
    if version != 1 or code not in DTYPE_OF_CODE:
        raise DataError(f"{idx_path}: index version {version} / dtype code {code} unknown; {fix}")
    want = 34 + n * 4 + n * 8 + d * 8
    if size != want:
        raise DataError(
            f"{idx_path} has {size} bytes, its header ({n} sequences, {d} documents) needs {want}; "
            f"it is truncated or damaged; {fix}"
        )
    mm = np.memmap(idx_path, dtype=np.uint8, mode="r")
    lengths = np.frombuffer(mm, dtype=np.int32, count=n, offset=34)
    pointers = np.frombuffer(mm, dtype=np.int64, count=n, offset=34 + 4 * n)
    docs = np.frombuffer(mm, dtype=np.int64, count=d, offset=34 + 12 * n)
    return IndexFile(idx_path, np.dtype(DTYPE_OF_CODE[code]), lengths, pointers, docs)


def check_pair(
    path_prefix: str,
    dtype,
    documents: int,
    elements: int,
    fix: str,
    lengths_like: np.ndarray | None = None,
    width: int = 1,
) -> IndexFile:
    """One ``.bin``/``.idx`` pair against what the meta says: dtype, documents, elements, pointers,
    ``.bin`` size, and (side shards) lengths = ``width`` x the token shard's."""
    idx_path, bin_path = path_prefix + ".idx", path_prefix + ".bin"
    for p in (bin_path, idx_path):
        if not os.path.isfile(p):
            raise DataError(f"missing shard file {p}; {fix}")
    ix = read_index(idx_path, fix)
    n = len(ix.lengths)
    if ix.dtype != np.dtype(dtype):
        raise DataError(
            f"{idx_path} holds {ix.dtype.name}, the meta says {np.dtype(dtype).name}: it is from another build; {fix}"
        )
    if n != documents or not np.array_equal(ix.document_indices, np.arange(n + 1)):
        raise DataError(f"{idx_path} has {n} documents, the meta says {documents}: it is from another build; {fix}")
    lengths = ix.lengths.astype(np.int64)
    if int(lengths.sum()) != elements:
        raise DataError(
            f"{idx_path} indexes {int(lengths.sum())} elements, the meta says {elements}: it is from "
            f"another build; {fix}"
        )
    if lengths_like is not None and not np.array_equal(lengths, lengths_like * width):
        bad = int(np.flatnonzero(lengths != lengths_like * width)[0])
        raise DataError(
            f"{idx_path} document {bad}: length {int(lengths[bad])} != {width} x {int(lengths_like[bad])} "
            f"tokens of the token shard; {fix}"
        )
    item = ix.dtype.itemsize
    expect = np.zeros(n, np.int64)
    if n > 1:
        np.cumsum(lengths[:-1] * item, out=expect[1:])
    if not np.array_equal(ix.pointers, expect):
        raise DataError(f"{idx_path} has inconsistent pointers: it is damaged; {fix}")
    bin_size = os.path.getsize(bin_path)
    if bin_size != elements * item:
        raise DataError(
            f"{bin_path} has {bin_size} bytes, its index needs {elements * item}: it is truncated or from "
            f"another build; {fix}"
        )
    return ix


def check_files(prefix: str, meta: dict, checksums: bool, fix: str | None = None) -> int:
    """Every file the meta lists: present, with its size, and (``checksums``) its sha256. Returns the
    number of files checked."""
    files = meta.get("files", {}) or {}
    for name in files:
        check_listed_file(prefix, meta, name, checksums, fix)
    return len(files)


def check_listed_file(prefix: str, meta: dict, name: str, checksums: bool, fix: str | None = None) -> str:
    """One file ``name`` of the set that the meta lists (``files``): present, with its size, and (``checksums``)
    its sha256. Returns its path; a file the meta does not list is only located."""
    prefix = base_prefix(prefix)
    fix = fix or _fix(prefix)
    path = os.path.join(os.path.dirname(prefix), name)
    info = (meta.get("files", {}) or {}).get(name)
    if info is None:
        return path
    if not os.path.exists(path):
        raise DataError(f"file {path} listed in the meta is missing; {fix}")
    size = os.path.getsize(path)
    if size != info["bytes"]:
        raise DataError(
            f"{path} has {size} bytes, the meta says {info['bytes']}: it is truncated or from another build; {fix}"
        )
    if checksums and sha256_file(path, remember=True) != info["sha256"]:
        raise DataError(f"sha256 of {path} does not match the meta: it is damaged or from another build; {fix}")
    return path


def verify_set(prefix: str, level: str = "cheap", specs=None, meta: dict | None = None) -> dict:
    """Check the shard set at ``prefix`` (module docstring). ``specs``: the hash side shards to check
    (None = all in the meta). Returns a summary; raises DataError (one line) on the first problem."""
    if level not in LEVELS:
        raise DataError(f"data.verify must be one of {', '.join(LEVELS)}, got {level!r}")
    prefix = base_prefix(prefix)
    meta = read_meta(prefix) if meta is None else meta
    if level == "none":
        return {"level": level}
    fix = _fix(prefix)
    n_files = check_files(prefix, meta, checksums=(level == "full"), fix=fix)
    counts = meta.get("counts", {})
    stream = meta.get("stream", {})
    try:
        n_docs, n_tok = int(counts["documents"]), int(counts["tokens"])
    except (KeyError, TypeError, ValueError):
        raise DataError(f"{prefix}{META_SUFFIX} lacks document/token counts; {fix}") from None
    tok = check_pair(prefix + TOKENS_SUFFIX, stream.get("dtype", "uint16"), n_docs, n_tok, fix)
    lengths = tok.lengths.astype(np.int64)
    known = {d["name"]: d for d in meta.get("hash_specs", [])}
    checked = []
    for name in list(known) if specs is None else list(specs):
        d = known.get(name)
        if d is None:
            raise DataError(f"hash spec {name!r} not in shards {prefix!r} (have: {', '.join(known) or 'none'})")
        width = int(d["width"])
        path = os.path.join(os.path.dirname(prefix), d["file"]) if d.get("file") else f"{prefix}_hash_{name}"
        check_pair(path, d["dtype"], n_docs, n_tok * width, fix, lengths_like=lengths, width=width)
        checked.append(name)
    return {
        "level": level,
        "documents": n_docs,
        "tokens": n_tok,
        "checked_files": n_files if level == "full" else 0,
        "sized_files": n_files,
        "side_shards": checked,
    }
