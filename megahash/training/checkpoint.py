"""Checkpoints: DeepSpeed engine state (model, optimizer/ZeRO partitions, LR scheduler) plus
megahash state (step, consumed samples, per-rank RNG, resolved config).

Layout of ``train.save_dir``::

    step_00000100/            one complete checkpoint (DeepSpeed files + megahash files)
        mp_rank_00_model_states.pt, *_optim_states.pt    (DeepSpeed)
        model/, optimizer/    weights and Adam's state as megatron dist checkpoints (any layout)
        megahash_state.json   step, consumed samples, model signature: written last = complete
        rng_rank00000.json    RNG states of each rank
        resolved_config.yaml
    latest                    name of the newest complete checkpoint (written last, atomically)

A checkpoint is written under ``step_N.tmp`` and renamed when every rank has finished, so an
interrupted save never replaces or damages the previous checkpoint. :func:`save` is synchronous;
``train.async_save`` (megahash/training/async_save.py) uses :func:`begin`, :func:`fail_if_any` and
:func:`publish` around background writers and writes no DeepSpeed files (``deepspeed_files: false``).
"""
from __future__ import annotations

import copy
import json
import os
import shutil
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from megahash import accelerator
from megahash.config import Config, save_config
from megahash.errors import CheckpointError
from megahash.training.checkpoint_files import STATE_FILE, TAG_RE, pin_path, read_state  # noqa: F401 (re-exported)


def tag_for(step: int) -> str:
    return f"step_{step:08d}"


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + f".tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def _to_jsonable(x):
    if isinstance(x, torch.Tensor):
        return {"__tensor__": x.tolist(), "dtype": str(x.dtype).replace("torch.", "")}
    if isinstance(x, np.ndarray):
        return {"__ndarray__": x.tolist(), "dtype": str(x.dtype)}
    if isinstance(x, dict):
        return {k: _to_jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return {"__tuple__": [_to_jsonable(v) for v in x]} if isinstance(x, tuple) else [_to_jsonable(v) for v in x]
    if isinstance(x, (np.integer,)):
        return int(x)
    if isinstance(x, (np.floating,)):
        return float(x)
    return x


def _from_jsonable(x):
    if isinstance(x, dict):
        if "__tensor__" in x:
            return torch.tensor(x["__tensor__"], dtype=getattr(torch, x["dtype"]))
        if "__ndarray__" in x:
            return np.array(x["__ndarray__"], dtype=x["dtype"])
        if "__tuple__" in x:
            return tuple(_from_jsonable(v) for v in x["__tuple__"])
        return {k: _from_jsonable(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_from_jsonable(v) for v in x]
    return x


def model_signature(cfg: Config) -> dict:
    """What must match for a checkpoint to be loaded into a model: the model tree and TP size."""
    return {"model": cfg.to_dict()["model"], "tensor_parallel": cfg.parallel.tensor}


def complete_checkpoints(save_dir: str | Path) -> list[Path]:
    """Complete checkpoints (renamed, with a state file), oldest first."""
    root = Path(save_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if TAG_RE.match(p.name) and (p / STATE_FILE).is_file()]
    return sorted(found, key=lambda p: p.name)


def find_resume(save_dir: str | Path) -> Path | None:
    """The checkpoint ``train.resume=auto`` picks: the newest verified one; damaged newer ones are named
    in a warning, and only damaged ones is an error (megahash/training/checkpoint_faults.py)."""
    from megahash.training.checkpoint_faults import choose_resume

    return choose_resume(save_dir, warn=_rank() == 0)


def check_compatible(ckpt: Path, cfg: Config) -> dict:
    """Raise a one-line CheckpointError if ``ckpt`` was made by another model or TP layout."""
    state = read_state(ckpt)
    saved, now = state.get("signature", {}), model_signature(cfg)
    from megahash.training.elastic import check_layout  # TP size, DP size, ZeRO stage

    check_layout(ckpt, state, cfg, dist.get_world_size() if dist.is_initialized() else 1)  # one line if impossible
    diffs = model_diffs(saved.get("model", {}), cfg)
    if diffs:
        raise CheckpointError(
            f"checkpoint {ckpt} is from another model ({diffs[0]}); use the same model config, "
            f"train.resume=none or another train.save_dir"
        )
    return state


def model_diffs(saved_model: dict, cfg: Config) -> list[str]:
    """Where a checkpoint's model tree differs from ``cfg``'s. The saved tree is read as a config would
    be (kind options under ``options`` even when written before kinds owned them), and an option no
    kind declared when it was written counts at its declared default."""
    from megahash.config import canonical_tree
    from megahash import catalog

    saved_model = canonical_tree({"model": copy.deepcopy(saved_model)})["model"]
    now = model_signature(cfg)["model"]
    for section, group in (("attention", "attention"), ("embed", "embedding")):
        if not isinstance(saved_model.get(section), dict):
            continue
        opts = saved_model[section].setdefault("options", {}) or {}
        specs = catalog.option_specs(group)
        for key in list(opts):
            if key not in specs:
                del opts[key]  # declared by no kind now: the schedule/embedding diff names what changed
        for key, spec in specs.items():
            opts.setdefault(key, spec.default)
        saved_model[section]["options"] = opts
    return _diff(saved_model, now, "model")


def _diff(a, b, path):
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b)):
            out += _diff(a.get(k), b.get(k), f"{path}.{k}")
        return out
    return [] if a == b else [f"{path}: checkpoint {a!r} vs config {b!r}"]


