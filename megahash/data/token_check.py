"""Token ids and word codes checked where the loader reads them from the shards.

``data.verify=cheap`` checks sizes, headers and counts before step 1, not contents (that is ``full``'s
sha256 pass), so a ``.bin`` damaged in place reaches the loader. :func:`check_range` runs on every
sample the dataset cuts (``HashGPTDataset.__getitem__``: the training split, the validation split
and the ``data.valid`` sets): one ``max`` over the sample's ids (and a ``min`` for a signed dtype), a
``min``/``max`` over its codes for bucket and rolling specs, whose values index tables -- 7-8 µs a sample,
~0.1 ms a step of the quickstart (benchmarks/results/2026-11-27_token_check_cpu.md) -- and, only when a
value is out of range, a walk over the sample's spans to name
the shard file, the document and the position. A damaged value inside the range cannot be told from a
real one here: ``data.verify=full`` (or ``inspect_shards.py --verify``) finds those.
"""

from __future__ import annotations

import numpy as np

from megahash.errors import DataError


class CorruptShardError(DataError):
    """A value read from a shard is out of range (one line; also when re-raised from a DataLoader
    worker, whose wrapper prepends its traceback to the message)."""

    def __init__(self, msg: str = ""):
        if "\nOriginal Traceback" in msg:  # torch's ExceptionWrapper.reraise: keep our own last line
            msg = msg.rstrip().splitlines()[-1].split(": ", 1)[-1]
        super().__init__(msg)


def code_range(spec) -> tuple[int, int] | None:
    """``[low, high)`` of a hash spec's code values (None: every value of the dtype is valid)."""
    from megahash.hashing.specs import parse_hash_spec

    return (parse_hash_spec(spec) if isinstance(spec, str) else spec).value_range


def check_range(
    values: np.ndarray, low: int, high: int, parts, path: str, prefix: str, what: str, width: int = 1
) -> None:
    """Raise ``CorruptShardError`` naming the first value of ``values`` outside ``[low, high)``.
    ``parts``: the ``(document, offset, tokens)`` spans the sample was cut from, in order (``width``
    values per token); ``path``: the shard (without ``.bin``); ``prefix``: its set."""
    if not values.size:
        return
    if values.dtype.kind == "u" and low <= 0:  # token ids are unsigned: one max, no min
        if int(values.max()) < high:
            return
    elif int(values.min()) >= low and int(values.max()) < high:
        return
    flat = values.reshape(-1)
    bad = int(np.flatnonzero((flat < low) | (flat >= high))[0])
    token = bad // width
    where = ""
    for doc, offset, n in parts:
        if token < n:
            where = f" document {doc}, token {offset + token}"
            break
        token -= n
    raise CorruptShardError(
        f"{path}.bin{where}: {what} {int(flat[bad])} is outside [{low}, {high}): the shard is damaged "
        f"(data.verify=cheap checks sizes, not contents); `python data_tools/inspect_shards.py {prefix} --verify` "
        f"finds the damaged files; rebuild the set with data_tools/preprocess_data.py or restore it"
    )
