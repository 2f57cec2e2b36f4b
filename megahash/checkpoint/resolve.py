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
from megahash.checkpoint.manifest import INFERENCE_SCOPE, LEVELS, MANIFEST, damage, unverified
from megahash.errors import CheckpointError


def complete_checkpoints(save_dir: str | Path) -> list[Path]:
    """Complete checkpoints (renamed, with a state file), oldest first."""
    root = Path(save_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if TAG_RE.match(p.name) and (p / STATE_FILE).is_file()]
    return sorted(found, key=lambda p: p.name)


def not_a_checkpoint(resume: str) -> CheckpointError:
    """The one line for a ``train.resume=PATH`` without a state file; a run directory's names its newest
    complete checkpoint as the value to give (``train.resume`` takes a ``step_N`` folder)."""
    found = complete_checkpoints(resume)
    if found:
        return CheckpointError(
            f"train.resume={resume} is a run directory, not a checkpoint; name one of its checkpoints, "
            f"e.g. train.resume={found[-1]}"
        )
    return CheckpointError(
        f"train.resume={resume} is not a complete megahash checkpoint (no {STATE_FILE}); name a step_N folder "
        f"of a run, or train.resume=auto"
    )


def candidates(save_dir: Path) -> list[Path]:
    """``step_N`` folders of ``save_dir`` newest first (complete or not)."""
    if not save_dir.is_dir():
        return []
    return sorted(
        (p for p in save_dir.iterdir() if p.is_dir() and TAG_RE.match(p.name)), key=lambda p: p.name, reverse=True
    )


def choose_resume(
    save_dir: str | Path, warn: bool = True, level: str = "cheap", judge=None, quiet=frozenset()
) -> Path | None:
    """The newest verified checkpoint of ``save_dir`` (``train.resume=auto``); None if it has none.
    ``level``: ``train.verify_checkpoint`` (manifest.damage); ``judge(ckpt)``: the verdict instead of
    ``damage(ckpt, level)`` (several ranks verifying together). Each damaged newer checkpoint (but
    those in ``quiet``, named before) is named in a warning line, and so is what the chosen one's
    manifest cannot vouch for (``warn``: print them, rank 0)."""
    save_dir = Path(save_dir)
    judge = judge or (lambda c: damage(c, level))
    skipped = []
    for c in candidates(save_dir):
        why = judge(c)
        if why is None:
            if warn:
                for s, w in (x for x in skipped if x[0] not in quiet):
                    _warn(f"checkpoint {s} is damaged ({w}); resuming from the older {c.name}")
                warn_unverified(c, level)
            return c
        skipped.append((c, why))
    if skipped:
        s, w = skipped[0]
        raise CheckpointError(
            f"no intact checkpoint in {save_dir}: the newest, {s.name}, is damaged ({w}) and no older "
            f"one is intact; restore it, or start over with train.resume=none or another train.save_dir"
        )
    return None


def _warn(text: str) -> None:
    print(f"warning: {text}", file=sys.stderr, flush=True)


def warn_unverified(ckpt: Path, level: str) -> None:
    """At ``level`` full: one warning line when the manifest of ``ckpt`` cannot vouch for every file
    (manifest.unverified). (``cheap`` promises no content check to begin with.)"""
    why = unverified(ckpt) if level == "full" else None
    if why:
        _warn(
            f"checkpoint {ckpt} is only partly verified: {why}; the zip structure and checksums of its "
            f"torch files were checked"
        )


def verify_level(overrides: list[str] | None = None) -> str:
    """``train.verify_checkpoint`` of a command reading a checkpoint: its default, or the value of a
    ``train.verify_checkpoint=...`` override (one-line error if it is not cheap or full)."""
    from megahash.config import TrainConfig
    from megahash.errors import ConfigError

    level = TrainConfig.verify_checkpoint
    for o in overrides or []:
        key, _, value = o.partition("=")
        if key.strip() == "train.verify_checkpoint":
            level = value.strip()
    if level not in LEVELS:
        raise ConfigError(f"config key 'train.verify_checkpoint' must be cheap or full, got {level!r}")
    return level


