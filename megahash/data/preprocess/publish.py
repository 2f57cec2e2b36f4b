"""Publishing a shard set atomically, and workers that die with their parent.

A shard set is published by renaming its temp files ``FINAL.tmp-<pid>`` to their final names, the
meta (``PREFIX_meta.json``) last: readers (``megahash.data.verify.read_meta``, ``ShardSet.open``,
training) refuse a set without its meta, so a set is either complete or refused, never read half.
:func:`publish` first removes an old meta of the same prefix (an ``--overwrite`` killed during the
renames must not leave new shards under the old meta), then renames the shards, then the meta.

A rerun over a set without meta (an interrupted publish or run) needs no ``--overwrite``: its files
are leftovers (:func:`leftovers`), replaced like temp files; so are temp files of dead runs.

:func:`die_with_parent` (Linux ``prctl(PR_SET_PDEATHSIG)``) makes a worker process get SIGKILL when
the process that started it dies, even by SIGKILL, so killing preprocess never leaves workers.
"""
from __future__ import annotations

import glob
import os
import re
import signal
from typing import Iterable, Optional

_TMP = re.compile(r"\.tmp-(\d+)$")


def publish(pending: dict[str, str], meta_final: str) -> None:
    """Rename ``pending`` (final -> temp path) into place, ``meta_final`` last (see module docstring)."""
    try:
        os.remove(meta_final)  # the set is unpublished from here until its new meta is in place
    except FileNotFoundError:
        pass
    for final in [f for f in pending if f != meta_final]:
        os.replace(pending[final], final)
    if meta_final in pending:
        _fsync_dir(os.path.dirname(meta_final) or ".")
        os.replace(pending[meta_final], meta_final)
        _fsync_dir(os.path.dirname(meta_final) or ".")


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def leftovers(prefix: str, finals: Iterable[str]) -> list[str]:
    """Files of an unpublished set at ``prefix`` (finals present while the meta is not) and temp
    files of runs that are no longer alive: a rerun replaces them without ``--overwrite``."""
    meta = f"{prefix}_meta.json"
    out = [] if os.path.exists(meta) else [f for f in finals if os.path.exists(f)]
    for tmp in glob.glob(glob.escape(prefix) + "_*.tmp-*"):
        m = _TMP.search(tmp)
        if m and int(m.group(1)) != os.getpid() and not _alive(int(m.group(1))):
            out.append(tmp)
    return out


def remove(paths: Iterable[str]) -> None:
    for p in paths:
        try:
            os.remove(p)
        except FileNotFoundError:
            pass


def die_with_parent(parent_pid: int) -> None:
    """In a worker: get SIGKILL when the parent dies (Linux); exit now if it is already gone."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):
        return
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


class AtomicOutputs:
    """Temp files ``FINAL.tmp-<pid>``, renamed to their final names by ``commit`` (in order, the
    meta last), all removed by ``cleanup`` when anything fails."""

    def __init__(self):
        self.pending: dict[str, str] = {}  # final -> tmp
        self.scratch_files: list[str] = []  # temporary files that are never renamed
        self.suffix = f".tmp-{os.getpid()}"

    def scratch(self, name: str) -> str:
        """Path of a temporary work file ``NAME.tmp-<pid>``, removed by ``commit`` and ``cleanup``."""
        self.scratch_files.append(name + self.suffix)
        return self.scratch_files[-1]

    def remove_scratch(self) -> None:
        for tmp in self.scratch_files:
            try:
                os.remove(tmp)
            except FileNotFoundError:
                pass
        self.scratch_files.clear()

    def tmp(self, final: str) -> str:
        self.pending[final] = final + self.suffix
        return self.pending[final]

    def commit(self, last: str) -> None:
        self.remove_scratch()
        publish(self.pending, last)  # old meta removed first, shards, then the meta
        self.pending.clear()

    def cleanup(self) -> None:
        self.remove_scratch()
        for tmp in self.pending.values():
            try:
                os.remove(tmp)
            except FileNotFoundError:
                pass
        self.pending.clear()


def remove_stale(old_meta: Optional[dict], prefix: str, keep: set) -> None:
    """After --overwrite: delete files of the previous run that this run did not write."""
    if not old_meta:
        return
    base = os.path.dirname(prefix)
    for name in old_meta.get("files", {}):
        if name not in keep and os.path.basename(name) == name and name.startswith(os.path.basename(prefix) + "_"):
            try:
                os.remove(os.path.join(base, name))
            except FileNotFoundError:
                pass