def save(engine, cfg: Config, step: int, consumed: int, extra: dict | None = None) -> Path:
    """Save a complete checkpoint of every rank under ``train.save_dir`` (collective). A failure
    (disk full, permission, state that cannot be written) on any rank removes the partial
    ``step_N.tmp`` and raises one CheckpointError on every rank naming the cause and its remedy; the
    previous checkpoint is untouched (megahash/training/checkpoint_faults.py)."""
    root, tag = Path(cfg.train.save_dir), tag_for(step)
    tmp = root / (tag + ".tmp")
    error = begin(root, tmp)
    try:
        engine.save_checkpoint(str(root), tag=tmp.name, client_state={"megahash_step": step}, save_latest=False)
        from megahash.training.weights import WEIGHTS_DIR, save_weights

        save_weights(engine.module, tmp / WEIGHTS_DIR, cfg.train.zero_stage)
        from megahash.training import ema, optimizer_state  # Adam's state sharded like the weights (elastic resume)

        ema.save(engine, tmp, cfg.train.zero_stage)  # the weight average (train.ema_decay)

        optimizer_state.save(engine, tmp / optimizer_state.OPTIM_DIR, cfg.train.zero_stage)
        write_rng(tmp)
    except Exception as e:  # noqa: BLE001
        error = error or e
    except BaseException as e:  # torch.distributed.checkpoint's CheckpointException (disk full in model/, optimizer/)
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        error = error or e
    if os.environ.get("MEGAHASH_TEST_FAIL_IN_SAVE") == str(step) and error is None:
        error = RuntimeError(f"injected failure while saving step {step} (MEGAHASH_TEST_FAIL_IN_SAVE)")
    fail_if_any(root, tag, tmp, error)
    publish(engine, cfg, tmp, step, consumed, extra)
    return root / tag


def begin(root: Path, tmp: Path) -> BaseException | None:
    """Collective: rank 0 makes ``root`` and clears a leftover ``tmp``; the error, if any (for
    :func:`fail_if_any`)."""
    error = None
    try:
        if _rank() == 0:
            root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
    except Exception as e:  # noqa: BLE001 - reported by fail_if_any on every rank
        error = e
    accelerator.barrier()
    return error


def write_rng(tmp: Path) -> None:
    _atomic_write(tmp / f"rng_rank{_rank():05d}.json", json.dumps(_to_jsonable(accelerator.rng_state())))


def fail_if_any(root: Path, tag: str, tmp: Path, error: BaseException | None) -> None:
    """Collective: if any rank failed, remove ``tmp`` and raise one CheckpointError on every rank."""
    from megahash.training import checkpoint_faults
    from megahash.training.signals import any_rank

    if any_rank(error is not None):
        error = error or RuntimeError("another rank failed to write its part; its log names the cause")
        note = checkpoint_faults.disk_note(root, error)
        _abandon(tmp)
        raise checkpoint_faults.save_failed(root, tag, note, error) from None


