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
from collections.abc import Iterable

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


_REAPER = """
import glob, os, signal, sys
for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
    signal.signal(sig, signal.SIG_IGN)
if sys.stdin.buffer.read(1) != b"d":
    for path in glob.glob(sys.argv[1]):
        try:
            os.remove(path)
        except OSError:
            pass
"""


class TempReaper:
    """Removes a process's temporary files however it ends. ``with TempReaper(pattern):`` starts a small
    helper process (its own session, so a Ctrl-C or a signal to the process group does not reach it;
    SIGINT/SIGTERM/SIGHUP ignored) that blocks reading a pipe from this process. Leaving the block,
    normally or by an exception after the caller's own cleanup, tells it to exit when no file matches
    ``pattern`` (a glob of this process's temp names); otherwise (a cleanup cut short), or if this
    process dies first (SIGKILL, the OOM killer, an abort in C++ code), the pipe closes without that
    word and the helper removes every file matching ``pattern``."""

    def __init__(self, pattern: str):
        self.pattern = pattern
        self.proc = None

    def __enter__(self) -> TempReaper:
        import subprocess
        import sys

        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", _REAPER, self.pattern],
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
            )
        except OSError:  # pragma: no cover - cannot start a process: the next run removes leftovers instead
            self.proc = None
        return self

    def __exit__(self, *exc) -> None:
        if self.proc is None:
            return
        try:
            if not glob.glob(self.pattern):  # else (a cleanup cut short): the helper removes what is left
                self.proc.stdin.write(b"d")
            self.proc.stdin.close()
        except OSError:  # pragma: no cover - the helper is gone
            pass
        try:
            self.proc.wait(timeout=10)
        except Exception:  # pragma: no cover
            self.proc.kill()


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


def remove_stale(old_meta: dict | None, prefix: str, keep: set) -> None:
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
