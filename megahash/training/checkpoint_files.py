"""Names in a checkpoint folder and its state file (the layer below :mod:`checkpoint`,
:mod:`checkpoint_faults` and :mod:`weights`, so none of them imports another in a circle).
Layout: megahash/training/checkpoint.py."""
from __future__ import annotations

import json
import re
from pathlib import Path

from megahash.errors import CheckpointError

STATE_FILE = "megahash_state.json"
TAG_RE = re.compile(r"^step_(\d{8})$")


def read_state(ckpt: Path) -> dict:
    try:
        return json.loads((ckpt / STATE_FILE).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"checkpoint {ckpt} has no readable {STATE_FILE} ({e}); it is incomplete") from None


def pin_path(root: Path, tag: str) -> Path:
    """``ROOT/eval/TAG.pin``: present while checkpoint ``TAG`` is evaluated (eval.interval,
    megahash/training/eval_during.py); ``train.keep_last`` pruning leaves a pinned checkpoint."""
    return Path(root) / "eval" / f"{tag}.pin"