def publish(engine, cfg: Config, tmp: Path, step: int, consumed: int, extra: dict | None = None) -> None:
    """Collective, after every rank has written its part of ``tmp``: rank 0 writes the config, the
    manifest and the state file, renames ``tmp`` to ``step_N``, points ``latest`` at it and prunes."""
    root, tag, error = tmp.parent, tag_for(step), None
    try:
        if _rank() == 0:
            from megahash.training import checkpoint_faults

            save_config(cfg, tmp / "resolved_config.yaml")
            checkpoint_faults.write_manifest(tmp)
            state = {"step": step, "consumed_samples": consumed, "signature": model_signature(cfg),
                     "padded_vocab_size": int(engine.module.vocab_size),
                     "world_size": dist.get_world_size() if dist.is_initialized() else 1,
                     "zero_stage": cfg.train.zero_stage,
                     "optimizer": cfg.train.optimizer, **(extra or {})}
            _atomic_write(tmp / STATE_FILE, json.dumps(state, indent=1))
            final = root / tag
            if final.exists():  # re-saving the same step: move the old one aside first
                old = root / (tag + ".old")
                shutil.rmtree(old, ignore_errors=True)
                os.replace(final, old)
                os.replace(tmp, final)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.replace(tmp, final)
            _atomic_write(root / "latest", tag)
            prune(root, cfg.train.keep_last)
    except Exception as e:  # noqa: BLE001
        error = e
    from megahash.training.signals import any_rank

    if any_rank(error is not None):
        error = error or RuntimeError("rank 0 could not finish the save; its log names the cause")
        fail_if_any(root, tag, tmp, error)


def _abandon(tmp: Path) -> None:
    """Remove a partial save (rank 0), then wait for every rank."""
    if _rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        for p in tmp.parent.glob("*.tmp-*") if tmp.parent.is_dir() else ():
            p.unlink(missing_ok=True)
    accelerator.barrier()


def prune(root: Path, keep_last: int) -> None:
    """Delete all but the newest ``keep_last`` complete checkpoints (0 keeps all), except those still
    being evaluated (pinned: eval.interval, megahash/training/eval_during.py)."""
    if keep_last <= 0:
        return
    for old in complete_checkpoints(root)[:-keep_last]:
        if not pin_path(root, old.name).exists():
            shutil.rmtree(old, ignore_errors=True)


def load(engine, ckpt: Path, cfg: Config) -> dict:
    """Load model, optimizer, scheduler and this rank's RNG from ``ckpt``; return the state dict."""
    state = check_compatible(ckpt, cfg)
    from megahash.training.weights import load_weights_only

    if state.get("weights_only"):
        return load_weights_only(engine, ckpt, cfg, state)
    from megahash.training import elastic

    mode = elastic.resume_mode(ckpt, state, cfg, dist.get_world_size() if dist.is_initialized() else 1)
    if mode == "weights":
        # another DP size / ZeRO stage / TP size with train.resume_weights_only=true (checked before
        # DeepSpeed loads anything): the weights at this layout, a fresh optimizer, the LR schedule at the step
        return load_weights_only(engine, ckpt, cfg, state)
    if mode == "elastic":  # another layout: weights and optimizer state from the dist checkpoints
        return elastic.load_elastic(engine, ckpt, cfg, state)
    if state.get("deepspeed_files") is False:  # an asynchronous save (train.async_save): no DeepSpeed files
        elastic.load_elastic(engine, ckpt, cfg, state)  # the megatron pair at this (the saved) layout
    else:
        path, _client = engine.load_checkpoint(str(ckpt.parent), tag=ckpt.name, load_optimizer_states=True,
                                               load_lr_scheduler_states=True)
        if path is None:
            raise CheckpointError(f"DeepSpeed could not load checkpoint {ckpt}; its files are missing or corrupt")
    rng_file = ckpt / f"rng_rank{_rank():05d}.json"
    if rng_file.is_file():
        accelerator.set_rng_state(_from_jsonable(json.loads(rng_file.read_text())))
    return state
