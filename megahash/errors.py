"""Errors that reach the user as one line (entry points print ``error: <message>`` and exit 2)."""

import difflib


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
