"""Streaming writer of megatron-core ``IndexedDataset`` shards (.bin + .idx), pure numpy.

Byte-identical to ``megatron.core.datasets.indexed_dataset.IndexedDatasetBuilder`` with one
sequence per document: .idx = ``MMIDIDX\\x00\\x00``, version ``<Q 1``, dtype code ``<B``, sequence
count ``<Q``, document count ``<Q`` (sequences + 1), int32 sequence lengths, int64 byte pointers,
int64 document indices ``0..n``. Not importing megatron-core keeps torch out of the preprocessing
workers; tests check the bytes against ``IndexedDatasetBuilder`` and read shards with
``IndexedDataset``. The .bin sha256 is computed while writing.
"""

from __future__ import annotations

import hashlib
import os
import struct

import numpy as np

INDEX_HEADER = b"MMIDIDX\x00\x00"
DTYPE_CODES = {
    np.dtype(np.uint8): 1,
    np.dtype(np.int8): 2,
    np.dtype(np.int16): 3,
    np.dtype(np.int32): 4,
    np.dtype(np.int64): 5,
    np.dtype(np.float64): 6,
    np.dtype(np.float32): 7,
    np.dtype(np.uint16): 8,
}


def optimal_token_dtype(vocab_size: int) -> np.dtype:
    """megatron-core's ``DType.optimal_dtype``: uint16 below 65,500 ids, else int32."""
    return np.dtype(np.uint16) if vocab_size < 65500 else np.dtype(np.int32)


class IndexedShardWriter:
    """Append documents (one sequence each) to ``bin_path``; ``finalize`` writes ``idx_path``.

    Memory does not grow with the number of documents: their lengths go to ``lengths_path`` (int32,
    default ``idx_path + ".lengths"``, removed by ``finalize``/``close``) in blocks, the last one held
    back while a following call may continue it, and ``finalize`` writes the index from that file in
    blocks (lengths, pointers from a running sum, document indices)."""

    FLUSH = 1 << 16  # lengths kept in memory before they are appended to the lengths file
    BLOCK = 1 << 20  # index entries per block when the index is written

    def __init__(self, bin_path: str, idx_path: str, dtype, lengths_path: str | None = None):
        self.bin_path, self.idx_path = bin_path, idx_path
        self.dtype = np.dtype(dtype)
        if self.dtype not in DTYPE_CODES:
            raise ValueError(f"dtype {self.dtype} has no IndexedDataset code")
        self.lengths_path = lengths_path or idx_path + ".lengths"
        self._file = open(bin_path, "wb")
        self._lengths_file = open(self.lengths_path, "wb")
        self._sha = hashlib.sha256()
        self._pending: list[np.ndarray] = []  # completed lengths not yet in the file
        self._pending_n = 0
        self._last: int | None = None  # the last document's length (a later call may continue it)
        self.documents = 0
        self.num_elements = 0
        self.bin_sha256 = self.idx_sha256 = None

    def add_documents(self, data: np.ndarray, lengths: np.ndarray, continue_last: bool = False) -> None:
        """Write concatenated documents ``data`` (1-D) whose element counts are ``lengths``; with
        ``continue_last`` the first of them continues the last document written (a long document
        written in parts stays one sequence)."""
        data = np.ascontiguousarray(data, dtype=self.dtype).reshape(-1)
        lengths = np.asarray(lengths, dtype=np.int64).reshape(-1)
        if int(lengths.sum()) != data.size:
            raise ValueError(f"lengths sum {int(lengths.sum())} != {data.size} elements")
        if continue_last and len(lengths):
            if self._last is None:
                raise ValueError("no document to continue")
            self._last += int(lengths[0])
            lengths = lengths[1:]
        if len(lengths):
            if self._last is not None:
                self._keep(np.array([self._last], np.int64))
            self._keep(lengths[:-1])
            self._last = int(lengths[-1])
            self.documents += len(lengths)
        view = memoryview(data).cast("B")
        self._file.write(view)
        self._sha.update(view)
        self.num_elements += data.size

    def _keep(self, lengths: np.ndarray) -> None:
        if not len(lengths):
            return
        if int(lengths.max()) >= 2**31:
            raise ValueError("a document is longer than 2^31 - 1 elements")
        self._pending.append(lengths.astype(np.int32))
        self._pending_n += len(lengths)
        if self._pending_n >= self.FLUSH:
            self._flush()

    def _flush(self) -> None:
        if self._pending:
            self._lengths_file.write(np.concatenate(self._pending).tobytes())
        self._pending, self._pending_n = [], 0

    def finalize(self) -> None:
        """Close the .bin and write the .idx."""
        self._file.close()
        if self._last is not None:
            self._keep(np.array([self._last], np.int64))
            self._last = None
        self._flush()
        self._lengths_file.close()
        n = self.documents
        sha = hashlib.sha256()
        with (
            open(self.idx_path, "wb") as f,
            open(self.lengths_path, "rb") as lengths,
        ):  # read, not mapped: RSS stays flat

            def put(b: bytes) -> None:
                f.write(b)
                sha.update(b)

            put(
                INDEX_HEADER
                + struct.pack("<Q", 1)
                + struct.pack("<B", DTYPE_CODES[self.dtype])
                + struct.pack("<QQ", n, n + 1)
            )
            for _ in range(0, n, self.BLOCK):
                put(lengths.read(4 * self.BLOCK))
            lengths.seek(0)
            offset = 0
            for _ in range(0, n, self.BLOCK):
                sizes = np.frombuffer(lengths.read(4 * self.BLOCK), np.int32).astype(np.int64) * self.dtype.itemsize
                pointers = np.empty(len(sizes), np.int64)
                pointers[0] = offset
                np.cumsum(sizes[:-1], out=pointers[1:])
                pointers[1:] += offset
                offset += int(sizes.sum())
                put(pointers.tobytes())
            for k in range(0, n + 1, self.BLOCK):
                put(np.arange(k, min(k + self.BLOCK, n + 1), dtype=np.int64).tobytes())
        os.remove(self.lengths_path)
        self.bin_sha256 = self._sha.hexdigest()
        self.idx_sha256 = sha.hexdigest()

    def close(self) -> None:
        """Close the files without writing the index (on failure); the lengths file is removed."""
        for f in (self._file, self._lengths_file):
            if not f.closed:
                f.close()
        try:
            os.remove(self.lengths_path)
        except FileNotFoundError:
            pass
