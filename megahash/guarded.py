"""Running a command guarded (every entry point: ``megahash ...``, megahash/pretrain.py): megahash
errors and missing files become ONE line ``error: ...`` on stderr and exit status 2 (house rule; the
error classes are in :mod:`megahash.errors`)."""
from __future__ import annotations

import os
import sys

from megahash.errors import MegahashError


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
            print(msg, file=sys.stderr)

    try:
        status = fn()
        return int(status or 0)
    except MegahashError as e:
        say(f"error: {e}")
        return 2
    except FileNotFoundError as e:
        say(f"error: {e.strerror}: {e.filename}")
        return 2
