"""Content digests of checkpoint files: sha256 in 8 MiB blocks, several files at once.

sha256 rather than blake2b: the x86 SHA extensions (and ARMv8's) make it the faster of the two where
checkpoints are written (1.67 against 0.92 GB/s a core on the 2-core CPU here), it is what the data
stage's ``data.verify=full`` uses (megahash/data/verify.py), and a cryptographic hash lets a signed
manifest vouch for every file. hashlib releases the GIL while it hashes, so a thread pool hashes
files in parallel beside the rest of a save.

Every rank hashes the files it wrote itself, as each is complete (:class:`Hasher`, fed by the save:
megahash/training/checkpoint.py, and by each background writer of ``train.async_save``), and leaves
the digests in a sidecar ``.sha256-*.json`` in the checkpoint folder; rank 0 folds the sidecars into
``manifest.json`` when it publishes the checkpoint (manifest.write_manifest) and hashes only what no
sidecar covers (a few small files). A sidecar is checked against the file's size before it is used.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ALGORITHM = "sha256"
BLOCK = 8 << 20  # bytes read per hash update
SIDECAR = ".sha256-"  # sidecar names: .sha256-<label>-rank<R>.json in the checkpoint folder


def threads() -> int:
    """Hashing threads: the CPUs this process may use, at most 4 (each hashes ~1.7 GB/s)."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 1
    return max(1, min(4, n))


def file_digest(path: str | os.PathLike, mapped: bool = False) -> tuple[int, str]:
    """(bytes, sha256 hex) of a file, read in ``BLOCK``-sized blocks. ``mapped``: hashed through a
    read-only memory map instead (no copy out of the page cache: a fifth less CPU), for the files a
    save has just written; a file someone else could truncate meanwhile is read (a mapped page
    past a new end would be a SIGBUS)."""
    h = hashlib.new(ALGORITHM)
    with open(path, "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        if mapped and size:
            with mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ) as m:
                view = memoryview(m)
                try:
                    for i in range(0, size, BLOCK):
                        h.update(view[i : i + BLOCK])
                finally:
                    view.release()
            return size, h.hexdigest()
        buf = bytearray(BLOCK)
        view, size = memoryview(buf), 0
        while n := f.readinto(buf):
            h.update(view[:n])
            size += n
    return size, h.hexdigest()


def digests(paths, workers: int | None = None) -> dict[Path, tuple[int, str]]:
    """(bytes, sha256) of every path, the largest first, on ``workers`` threads."""
    paths = sorted({Path(p) for p in paths}, key=lambda p: -p.stat().st_size)
    if not paths:
        return {}
    with ThreadPoolExecutor(min(workers or threads(), len(paths))) as pool:
        return dict(zip(paths, pool.map(file_digest, paths)))


def rank_files(folder: Path, rank: int) -> list[Path]:
    """The files of a megatron/torch dist checkpoint that ``rank`` wrote: ``__<rank>_<n>.distcp``
    (torch's FileSystemWriter names each rank's files so; the coordinator's ``.metadata`` and megatron's
    ``metadata.json`` are hashed at the publication)."""
    pattern = re.compile(rf"^__{rank}_\d+\.distcp$")
    return [p for p in folder.iterdir() if pattern.match(p.name)] if folder.is_dir() else []


class Hasher:
    """The digests one rank computes during one save: files are hashed in a thread pool as they are
    handed in (:meth:`submit`), and :meth:`close` writes them to this rank's sidecar in ``root``."""

    def __init__(self, root: Path, rank: int, label: str = "save"):
        self.root, self.rank, self.label = Path(root), rank, label
        self.pool = ThreadPoolExecutor(threads(), thread_name_prefix="megahash-sha256")
        self.futures: dict[Path, object] = {}

    def submit(self, *paths) -> None:
        for p in paths:
            p = Path(p)
            if p not in self.futures and p.is_file():
                self.futures[p] = self.pool.submit(file_digest, p, True)

    def submit_rank_files(self, folder: Path) -> None:
        """This rank's files of the dist checkpoint in ``folder`` (complete: its save returned)."""
        self.submit(*sorted(rank_files(folder, self.rank), key=lambda p: -p.stat().st_size))

    def close(self, write: bool = True) -> None:
        """Wait for the digests and write the sidecar (``write``; without it, what is not yet hashed is
        dropped); a file that could not be read is left out (rank 0 hashes it at the publication, or
        reports it). Closing again does nothing."""
        entries = {}
        for p, fut in self.futures.items():
            if not write:
                fut.cancel()
                continue
            try:
                entries[str(p.relative_to(self.root))] = list(fut.result())
            except OSError:
                pass
        self.pool.shutdown(wait=True)
        self.futures = {}
        if write and entries:
            from megahash.atomic_write import write_text_atomic

            write_text_atomic(self.root / f"{SIDECAR}{self.label}-rank{self.rank:05d}.json", json.dumps(entries))


def is_sidecar(name: str) -> bool:
    return name.startswith(SIDECAR) and name.endswith(".json")


def take_sidecars(root: Path) -> dict[str, tuple[int, str]]:
    """The digests the ranks left in ``root`` (relative path -> (bytes, sha256)); the sidecars are
    removed. An unreadable sidecar is ignored (its files are hashed again)."""
    out = {}
    for p in sorted(root.glob(f"{SIDECAR}*.json")):
        try:
            out.update({k: (int(v[0]), str(v[1])) for k, v in json.loads(p.read_text()).items()})
        except (OSError, ValueError, TypeError, IndexError, AttributeError):
            pass
        p.unlink(missing_ok=True)
    return out


def share(sizes: dict[str, int], rank: int, world: int) -> list[str]:
    """This rank's part of the files ``sizes`` (name -> bytes) when ``world`` ranks verify them
    together: largest first, each to the least loaded rank (the same on every rank)."""
    if world <= 1:
        return sorted(sizes)
    load = [0] * world
    mine = []
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        r = min(range(world), key=lambda i: (load[i], i))
        load[r] += sizes[name]
        if r == rank:
            mine.append(name)
    return mine
