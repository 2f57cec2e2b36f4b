"""Checkpoint faults: which checkpoint a run resumes from, what a dead save leaves, what a failed
save reports.

- Every save writes ``manifest.json`` (relative path -> bytes of every file of the checkpoint,
  DeepSpeed's and megatron's included) before ``megahash_state.json``. :func:`choose_resume` walks the
  checkpoints of ``train.save_dir`` newest first and takes the first *verified* one (state file
  readable, every file of the manifest present with its size, every torch ``.pt`` file a readable
  zip); each damaged newer one is named in a warning. When checkpoints exist but none is intact the
  run stops with one line instead of silently starting from scratch.
- :func:`clean_stale` removes what dead saves left (``step_N.tmp``, ``step_N.old``, temp files of
  ``latest``) at the next start.
- :func:`save_failed` turns an exception of a save (disk full, permission) into one line naming
  the previous intact checkpoint, after the partial ``step_N.tmp`` was removed.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import zipfile
from pathlib import Path

from megahash.errors import CheckpointError

MANIFEST = "manifest.json"


def _tags():
    from megahash.training.checkpoint_files import STATE_FILE, TAG_RE

    return STATE_FILE, TAG_RE


def write_manifest(ckpt: Path) -> None:
    """Record the size of every file under ``ckpt`` (rank 0, after every rank has written)."""
    state_file, _ = _tags()
    files = {}
    for p in sorted(ckpt.rglob("*")):
        if p.is_file() and p.name not in (MANIFEST, state_file) and ".tmp-" not in p.name:
            files[str(p.relative_to(ckpt))] = p.stat().st_size
    tmp = ckpt / (MANIFEST + f".tmp-{os.getpid()}")
    tmp.write_text(json.dumps({"files": files}, indent=0))
    os.replace(tmp, ckpt / MANIFEST)


def damage(ckpt: Path) -> str | None:
    """Why ``ckpt`` cannot be resumed from (None if it is intact). Checkpoints saved before manifests
    existed are checked for their state file only."""
    state_file, _ = _tags()
    try:
        state = json.loads((ckpt / state_file).read_text())
        int(state["step"])
    except FileNotFoundError:
        return f"it has no {state_file} (an unfinished save)"
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"its {state_file} is unreadable ({type(e).__name__})"
    man = ckpt / MANIFEST
    if not man.is_file():
        return None
    try:
        files = json.loads(man.read_text())["files"]
    except (OSError, ValueError, KeyError) as e:
        return f"its {MANIFEST} is unreadable ({type(e).__name__})"
    for rel, size in files.items():
        p = ckpt / rel
        if not p.is_file():
            return f"{rel} is missing"
        got = p.stat().st_size
        if got != size:
            return f"{rel} has {got} bytes, {size} were written"
        if p.suffix == ".pt":
            try:
                with zipfile.ZipFile(p) as z:
                    z.infolist()
            except (zipfile.BadZipFile, OSError) as e:
                return f"{rel} is not a readable torch file ({e})"
    return None


def candidates(save_dir: Path) -> list[Path]:
    """``step_N`` folders of ``save_dir`` newest first (complete or not)."""
    _, tag_re = _tags()
    if not save_dir.is_dir():
        return []
    return sorted((p for p in save_dir.iterdir() if p.is_dir() and tag_re.match(p.name)),
                  key=lambda p: p.name, reverse=True)


def choose_resume(save_dir: str | Path, warn: bool = True) -> Path | None:
    """The newest verified checkpoint of ``save_dir`` (``train.resume=auto``); None if it has none.
    Damaged newer checkpoints are named in a warning (``warn``: print it, rank 0)."""
    save_dir = Path(save_dir)
    skipped = []
    for c in candidates(save_dir):
        why = damage(c)
        if why is None:
            if skipped and warn:
                for s, w in skipped:
                    print(f"warning: checkpoint {s} is damaged ({w}); resuming from the older {c.name}", file=sys.stderr,
                          flush=True)
            return c
        skipped.append((c, why))
    if skipped:
        s, w = skipped[0]
        raise CheckpointError(f"no intact checkpoint in {save_dir}: the newest, {s.name}, is damaged ({w}) and no older "
                              f"one is intact; restore it, or start over with train.resume=none or another train.save_dir")
    return None


def clean_stale(save_dir: str | Path) -> list[str]:
    """Remove leftovers of dead saves (rank 0, before anything is saved). Returns what was removed."""
    save_dir = Path(save_dir)
    removed = []
    if not save_dir.is_dir():
        return removed
    for p in save_dir.iterdir():
        if p.name.startswith("step_") and (p.name.endswith(".tmp") or p.name.endswith(".old")):
            shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
            removed.append(p.name)
        elif p.name.startswith("latest.tmp-") or p.name.startswith("resolved_config.yaml.tmp-"):
            p.unlink(missing_ok=True)
            removed.append(p.name)
    return sorted(removed)


def first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    msg = text[0] if text else type(e).__name__
    if isinstance(e, OSError) and e.strerror:
        msg = f"{e.strerror}" + (f": {e.filename}" if e.filename else "")
    return msg[:300]


def disk_note(root: Path, e: BaseException) -> str:
    """What the failure was, with "disk full" when the file system has (almost) no room left: torch's
    zip writer reports a full disk as "unexpected pos ...". Call before the partial save is removed."""
    import errno

    try:
        free = shutil.disk_usage(root).free
    except OSError:
        free = None
    if (isinstance(e, OSError) and e.errno == errno.ENOSPC) or (free is not None and free < (4 << 20)):
        return f"disk full: {free if free is not None else '?'} bytes free on the file system of {root}"
    return first_line(e)


def remedy(e: BaseException | str) -> str:
    """What to do about a failed save, by its cause: a full disk, a file-system error (permission,
    missing mount) or anything else (the state megahash was writing: not a disk problem)."""
    text = e if isinstance(e, str) else first_line(e)
    if text.startswith("disk full"):
        return "free space on that file system and rerun"
    if isinstance(e, OSError) or type(e).__name__ == "CheckpointException":  # torch.distributed.checkpoint's
        return "fix the folder (permissions, mount, space) and rerun"
    return "this is not a file-system problem: fix the cause named above (or report it) and rerun"


def save_failed(root: Path, tag: str, e: BaseException | str, cause: BaseException | None = None) -> CheckpointError:
    """The one-line error of a failed save (the caller removed ``tag``.tmp; ``e`` or disk_note's text;
    ``cause``: the exception the text describes, which picks the remedy)."""
    try:
        prev = choose_resume(root, warn=False)
    except CheckpointError:
        prev = None
    kept = f"the previous checkpoint {prev.name} is intact" if prev else "no earlier checkpoint exists"
    what = e if isinstance(e, str) else first_line(e)
    todo = remedy(what if what.startswith("disk full") or cause is None else cause)
    return CheckpointError(f"saving checkpoint {tag} in {root} failed ({what}); nothing partial was kept, "
                           f"{kept}; {todo}: it resumes with train.resume=auto")
