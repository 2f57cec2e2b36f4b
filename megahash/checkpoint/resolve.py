"""Which checkpoint a path names: the newest verified one of a run directory (``train.resume=auto``,
``megahash eval --checkpoint RUN``), a ``step_N`` folder itself, and the config saved with it.

:func:`choose_resume` walks the checkpoints of a run directory newest first and takes the first
*verified* one (manifest.damage); each damaged newer one is named in a warning. When checkpoints
exist but none is intact it is one line instead of silently starting from scratch.
"""

from __future__ import annotations

import sys
from pathlib import Path

from megahash.checkpoint.layout import STATE_FILE, TAG_RE, WEIGHTS_DIR
from megahash.checkpoint.manifest import damage
from megahash.errors import CheckpointError


def complete_checkpoints(save_dir: str | Path) -> list[Path]:
    """Complete checkpoints (renamed, with a state file), oldest first."""
    root = Path(save_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if TAG_RE.match(p.name) and (p / STATE_FILE).is_file()]
    return sorted(found, key=lambda p: p.name)


def candidates(save_dir: Path) -> list[Path]:
    """``step_N`` folders of ``save_dir`` newest first (complete or not)."""
    if not save_dir.is_dir():
        return []
    return sorted(
        (p for p in save_dir.iterdir() if p.is_dir() and TAG_RE.match(p.name)), key=lambda p: p.name, reverse=True
    )


def choose_resume(save_dir: str | Path, warn: bool = True) -> Path | None:
    """The newest verified checkpoint of ``save_dir`` (``train.resume=auto``); None if it has none.
    Damaged newer checkpoints are named in a warning (``warn``: print it, rank 0)."""
    save_dir = Path(save_dir)
    skipped = []
    for c in candidates(save_dir):
        why = damage(c)
        if why is None:
            if skipped and warn:
                for s, w in skipped:
                    print(
                        f"warning: checkpoint {s} is damaged ({w}); resuming from the older {c.name}",
                        file=sys.stderr,
                        flush=True,
                    )
            return c
        skipped.append((c, why))
    if skipped:
        s, w = skipped[0]
        raise CheckpointError(
            f"no intact checkpoint in {save_dir}: the newest, {s.name}, is damaged ({w}) and no older "
            f"one is intact; restore it, or start over with train.resume=none or another train.save_dir"
        )
    return None


def resolve_checkpoint(path: str | Path) -> Path:
    """A run directory (its newest verified checkpoint) or a ``step_N`` directory -> the complete checkpoint."""
    p = Path(path)
    if (p / STATE_FILE).is_file():
        ckpt = p
    elif p.is_dir():
        ckpt = choose_resume(p)
        if ckpt is None:
            raise CheckpointError(f"{p} holds no complete megahash checkpoint (no step_N with {STATE_FILE})")
    else:
        raise CheckpointError(f"checkpoint {p} does not exist")
    if not (ckpt / WEIGHTS_DIR).is_dir():
        raise CheckpointError(f"checkpoint {ckpt} has no {WEIGHTS_DIR}/ weights (saved by an older megahash?)")
    return ckpt


def checkpoint_config(ckpt: Path, overrides: list[str] | None = None):
    """The resolved config saved with a checkpoint, at TP=1 without sequence parallelism."""
    import yaml

    from megahash.config import apply_overrides, config_from_dict, without_retired

    tree = without_retired(yaml.safe_load((ckpt / "resolved_config.yaml").read_text()))
    tree = apply_overrides(tree, list(overrides or []))
    tree["parallel"] = {"tensor": 1, "sequence": False}
    return config_from_dict(tree)
