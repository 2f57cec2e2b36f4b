"""Running a command guarded (every entry point: ``megahash ...``, megahash/pretrain.py): megahash
errors and missing files become ONE line ``error: ...`` on stderr and exit status 2 (house rule; the
error classes are in :mod:`megahash.errors`; :func:`megahash.errors.one_line` caps the line). A reader
that stops early (``megahash params --json | head``) ends the command quietly with status 141, as a
SIGPIPE would, instead of a BrokenPipeError traceback (Python's recipe: stdout is pointed at /dev/null
so the exit flush cannot fail again)."""

from __future__ import annotations

import os
import sys

from megahash.errors import MegahashError, print_error


def launch_rank() -> int:
    """This process's global rank as the launchers set it (0 outside a launcher)."""
    for var in ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK"):
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return 0


def run_guarded(fn) -> int:
    """Run ``fn`` and turn megahash errors (and missing files) into one line + exit status 2.

    Bad input fails the same way on every rank, so only rank 0 prints the line (the others exit 2
    silently); set MEGAHASH_ERRORS_ALL_RANKS=1 to see every rank's."""

    def say(msg):
        if launch_rank() == 0 or os.environ.get("MEGAHASH_ERRORS_ALL_RANKS") == "1":
            print_error(msg)

    fresh = not _group_initialized()
    try:
        status = fn()
        sys.stdout.flush()  # here, so a closed pipe is caught below, not at exit
        return int(status or 0)
    except MegahashError as e:
        say(e)
        return 2
    except FileNotFoundError as e:
        say(f"{e.strerror}: {e.filename}")
        return 2
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141  # 128 + SIGPIPE: what the shell reports for `yes | head`
    finally:
        if fresh and _group_initialized():  # a process group the command started and left (eval, indicators,
            # export...): released, so in-process callers keep no gloo threads
            from megahash.accelerator import process_groups

            process_groups.release_group()


def _group_initialized() -> bool:
    """Whether a torch.distributed process group is up (torch is not imported to find out)."""
    d = sys.modules.get("torch.distributed")
    return d is not None and d.is_available() and d.is_initialized()
