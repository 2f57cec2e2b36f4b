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
    """Append documents (one sequence each) to ``bin_path``; ``finalize`` writes ``idx_path``."""

    def __init__(self, bin_path: str, idx_path: str, dtype):
        self.bin_path, self.idx_path = bin_path, idx_path
        self.dtype = np.dtype(dtype)
        if self.dtype not in DTYPE_CODES:
            raise ValueError(f"dtype {self.dtype} has no IndexedDataset code")
        self._file = open(bin_path, "wb")
        self._sha = hashlib.sha256()
        self._lengths: list[np.ndarray] = []
        self.num_elements = 0
        self.bin_sha256 = self.idx_sha256 = None

    def add_documents(self, data: np.ndarray, lengths: np.ndarray, continue_last: bool = False) -> None:
        """Write concatenated documents ``data`` (1-D) whose element counts are ``lengths``; with
        ``continue_last`` the first of them continues the last document written (a long document
        written in parts stays one sequence)."""
        data = np.ascontiguousarray(data, dtype=self.dtype).reshape(-1)
        lengths = np.array(lengths, dtype=np.int64)
        if int(lengths.sum()) != data.size:
            raise ValueError(f"lengths sum {int(lengths.sum())} != {data.size} elements")
        if continue_last and len(lengths):
            if not self._lengths:
                raise ValueError("no document to continue")
            self._lengths[-1][-1] += lengths[0]
            lengths = lengths[1:]
        view = memoryview(data).cast("B")
        self._file.write(view)
        self._sha.update(view)
        if len(lengths):
            self._lengths.append(lengths)
        self.num_elements += data.size

    def finalize(self) -> None:
        """Close the .bin and write the .idx."""
        self._file.close()
        lengths = np.concatenate(self._lengths) if self._lengths else np.zeros(0, np.int64)
        if lengths.size and lengths.max() >= 2**31:
            raise ValueError("a document is longer than 2^31 - 1 elements")
        pointers = np.zeros(lengths.size, np.int64)
        if lengths.size > 1:
            np.cumsum(lengths[:-1] * self.dtype.itemsize, out=pointers[1:])
        n = lengths.size
        parts = [
            INDEX_HEADER,
            struct.pack("<Q", 1),
            struct.pack("<B", DTYPE_CODES[self.dtype]),
            struct.pack("<Q", n),
            struct.pack("<Q", n + 1),
            lengths.astype(np.int32).tobytes(order="C"),
            pointers.tobytes(order="C"),
            np.arange(n + 1, dtype=np.int64).tobytes(order="C"),
        ]
        blob = b"".join(parts)
        with open(self.idx_path, "wb") as f:
            f.write(blob)
        self.bin_sha256 = self._sha.hexdigest()
        self.idx_sha256 = hashlib.sha256(blob).hexdigest()

    def close(self) -> None:
        """Close the .bin without writing the index (on failure)."""
        if not self._file.closed:
            self._file.close()
