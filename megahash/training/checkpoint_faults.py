"""Checkpoint faults of a run: what a dead save leaves, what a failed save reports. (Which checkpoint
a run resumes from, and how a damaged one is recognised: megahash/checkpoint/resolve.py, manifest.py.)

- :func:`clean_stale` removes what dead saves left (``step_N.tmp``, ``step_N.old``, temp files of
  ``latest``) at the next start.
- :func:`save_failed` turns an exception of a save (disk full, permission) into one line naming
  the previous intact checkpoint, after the partial ``step_N.tmp`` was removed.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from megahash.checkpoint.resolve import choose_resume
from megahash.errors import CheckpointError


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
    """What the failure was: :func:`megahash.atomic_write.disk_full`'s line when the file system has (almost) no
    room left, else the error's first line. Call before the partial save is removed."""
    from megahash.atomic_write import disk_full

    return disk_full(root, e) or first_line(e)


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
    return CheckpointError(
        f"saving checkpoint {tag} in {root} failed ({what}); nothing partial was kept, "
        f"{kept}; {todo}: it resumes with train.resume=auto"
    )


def saved_but(root: Path, tag: str, e: BaseException | str, cause: BaseException | None = None) -> CheckpointError:
    """The one line of a save that failed after ``tag`` was published: pointing ``latest`` at it or pruning
    older ones (an immutable or read-only ``latest``, a folder that refuses the change). Before, it read as
    "saving ... failed, nothing partial was kept, the previous checkpoint TAG is intact" about TAG itself."""
    what = e if isinstance(e, str) else first_line(e)
    todo = remedy(what if what.startswith("disk full") or cause is None else cause)
    return CheckpointError(
        f"checkpoint {tag} in {root} is saved and complete, but the run could not go on after it ({what}; "
        f"updating {Path(root) / 'latest'} or removing older checkpoints); {todo}: it resumes from {tag} with "
        f"train.resume=auto"
    )
