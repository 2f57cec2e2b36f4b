"""Shared CLI plumbing of the data stage: one-line user errors (``error: ...`` on stderr, exit 2)."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from megahash.atomic_write import file_above
from megahash.errors import DataError, MegahashError

__all__ = ["DataError", "InputError", "cli"]


class InputError(DataError):
    """Bad input reaching the user as one line: missing file, bad JSON key, existing output, ..."""


def one_line(text: str) -> str:
    """First non-empty line of ``text`` (for wrapping third-party exception messages)."""
    for line in str(text).splitlines():
        if line.strip():
            return line.strip()
    return str(text).strip()


def cli(run: Callable[[Sequence[str] | None], int], argv: Sequence[str] | None = None) -> int:
    """Run ``run(argv)``; user errors become ``error: <one line>`` and exit code 2, Ctrl-C exit 130."""
    try:
        return run(argv)
    except (MegahashError, ValueError) as e:
        print(f"error: {one_line(str(e))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130


def check_output_prefix(prefix: str, flag: str) -> None:
    """``FLAG FOLDER/NAME`` (the prefix of a data tool's outputs): a name after the last ``/`` (``out/`` wrote
    ``out/_meta.json``) and every existing path above it a folder (a file there was a FileExistsError traceback
    from mkdir)."""
    if not prefix or prefix.endswith(("/", os.sep)) or Path(prefix).name in ("", ".", ".."):
        raise InputError(
            f"{flag} {prefix!r} names no file prefix; give FOLDER/NAME, e.g. {prefix.rstrip('/') or 'data'}/corpus"
        )
    if (parent := file_above(prefix)) is not None:
        raise InputError(f"{flag} {prefix!r}: {str(parent)!r} is a file, not a folder; choose another prefix")
