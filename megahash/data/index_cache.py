"""The dataset index cache: megatron-core's ``GPTDataset`` writes each split's document, sample and shuffle
indexes (``<hash>-HashGPTDataset-<split>-*.npy`` and a description) under ``data.cache_dir`` (default
``train.save_dir/data_cache``) on rank 0 at the first start, and every later start and rank reads them.

A write that fails there (a full disk, a read-only or foreign directory) was a 60-line traceback ending
in megatron's "Failed to write dataset materials ... path_to_cache". :func:`writing` turns it into one
line naming the directory, the system's reason and the fix, and removes the files the failed build left
(megatron takes a cache whose four files exist as complete: a half-written last index would be read at
the next start). The other ranks wait for rank 0 in megatron's barrier; the launcher ends them when rank 0
exits, and a rank whose barrier breaks first stops with the same kind of error, silently (only rank 0
prints: megahash.command_errors).
"""

from __future__ import annotations

import contextlib
import os

from megahash.errors import DataError


def _listing(cache_dir: str | None) -> set[str]:
    if not cache_dir:  # megatron's default, a cache folder beside each shard (not megahash's runs)
        return set()
    try:
        return set(os.listdir(cache_dir))
    except OSError:
        return set()


def _os_error(e: BaseException) -> OSError | None:
    """The OSError behind ``e`` (megatron re-raises it as a plain ``Exception`` from it), if any."""
    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, OSError):
            return e
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return None


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


@contextlib.contextmanager
def writing(cache_dir: str | None):
    """Around megatron-core's dataset builders writing their indexes into ``cache_dir``: an OSError
    (on rank 0, where they are written) is one-line DataError and what the failed build wrote is removed;
    a collective broken meanwhile on another rank (rank 0 stopped) is a DataError too."""
    before = _listing(cache_dir) if _rank() == 0 else set()
    try:
        yield
    except DataError:
        raise
    except Exception as e:
        from megahash.accelerator.process_groups import collective_failed

        rank, cause = _rank(), _os_error(e)
        if rank != 0 and cause is None and collective_failed(e):
            raise DataError(f"rank 0 stopped while writing the dataset index cache in {cache_dir}") from None
        if rank != 0 or cause is None:
            raise
        for name in _listing(cache_dir) - before:  # the failed build's files: none may pass for a cache
            with contextlib.suppress(OSError):
                os.remove(os.path.join(cache_dir, name))
        where = cause.filename or cache_dir or "the cache folder beside the shards"
        raise DataError(
            f"cannot write the dataset index cache: {cause.strerror or cause} ({where}{_free(cache_dir)}); free "
            f"space there or set "
            f"data.cache_dir to a writable directory with room (megatron-core's document, sample and shuffle "
            f"indexes of the run, written once at the first start)"
        ) from None


def _free(cache_dir: str | None) -> str:
    """``, N MB free`` on the filesystem of ``cache_dir`` (numpy reports a short write without errno)."""
    import shutil

    try:
        return f", {shutil.disk_usage(cache_dir).free / 2**20:.1f} MB free" if cache_dir else ""
    except OSError:
        return ""
