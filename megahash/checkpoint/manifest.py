"""A checkpoint's manifest and its verification.

Every save writes ``manifest.json`` (relative path -> bytes of every file of the checkpoint,
DeepSpeed's and megatron's included) before ``megahash_state.json``. :func:`damage` says why a
checkpoint cannot be resumed from: state file unreadable, a file of the manifest missing or of
another size, a torch ``.pt`` file that is not a readable zip.
"""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

from megahash.atomic_write import write_text_atomic
from megahash.checkpoint.layout import STATE_FILE

MANIFEST = "manifest.json"


def write_manifest(ckpt: Path) -> None:
    """Record the size of every file under ``ckpt`` (rank 0, after every rank has written)."""
    files = {}
    for p in sorted(ckpt.rglob("*")):
        if p.is_file() and p.name not in (MANIFEST, STATE_FILE) and ".tmp-" not in p.name:
            files[str(p.relative_to(ckpt))] = p.stat().st_size
    write_text_atomic(ckpt / MANIFEST, json.dumps({"files": files}, indent=0))


def damage(ckpt: Path) -> str | None:
    """Why ``ckpt`` cannot be resumed from (None if it is intact). Checkpoints saved before manifests
    existed are checked for their state file only."""
    try:
        state = json.loads((ckpt / STATE_FILE).read_text())
        int(state["step"])
    except FileNotFoundError:
        return f"it has no {STATE_FILE} (an unfinished save)"
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"its {STATE_FILE} is unreadable ({type(e).__name__})"
    man = ckpt / MANIFEST
    if not man.is_file():
        return None
    try:
        files = json.loads(man.read_text())["files"]
    except (OSError, ValueError, KeyError) as e:
        return f"its {MANIFEST} is unreadable ({type(e).__name__})"
    for rel, size in files.items():
        p = ckpt / rel
        if not p.is_file():
            return f"{rel} is missing"
        got = p.stat().st_size
        if got != size:
            return f"{rel} has {got} bytes, {size} were written"
        if p.suffix == ".pt":
            try:
                with zipfile.ZipFile(p) as z:
                    z.infolist()
            except (zipfile.BadZipFile, OSError) as e:
                return f"{rel} is not a readable torch file ({e})"
    return None