def resolve_checkpoint(path: str | Path, level: str = "cheap", scope=None) -> Path:
    """A run directory (its newest verified checkpoint) or a ``step_N`` directory -> the complete
    checkpoint, verified at ``level`` over ``scope`` (manifest.damage; one-line CheckpointError if
    the step directory named is damaged)."""
    p = Path(path)
    judge = lambda c: damage(c, level, scope=scope)  # noqa: E731
    if p.suffix == ".tmp" and TAG_RE.match(p.stem):  # was read (a half-published save) or "holds no checkpoint"
        newest = complete_checkpoints(p.parent)
        raise CheckpointError(
            f"{p} is an unfinished save (its run stopped while writing it, or is writing it now); name the run "
            f"directory {p.parent}"
            + (f" (its newest complete checkpoint is {newest[-1].name})" if newest else " once a save completes")
        )
    if (p / STATE_FILE).is_file():
        ckpt = p
        why = judge(ckpt)
        if why:
            raise CheckpointError(
                f"checkpoint {ckpt} is damaged ({why}); use another checkpoint (its run directory picks the newest intact one)"
            )
        warn_unverified(ckpt, level)
    elif p.is_dir():
        ckpt = choose_resume(p, level=level, judge=judge)
        if ckpt is None:
            raise CheckpointError(f"{p} holds no complete megahash checkpoint (no step_N with {STATE_FILE})")
    elif p.exists():
        raise CheckpointError(f"checkpoint {p} is a file; pass a run directory or one of its step_N directories")
    else:
        raise CheckpointError(f"checkpoint {p} does not exist")
    if not (ckpt / WEIGHTS_DIR).is_dir():
        raise CheckpointError(f"checkpoint {ckpt} has no {WEIGHTS_DIR}/ weights (saved by an older megahash?)")
    return ckpt


_verified: set = set()  # (step dir, level, its manifest's mtime) of checkpoints verified for inference here


def _verified_key(ckpt: Path, level: str):
    try:
        return (ckpt.resolve(), level, (ckpt / MANIFEST).stat().st_mtime_ns)
    except OSError:
        return None


def resolve_for_inference(path: str | Path, overrides: list[str] | None = None) -> Path:
    """:func:`resolve_checkpoint` for evaluation and export: the files they read (model/, ema/, the
    config: manifest.INFERENCE_SCOPE) verified at ``train.verify_checkpoint`` (its default, full, or the
    override's; :func:`verify_level`), once per process and checkpoint."""
    level, p = verify_level(overrides), Path(path)
    if _verified_key(p, level) in _verified:
        return p
    ckpt = resolve_checkpoint(p, level, INFERENCE_SCOPE)
    if (key := _verified_key(ckpt, level)) is not None:
        _verified.add(key)
    return ckpt


READ_ATTEMPTS = 3  # reads of a run directory's newest checkpoint while its run publishes and prunes


