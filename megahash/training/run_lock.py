"""One run per ``train.save_dir``: ``SAVE_DIR/megahash.lock``, taken before anything is written there.

The lock is the file's existence, created with ``O_CREAT | O_EXCL`` (exclusive on local file systems,
NFSv3 and later, Lustre), as filelock's ``SoftFileLock`` and PostgreSQL's postmaster.pid do: no
``fcntl``/``flock`` lock, which Lustre refuses unless mounted with ``-o flock`` and NFS keeps only
with a lock daemon, and which could not say who holds a lock. The file holds its holder (JSON): host,
pid, the process's start (boot id and start time in clock ticks, so a recycled pid is not taken for
the holder), SLURM job id and restart count, the time it started.

- Rank 0 takes it in :func:`megahash.training.trainer.train` before the set-up (the other ranks wait
  for its answer; a refusal is the same one line on every rank), and removes it at every exit that
  runs Python's ``finally``: the end, an exception, the stop on SIGTERM/SIGUSR1 (requeue) and so a
  launcher's group kill, and the hang watchdog's hard exit (:func:`release_held`). ``pretrain.py
  --check`` never takes it.
- A second run refuses in one line naming the holder.
- A lock whose holder is provably gone is reclaimed with one line (filelock's rule: never on a guess):
  the holder ran on this host (same host name, boot and pid namespace) and its process is gone or its
  pid is another process now; or the holder was an earlier run of this SLURM job (same job id, a lower
  ``SLURM_RESTART_COUNT``: SLURM ends a job before it requeues it, and the requeued job may start on
  another node). A lock file that never got its holder written (a crash right after creating it) is
  stale after ``EMPTY_STALE_S``. Anything else (another host, another job) is refused, and the line
  says to remove the file if that run is known to be dead.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import time
from pathlib import Path

from megahash.errors import ConfigError

LOCK = "megahash.lock"
EMPTY_STALE_S = 30.0  # a lock file without a readable holder older than this is a crash's leftover

_held: Path | None = None  # the lock this process holds (for release_held)
_mine: str | None = None  # its content
_made: Path | None = None  # train.save_dir when taking the lock created it


def _read(path: str) -> str | None:
    with contextlib.suppress(OSError):
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read(4096)
    return None


def _boot_id() -> str:
    return (_read("/proc/sys/kernel/random/boot_id") or "").strip()


def _pid_namespace() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def start_ticks(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks since boot, /proc/PID/stat field 22); None if unknown."""
    text = _read(f"/proc/{pid}/stat")
    if not text or ")" not in text:
        return None
    fields = text.rsplit(")", 1)[1].split()
    try:
        return int(fields[19])
    except (IndexError, ValueError):
        return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def holder_of_this_process() -> dict:
    env = os.environ
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "boot_id": _boot_id(),
        "pid_namespace": _pid_namespace(),
        "start_ticks": start_ticks(os.getpid()),
        "slurm_job_id": env.get("SLURM_JOB_ID", ""),
        "slurm_restart_count": int(env.get("SLURM_RESTART_COUNT", "0") or 0),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": " ".join(sys.argv[:1]),
    }


def describe(h: dict) -> str:
    job = f", SLURM job {h['slurm_job_id']}" if h.get("slurm_job_id") else ""
    return f"pid {h.get('pid')} on {h.get('host')}{job}, started {h.get('started')}"


def stale(h: dict | None, age_s: float, me: dict) -> str | None:
    """Why the holder ``h`` of a lock (None: unreadable) is provably gone (None: it may be alive)."""
    if h is None:
        return f"its holder was never written and it is {age_s:.0f} s old" if age_s > EMPTY_STALE_S else None
    same_host = (h.get("host"), h.get("boot_id"), h.get("pid_namespace")) == (
        me["host"],
        me["boot_id"],
        me["pid_namespace"],
    )
    if same_host:
        pid = int(h.get("pid") or 0)
        if pid <= 0 or not _alive(pid):
            return f"{describe(h)}: that process is gone"
        if h.get("start_ticks") is not None and start_ticks(pid) not in (None, h["start_ticks"]):
            return f"{describe(h)}: that process is gone (its pid is another process now)"
        return None
    job = h.get("slurm_job_id")
    if job and job == me["slurm_job_id"] and int(h.get("slurm_restart_count") or 0) < me["slurm_restart_count"]:
        return f"{describe(h)}: an earlier run of this requeued job"
    return None


