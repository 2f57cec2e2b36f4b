"""Errors that reach the user as one line (entry points print ``error: <message>`` and exit 2)."""


class MegahashError(Exception):
    """Base of every user-facing error: bad config, bad data, bad checkpoint."""


class ConfigError(MegahashError, ValueError):
    """A config key, value or combination is invalid."""


class DataError(MegahashError):
    """Shards are missing, corrupt or do not match the config."""


class CheckpointError(MegahashError):
    """A checkpoint is missing, incomplete or from another model."""
