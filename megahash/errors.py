"""Errors that reach the user as one line (entry points print ``error: <message>`` and exit 2)."""

import difflib
import sys

LINE_LIMIT = 500  # characters of an error line after ``error: `` (:func:`one_line`)


class MegahashError(Exception):
    """Base of every user-facing error: bad config, bad data, bad checkpoint."""


class ConfigError(MegahashError, ValueError):
    """A config key, value or combination is invalid."""


class DataError(MegahashError):
    """Shards are missing, corrupt or do not match the config."""


class CheckpointError(MegahashError):
    """A checkpoint is missing, incomplete or from another model."""


def did_you_mean(key: str, options) -> str:
    """`` (did you mean 'x'?)`` for the closest option, else `` (valid: a, b, ...)``: the tail of a one-line error."""
    close = difflib.get_close_matches(key, list(options), n=1, cutoff=0.5)
    return f" (did you mean {close[0]!r}?)" if close else f" (valid: {', '.join(sorted(options))})"


def one_line(message, limit: int = LINE_LIMIT) -> str:
    """``message`` as the one line a user reads: its lines joined by spaces and, past ``limit``
    characters, its head (what failed) and tail (the fix) around `` ... `` (a value quoted in full
    can be megabytes: a YAML alias bomb, a hostile file name). Every ``error:`` line goes through it
    (:func:`print_error`)."""
    text = str(message)
    if len(text) > 4 * limit:  # only the ends are shown: no pass over a huge middle
        text = text[: 2 * limit] + "\n...\n" + text[-2 * limit :]
    text = " ".join(part.strip() for part in text.splitlines() if part.strip())
    if len(text) <= limit:
        return text
    tail = limit // 3
    head = limit - tail - len(_ELLIPSIS)
    return text[:head] + _ELLIPSIS + text[-tail:]


_ELLIPSIS = " ... "


def print_error(message) -> None:
    """The one place an error becomes a line: ``error: <message as one_line>`` on stderr."""
    print(f"error: {one_line(message)}", file=sys.stderr, flush=True)