def read_while_kept(path: str | Path, read, overrides: list[str] | None = None):
    """``read(ckpt)`` of the checkpoint :func:`resolve_for_inference` picks from ``path``, again from the newest
    when a running training pruned it meanwhile (``train.keep_last``: evaluating or exporting ``latest`` while the
    run saves). A failure while the run directory's ``step_N`` folders changed is taken for that and retried
    (:data:`READ_ATTEMPTS` in all); a named ``step_N`` that is gone after a failed read is one line saying so.
    Before, such a read failed with whatever the vanished files looked like: "it is incomplete", "its config is
    not the weights' (damaged or edited)", "no intact checkpoint ...; start over with train.resume=none"."""
    p = Path(path)
    named = (p / STATE_FILE).is_file()
    run_dir = p.parent if named else p
    for attempt in range(READ_ATTEMPTS):
        before = [c.name for c in candidates(run_dir)]
        ckpt = None
        try:
            ckpt = resolve_for_inference(p, overrides)
            return read(ckpt)
        except (CheckpointError, OSError):
            gone = ckpt is not None and not (ckpt / STATE_FILE).is_file()
            if named:
                if gone or not (p / STATE_FILE).is_file():
                    newest = complete_checkpoints(run_dir)
                    raise CheckpointError(
                        f"checkpoint {p} was removed while it was read (a run saving into {run_dir} prunes older "
                        f"checkpoints: train.keep_last); name the run directory {run_dir}"
                        + (f" (its newest is now {newest[-1].name})" if newest else "")
                        + " or copy the checkpoint elsewhere first"
                    ) from None
                raise
            if [c.name for c in candidates(run_dir)] == before and not gone:
                raise  # nothing moved: the checkpoint itself is at fault
            if attempt + 1 == READ_ATTEMPTS:
                raise CheckpointError(
                    f"{run_dir}: its newest checkpoint was removed while it was read {READ_ATTEMPTS} times (a run "
                    f"saving into it prunes older checkpoints: train.keep_last); copy a checkpoint elsewhere first and name "
                    f"the copy, or give the run a larger train.keep_last"
                ) from None


def _intact_here(ckpt: Path, written_here) -> bool:
    """This install signed the checkpoint's manifest and resolved_config.yaml is the file the manifest lists
    (its sha256, whatever train.verify_checkpoint is)."""
    import hashlib

    from megahash.checkpoint.manifest import read_manifest

    try:
        if not written_here(ckpt):
            return False
        entry = (read_manifest(ckpt) or {}).get("resolved_config.yaml") or {}
        digest = hashlib.sha256((ckpt / "resolved_config.yaml").read_bytes()).hexdigest()
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False
    return isinstance(entry, dict) and entry.get("sha256") == digest


def checkpoint_config(ckpt: Path, overrides: list[str] | None = None):
    """The resolved config saved with a checkpoint, at TP=1 without sequence parallelism."""
    from megahash import safe_yaml
    from megahash.config import apply_overrides, config_from_dict, migrate, without_retired
    from megahash.config_checks import check_fields
    from megahash.errors import ConfigError

    path = ckpt / "resolved_config.yaml"  # read within safe_yaml's bounds (a hostile file: one line)
    saved = safe_yaml.load(path.read_text(), str(path))
    if not isinstance(saved, dict):  # an empty file, a list, a scalar: a TypeError traceback below
        raise CheckpointError(f"{path} holds a {type(saved).__name__}, not a config; the checkpoint is damaged")
    try:  # the saved values in their ranges (hidden_size: -32 was a negative-dimension traceback in megatron)
        check_fields(config_from_dict(saved))
    except ConfigError as e:
        newer = (
            "; a key this megahash does not know: the checkpoint was saved by a newer megahash (read it with that "
            "release, or upgrade) or the file was edited"
            if str(e).startswith("unknown config key")
            else ""
        )
        raise CheckpointError(f"{path}: {e}{newer}") from None
    plugins = (saved.get("model") or {}).get("plugins")
    if plugins:  # modules the file names are imported: only those this process knows, or this install's run's
        from megahash import catalog
        from megahash.checkpoint.origin import written_here

        catalog.check_foreign_plugins(plugins, str(path), trusted=_intact_here(ckpt, written_here))
    # an earlier release's keys under their current names before the overrides (which use the current ones)
    tree = migrate(without_retired(saved))
    tree = apply_overrides(tree, list(overrides or []))
    tree["parallel"] = {"tensor": 1, "sequence": False}
    cfg = config_from_dict(tree)
    if overrides:  # what the user set is held to its range, as at training (eval.batch_size=0: one line)
        from megahash.config_checks import check_ranges

        check_ranges(cfg)
    return cfg
