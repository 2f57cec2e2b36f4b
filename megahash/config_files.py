"""Where the shipped configs are, and which file a ``--config`` names.

The repository's ``configs/`` folder is installed as package data ``megahash/configs`` (setup.py), so
an installed megahash finds its model sizes, DeepSpeed ZeRO files and grids from any directory; a
source checkout (``PYTHONPATH``, editable install) uses ``configs/`` beside the package.
"""

from __future__ import annotations

import os
from pathlib import Path

_PACKAGE = Path(__file__).resolve().parent


def _config_root() -> Path:
    shipped = _PACKAGE / "configs"  # wheel / pip install .
    return shipped if shipped.is_dir() else _PACKAGE.parent / "configs"


CONFIG_ROOT = _config_root()


def find_config(path: str | os.PathLike) -> Path:
    """The file a user's ``--config`` names: the path as given if it exists; else a shipped config
    (``configs/X`` or ``X`` under :data:`CONFIG_ROOT`, ``.yaml`` optional, or the model size
    ``model/X.yaml``: ``--config 500m``). Not found: the path as given (its reader says so in one line)."""
    p = Path(path)
    if p.exists() or p.is_absolute():
        return p
    name = p.as_posix()
    name = name[len("configs/") :] if name.startswith("configs/") else name
    for cand in (CONFIG_ROOT / name, CONFIG_ROOT / f"{name}.yaml", CONFIG_ROOT / "model" / f"{name}.yaml"):
        if cand.is_file():
            return cand
    return p
