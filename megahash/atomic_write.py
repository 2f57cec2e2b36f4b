"""Writing a text file atomically: a temp name beside it (``NAME.tmp-<pid>``), then a rename, so
readers see the old file or the new one, never half of one (house rule)."""
from __future__ import annotations

import os
from pathlib import Path


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp-{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
