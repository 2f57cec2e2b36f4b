"""Writing a file atomically: a temp name beside it (``NAME.tmp-<pid>``), then a rename, so readers
see the old file or the new one, never half of one (house rule). :func:`atomic_path` serves writers
that want a path (``savefig``, ``torch.save``); the temp file goes when the writer fails."""

from __future__ import annotations

import contextlib
import json
import math
import os
from pathlib import Path


def disk_full(root: str | os.PathLike, e: BaseException) -> str | None:
    """``"disk full: N bytes free on the file system of ROOT"`` when writing under ``root`` failed for want of room
    (ENOSPC, a spent quota: EDQUOT, safetensors' "No space left" without an errno, or under 4 MiB left: torch's zip
    writer says "unexpected pos ..."), else None. The one full-disk test of saves, run logs and lock, and exports."""
    import errno
    import shutil

    try:
        free = shutil.disk_usage(root).free
    except OSError:
        free = None
    full = (isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT)) or "No space left" in str(e)
    if full or (free is not None and free < (4 << 20)):
        return f"disk full: {free if free is not None else '?'} bytes free on the file system of {root}"
    return None


def file_above(path: str | os.PathLike) -> Path | None:
    """The nearest existing ancestor of ``path`` when it is a file, not a folder (the output cannot be made
    there: mkdir's FileExistsError); None otherwise. For one-line checks of an output path before any work."""
    for parent in Path(path).parents:
        if parent.exists():
            return None if parent.is_dir() else parent
    return None


def check_output(out, flag: str = "--out", folder: bool = False, example: str = "results.json") -> None:
    """``out`` (the value of ``flag``) names a file (``folder``: an output folder) that can be made: a folder
    given for a file, a file given for a folder, or a file above it, is one line (ConfigError) before any work
    (they were IsADirectoryError/NotADirectoryError/FileExistsError tracebacks after it). ``example``: the
    file name suggested inside a folder given for a file. Shared by every command that writes an output."""
    from megahash.errors import ConfigError

    if not out:
        return
    p = Path(out)
    if not folder and p.is_dir():
        raise ConfigError(f"{flag} {out} is a folder; name the file to write, e.g. {flag} {p / example}")
    if folder and p.exists() and not p.is_dir():
        raise ConfigError(f"{flag} {out} is a file; name a folder for the outputs")
    if (parent := file_above(p)) is not None:
        raise ConfigError(f"{flag} {out}: {parent} is a file, not a folder; name another {flag}")
    check_writable(p, f"name another {flag}", folder)


def unwritable(path: str | os.PathLike, folder: bool = False) -> str | None:
    """Why the output ``path`` (a file, written through a temp file beside it; ``folder``: a folder written into)
    cannot be made: its nearest existing folder is on a read-only file system or not writable by this user
    (``os.access``: a ``chattr +i`` folder refuses root too); None when it can be."""
    start = Path(path) if folder else Path(path).parent
    for here in (start, *start.parents):
        if here.exists():
            break
    else:
        return None
    if not here.is_dir() or os.access(here, os.W_OK | os.X_OK):
        return None  # a file in the way is file_above's line
    try:
        read_only = bool(os.statvfs(here).f_flag & os.ST_RDONLY)
    except OSError:
        read_only = False
    return f"{here} is on a read-only file system" if read_only else f"{here} is not writable by this user"


def check_writable(path: str | os.PathLike, fix: str, folder: bool = False) -> None:
    """One line (ConfigError) before any work when the output ``path`` cannot be written (:func:`unwritable`;
    it was an OSError traceback after the work, e.g. ``megahash eval`` of a read-only run folder). ``fix``:
    what to do instead, e.g. "pass --out FILE elsewhere"."""
    from megahash.errors import ConfigError

    why = unwritable(path, folder)
    if why:
        raise ConfigError(f"cannot write {path}: {why}; {fix}")


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike):
    """Yield the temp path to write; on leaving the block it is renamed to ``path`` (parents made)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp-{os.getpid()}")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def write_bytes_atomic(path: str | os.PathLike, data: bytes) -> None:
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)


def finite_json(obj):
    """``obj`` with every NaN and infinity (a diverged run's loss) as None, so ``json.dumps`` writes standard JSON
    (Python writes them as the bare words NaN / Infinity, which jq, JavaScript and strict parsers refuse)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite_json(v) for v in obj]
    return obj


def write_figure_atomic(fig, path: str | os.PathLike, **savefig) -> Path:
    """A matplotlib figure written to ``path`` under a temp name, then renamed (a job killed while plotting
    leaves the previous image, never half a PNG); the format is the suffix's (the temp name has none)."""
    path = Path(path)
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format=path.suffix[1:] or "png", **savefig)
    return path


def write_finite_json_atomic(path: str | os.PathLike, obj) -> None:
    """``obj`` as standard JSON (:func:`finite_json`: NaN / inf as null; other objects as their ``str``), written
    atomically: the report files of runs that may have diverged (``megahash report``, a sweep's report.json)."""
    text = json.dumps(finite_json(obj), indent=1, default=str, allow_nan=False)
    write_text_atomic(path, text + "\n")


def write_json_atomic(path: str | os.PathLike, obj, indent: int | None = 1) -> None:
    write_text_atomic(path, json.dumps(obj, indent=indent))