def acquire(save_dir: str | Path) -> Path:
    """Take ``SAVE_DIR/megahash.lock`` (rank 0, before anything is written there); one-line
    ConfigError if another run holds it. A stale lock is reclaimed with one line on stderr."""
    global _held, _mine, _made
    save_dir = Path(save_dir)
    made = None if save_dir.exists() else save_dir
    try:
        save_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"cannot create train.save_dir {save_dir} ({e.strerror}); choose a writable folder") from None
    path = save_dir / LOCK
    me = holder_of_this_process()
    text = json.dumps(me, indent=1) + "\n"
    for _ in range(5):
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o644)
        except FileExistsError:
            seen = _read(str(path))
            if seen is None:  # released meanwhile
                continue
            try:
                holder = json.loads(seen)
                holder = holder if isinstance(holder, dict) else None
            except ValueError:
                holder = None
            try:
                age = time.time() - path.stat().st_mtime
            except OSError:
                continue
            why = stale(holder, age, me)
            if why is None:
                who = describe(holder) if holder else "an unknown holder (the lock file is being written or damaged)"
                raise ConfigError(
                    f"train.save_dir {save_dir} is in use by another run ({who}); use another train.save_dir, "
                    f"or if that run is dead remove {path}"
                ) from None
            if _take_aside(path, seen):
                print(f"megahash: reclaimed the stale lock of {save_dir} ({why})", file=sys.stderr, flush=True)
            continue
        except OSError as e:  # permission, a read-only file system, no room for one more file
            raise _unwritable(save_dir, e, made) from None
        try:
            os.write(fd, text.encode())
            os.fsync(fd)
        except OSError as e:  # a full disk: no empty lock may stay behind (it would hold the folder)
            os.close(fd)
            with contextlib.suppress(OSError):
                path.unlink()
            raise _unwritable(save_dir, e, made) from None
        else:
            os.close(fd)
        _held, _mine, _made = path, text, made
        return path
    raise ConfigError(f"could not take the lock {path}: other runs keep taking it; start one run per train.save_dir")


def _unwritable(save_dir: Path, e: OSError, made: Path | None) -> ConfigError:
    """The one line of a ``train.save_dir`` that takes no lock file (the folder removed again if this made it)."""
    from megahash.training.checkpoint_faults import disk_note

    if made is not None:
        with contextlib.suppress(OSError):
            made.rmdir()
    note = disk_note(made.parent if made is not None else save_dir, e)
    if note.startswith("disk full"):
        return ConfigError(
            f"cannot write train.save_dir {save_dir} ({e.strerror}: {note}); free space on that file system or "
            f"choose another train.save_dir"
        )
    return ConfigError(f"cannot write train.save_dir {save_dir} ({e.strerror}); choose a writable folder")


def _take_aside(path: Path, seen: str) -> bool:
    """Remove the stale lock ``path`` whose content was ``seen``, unless another process replaced it
    meanwhile (then it is put back). The rename is atomic: of two reclaimers, one gets the file."""
    aside = path.with_name(f"{path.name}.stale-{os.getpid()}")
    try:
        os.rename(path, aside)
    except OSError:
        return False
    if _read(str(aside)) == seen:
        aside.unlink(missing_ok=True)
        return True
    with contextlib.suppress(OSError):
        os.link(aside, path)  # a fresh lock taken meanwhile: back in place (fails if yet another exists)
    aside.unlink(missing_ok=True)
    return False


def release(path: Path | None) -> None:
    """Remove the lock if it is still this process's, and ``train.save_dir`` with it if taking the lock
    created it and nothing else was written there (a run refused on bad input leaves nothing behind)."""
    global _held, _mine, _made
    if path is None:
        return
    if _read(str(path)) == _mine:
        with contextlib.suppress(OSError):
            path.unlink()
    if path == _held:
        if _made is not None:
            with contextlib.suppress(OSError):
                _made.rmdir()  # only if empty
        _held = _mine = _made = None


def release_held() -> None:
    """Remove the lock this process holds, if any (before a hard exit: the hang watchdog's ``os._exit``)."""
    release(_held)


@contextlib.contextmanager
def held(save_dir: str | Path, rank: int):
    """Collective: rank 0 takes the lock of ``save_dir`` for the body, every rank fails alike if it
    cannot; released when the body ends (normally or not)."""
    from megahash.training.signals import any_rank

    path, error = None, None
    if rank == 0:
        try:
            path = acquire(save_dir)
        except Exception as e:  # every rank learns of it below (the others would wait forever)
            error = e
    if any_rank(error is not None):
        raise error or ConfigError(f"train.save_dir {save_dir} is in use by another run (rank 0 says which)")
    try:
        yield path
    finally:
        release(path)
