"""Saving and resuming a training run: DeepSpeed engine state (model, optimizer/ZeRO partitions, LR
scheduler) plus megahash state (step, consumed samples, per-rank RNG, resolved config).

The files of a checkpoint and their formats are megahash/checkpoint/ (layout.py names them).

A checkpoint is written under ``step_N.tmp`` and renamed when every rank has finished, so an
interrupted save never replaces or damages the previous checkpoint. :func:`save` is synchronous;
``train.async_save`` (megahash/training/async_save.py) uses :func:`begin`, :func:`fail_if_any` and
:func:`publish` around background writers and writes no DeepSpeed files (``deepspeed_files: false``).
Both save the training features' parts by iterating the run's hooks (megahash/training/hooks.py): their
folders (``save_files``, e.g. the weight average's ``ema/``) and their states in the state file
(``state_dict``, under each hook's name, e.g. ``step_guard``); a resume gives them back the same way.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import torch.distributed as dist

from megahash.accelerator import process_groups
from megahash.atomic_write import write_text_atomic
from megahash.checkpoint.layout import STATE_FILE, STATE_FORMAT, WEIGHTS_DIR, pin_path, read_state, tag_for
from megahash.checkpoint.manifest import damage
from megahash.checkpoint.resolve import candidates, choose_resume, complete_checkpoints, warn_unverified
from megahash.checkpoint.signature import model_diffs, model_signature
from megahash.config import Config, save_config
from megahash.errors import CheckpointError


def find_resume(save_dir: str | Path, level: str = "cheap", failed: dict | None = None) -> Path | None:
    """The checkpoint ``train.resume=auto`` picks: the newest one verified at ``level``
    (``train.verify_checkpoint``; the ranks share the hashing and agree on the verdict); damaged newer
    ones are named in a warning, and only damaged ones is an error (megahash/checkpoint/resolve.py).
    ``failed``: checkpoints that failed to load in this process (path -> why): damaged too; the ones
    newer than the last of them were named in an earlier warning."""
    failed = failed or {}
    last = min(failed, key=lambda c: c.name) if failed else None
    quiet = {c for c in candidates(Path(save_dir)) if last is not None and c.name > last.name}

    def judge(ckpt: Path) -> str | None:
        return failed[ckpt] if ckpt in failed else _agreed(damage(ckpt, level, share=_share()))

    return choose_resume(save_dir, warn=process_groups.rank() == 0, level=level, judge=judge, quiet=quiet)


def verify_named(ckpt: Path, level: str) -> None:
    """``train.resume=PATH``: one-line CheckpointError if that checkpoint is damaged (no fallback)."""
    why = _agreed(damage(ckpt, level, share=_share()))
    if why:
        raise CheckpointError(
            f"train.resume={ckpt} is damaged ({why}); resume from another checkpoint "
            f"(train.resume=auto takes the newest intact one)"
        )
    if process_groups.rank() == 0:
        warn_unverified(ckpt, level)


def _share() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def _agreed(why: str | None) -> str | None:
    """Collective: the first damage any rank found (in rank order), on every rank."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return why
    found = [None] * dist.get_world_size()
    dist.all_gather_object(found, why)
    return next((w for w in found if w), None)


def check_compatible(ckpt: Path, cfg: Config) -> dict:
    """Raise a one-line CheckpointError if ``ckpt`` was made by another model or TP layout."""
    state = read_state(ckpt)
    saved = state.get("signature", {})
    from megahash.training.elastic import check_layout  # TP size, DP size, ZeRO stage

    check_layout(ckpt, state, cfg, dist.get_world_size() if dist.is_initialized() else 1)  # one line if impossible
    diffs = model_diffs(saved.get("model", {}), cfg)
    rows = _vocab_rows_diff(state, cfg)
    if rows is not None:  # model.vocab_size 0 takes the tokenizer's: the rows, not the spelling, must match
        diffs = [rows] if rows else [d for d in diffs if not d.startswith("model.vocab_size:")]
    if diffs:
        raise CheckpointError(
            f"checkpoint {ckpt} is from another model ({diffs[0]}); use the same model config, "
            f"train.resume=none or another train.save_dir"
        )
    if (ids := _special_ids_diff(ckpt, cfg)) is not None:
        raise CheckpointError(
            f"checkpoint {ckpt} was trained with a tokenizer of special ids {ids[0]}, data.prefix's is of {ids[1]} "
            f"({cfg.data.tokenizer or 'the shard meta'}): its rows are another tokenizer's pieces; use the run's "
            f"tokenizer and shards, train.resume=none or another train.save_dir"
        )
    return state


def _special_ids_diff(ckpt: Path, cfg: Config) -> tuple[dict, dict] | None:
    """(checkpoint's, run's) special ids by role where they differ, else None. Equal padded rows do not make the
    same tokenizer (a GPT-2-style BPE of 1,201 pieces and a Llama-style one of 1,200 both pad to 1,280): a resume
    on another tokenizer's shards trained on silently. The checkpoint's ids are its resolved config's
    ``data.special_ids``, the run's those of the first shard set's meta with the config's roles over them
    (:func:`megahash.data.dataset.record_special_ids`); a side that records none is not compared."""
    from megahash import safe_yaml
    from megahash.data.verify import blend_paths, read_meta
    from megahash.tokenization import special_ids_of

    def entry(tree, *keys):  # tree[k0][k1]..., None where a level is missing or not a mapping (a crafted file)
        for k in keys:
            tree = tree.get(k) if isinstance(tree, dict) else None
        return tree

    path = ckpt / "resolved_config.yaml"
    saved = safe_yaml.load(path.read_text(), str(path)) if path.is_file() else None
    mine = entry(saved, "data", "special_ids")
    paths = blend_paths(list(cfg.data.prefix))[0] if cfg.data.prefix else []
    made = entry(read_meta(paths[0], required=False), "tokenizer", "special_ids") if paths else None
    if not isinstance(mine, dict) or not isinstance(made, dict) or not mine or not made:
        return None
    if not all(i is None or type(i) is int for i in [*mine.values(), *made.values()]):
        return None  # ids that are not integers: the checkpoint's and the shards' own checks name them
    given = {r: i for r, i in (cfg.data.special_ids or {}).items() if i is not None}
    theirs = special_ids_of({**special_ids_of(made), **given})
    mine = special_ids_of(mine)
    return None if mine == theirs else (mine, theirs)


def _vocab_rows_diff(state: dict, cfg: Config) -> str | None:
    """Where one side's ``model.vocab_size`` is 0 (the tokenizer's), the saved model tree cannot tell another
    tokenizer's vocabulary: compare the checkpoint's embedding rows (``padded_vocab_size``, at its TP size) with the
    rows this run's vocabulary pads to there. None: not applicable (both sizes explicit, or an old checkpoint);
    "": the same rows; else the difference."""
    saved_model = state.get("signature", {}).get("model", {})
    saved_rows = int(state.get("padded_vocab_size") or 0)
    if not saved_rows or (saved_model.get("vocab_size") and cfg.model.vocab_size):
        return None
    from megahash.data.dataset import run_vocab_size
    from megahash.models.cost_formulas import padded_vocab_size

    vocab = run_vocab_size(cfg)
    tp = int(state.get("signature", {}).get("tensor_parallel") or 1)
    rows = padded_vocab_size(vocab, int(saved_model.get("make_vocab_size_divisible_by") or 1), tp)
    if rows == saved_rows:
        return ""
    source = f"model.vocab_size={vocab}" if cfg.model.vocab_size else f"the tokenizer's {vocab} ids"
    return f"vocabulary: checkpoint {saved_rows} embedding rows vs {rows} for {source}; use the checkpoint's data.tokenizer and model.vocab_size"


def save(engine, cfg: Config, step: int, consumed: int, hooks=None, hashes: bool = True) -> Path:
    """Save a complete checkpoint of every rank under ``train.save_dir`` (collective). A failure
    (disk full, permission, state that cannot be written) on any rank removes the partial
    ``step_N.tmp`` and raises one CheckpointError on every rank naming the cause and its remedy; the
    previous checkpoint is untouched (megahash/training/checkpoint_faults.py).

    Each rank hashes the files it wrote while the rest of the save goes on (megahash/checkpoint/digest.py):
    DeepSpeed's files as each is written, the dist checkpoints as each is complete; ``model/`` is
    written last, so the hashes still to wait for at the end are of its files alone. ``hooks``: the run's
    (megahash.training.hooks.Hooks), whose folders and states the checkpoint keeps. ``hashes=False``:
    a manifest of sizes only (the benchmark's baseline, benchmarks/bench_checkpoint_hash.py)."""
    from megahash.checkpoint import digest, optimizer_state  # Adam's state sharded like the weights (elastic resume)
    from megahash.checkpoint.rng import write_rng
    from megahash.checkpoint.weights import save_weights
    from megahash.training.engine_patches import hashing_saves

    root, tag = Path(cfg.train.save_dir), tag_for(step)
    tmp = root / (tag + ".tmp")
    error = begin(root, tmp)
    native = optimizer_state.native_files(engine)  # sharded Muon writes no DeepSpeed files (optimizer/ holds it all)
    hasher = digest.Hasher(tmp, process_groups.rank()) if hashes else None
    try:
        if native:
            with hashing_saves(engine, hasher):
                engine.save_checkpoint(str(root), tag=tmp.name, client_state={"megahash_step": step}, save_latest=False)
        optimizer_state.save(engine, tmp / optimizer_state.OPTIM_DIR, cfg.train.zero_stage)
        _hash_rank_files(hasher, tmp / optimizer_state.OPTIM_DIR)
        for folder in hooks.save_files(engine, tmp, cfg.train.zero_stage) if hooks is not None else ():
            _hash_rank_files(hasher, tmp / folder)  # a feature's own folder (the weight average's ema/)
        save_weights(engine.module, tmp / WEIGHTS_DIR, cfg.train.zero_stage)
        _hash_rank_files(hasher, tmp / WEIGHTS_DIR)
        write_rng(tmp)
        if hasher is not None:
            hasher.close()  # this rank's digests into its sidecar, for the manifest
    except Exception as e:
        error = error or e
    except BaseException as e:  # torch.distributed.checkpoint's CheckpointException (disk full in model/, optimizer/)
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        error = error or e
    finally:
        if hasher is not None:  # (after a failure: its hashing stopped, the digests dropped)
            hasher.close(write=False)
    if os.environ.get("MEGAHASH_TEST_FAIL_IN_SAVE") == str(step) and error is None:
        error = RuntimeError(f"injected failure while saving step {step} (MEGAHASH_TEST_FAIL_IN_SAVE)")
    fail_if_any(root, tag, tmp, error)
    extra = {**(hooks.state_dicts() if hooks is not None else {}), **({} if native else {"deepspeed_files": False})}
    publish(engine, cfg, tmp, step, consumed, extra, hashes=hashes)
    return root / tag


class Saver:
    """The run's synchronous saves (``run.saver`` unless ``train.async_save``'s writer replaces it:
    megahash/training/async_save.py): each one's stall logged (split ``checkpoint``)."""

    def checkpoint(self, run, step: int, wait: bool) -> None:
        """Collective: the checkpoint of ``step`` (``wait``: always, here)."""
        t0 = time.perf_counter()
        save(run.engine, run.cfg, step, run.consumed(step), run.hooks)
        run.log.log(
            step, {"saved_step": step, "stall_s": time.perf_counter() - t0, "async": 0}, "checkpoint", echo=False
        )

    def poll(self, run) -> None:
        """Every step: nothing in flight."""

    def flush(self) -> None:
        """Before a stop: nothing in flight."""


def _hash_rank_files(hasher, folder: Path) -> None:
    if hasher is not None:
        hasher.submit_rank_files(folder)


def begin(root: Path, tmp: Path) -> BaseException | None:
    """Collective: rank 0 makes ``root`` and clears a leftover ``tmp``; the error, if any (for
    :func:`fail_if_any`)."""
    error = None
    try:
        if process_groups.rank() == 0:
            root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
    except Exception as e:  # reported by fail_if_any on every rank
        error = e
    process_groups.barrier()
    return error


def fail_if_any(root: Path, tag: str, tmp: Path, error: BaseException | None, saved: bool = False) -> None:
    """Collective: if any rank failed, remove ``tmp`` and raise one CheckpointError on every rank. ``saved``
    (rank 0): ``tag`` was already published when the error came (updating ``latest``, pruning): it says so."""
    from megahash.training import checkpoint_faults
    from megahash.training.signals import any_rank

    if any_rank(error is not None):
        error = error or RuntimeError("another rank failed to write its part; its log names the cause")
        note = checkpoint_faults.disk_note(root, error)
        _abandon(tmp)
        if saved:
            raise checkpoint_faults.saved_but(root, tag, note, error) from None
        raise checkpoint_faults.save_failed(root, tag, note, error) from None


def publish(
    engine, cfg: Config, tmp: Path, step: int, consumed: int, extra: dict | None = None, hashes: bool = True
) -> None:
    """Collective, after every rank has written its part of ``tmp`` (and its sidecar of digests): rank 0
    writes the config, the manifest (``hashes=False``: sizes only) and the state file, renames ``tmp``
    to ``step_N``, points ``latest`` at it and prunes."""
    root, tag, error, saved = tmp.parent, tag_for(step), None, False
    try:
        if process_groups.rank() == 0:
            from megahash.checkpoint.manifest import write_manifest
            from megahash.checkpoint.origin import sign

            save_config(cfg, tmp / "resolved_config.yaml")
            write_manifest(tmp, hashes)
            sign(tmp)  # this install wrote it (megahash/checkpoint/origin.py)
            state = {
                "format": STATE_FORMAT,
                "step": step,
                "consumed_samples": consumed,
                "signature": model_signature(cfg),
                "padded_vocab_size": int(engine.module.vocab_size),
                "world_size": dist.get_world_size() if dist.is_initialized() else 1,
                "zero_stage": cfg.train.zero_stage,
                "optimizer": cfg.train.optimizer,
                **(extra or {}),
            }
            write_text_atomic(tmp / STATE_FILE, json.dumps(state, indent=1))
            final = root / tag
            if final.exists():  # re-saving the same step: move the old one aside first
                old = root / (tag + ".old")
                shutil.rmtree(old, ignore_errors=True)
                os.replace(final, old)
                os.replace(tmp, final)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.replace(tmp, final)
            saved = True  # complete and resumable from here on (what follows only points at it and prunes)
            write_text_atomic(root / "latest", tag)
            prune(root, cfg.train.keep_last)
    except Exception as e:
        error = e
    from megahash.training.signals import any_rank

    if any_rank(error is not None):
        error = error or RuntimeError("rank 0 could not finish the save; its log names the cause")
        fail_if_any(root, tag, tmp, error, saved)


def _abandon(tmp: Path) -> None:
    """Remove a partial save (rank 0), then wait for every rank. Retried for a while: a killed background
    writer's file writers (megahash/training/async_save.py) die with it a moment later, and a file one of
    them creates meanwhile makes a single ``rmtree`` leave the folder behind."""
    if process_groups.rank() == 0:
        deadline = time.monotonic() + 30
        shutil.rmtree(tmp, ignore_errors=True)
        while tmp.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
            shutil.rmtree(tmp, ignore_errors=True)
        for p in tmp.parent.glob("*.tmp-*") if tmp.parent.is_dir() else ():
            p.unlink(missing_ok=True)
    process_groups.barrier()


def prune(root: Path, keep_last: int) -> None:
    """Delete all but the newest ``keep_last`` complete checkpoints (0 keeps all), except those still
    being evaluated (pinned: eval.interval, megahash/training/eval_during.py)."""
    if keep_last <= 0:
        return
    for old in complete_checkpoints(root)[:-keep_last]:
        if not pin_path(root, old.name).exists():
            shutil.rmtree(old, ignore_errors=True)


def deepspeed_loading(engine, ckpt: Path, cfg: Config):
    """Collective: how DeepSpeed reads the files of ``ckpt`` (megahash/checkpoint/deepspeed_files.py): weights-only;
    with its own pickle only for a trusted checkpoint (``train.trust_checkpoint`` or written by this install) whose
    files need more; otherwise one CheckpointError on every rank before anything is unpickled."""
    import contextlib

    from megahash.checkpoint import deepspeed_files
    from megahash.checkpoint.origin import written_here
    from megahash.training.signals import any_rank

    unsafe = deepspeed_files.unsafe_globals(ckpt)
    if not any_rank(bool(unsafe)):
        return deepspeed_files.weights_only_engine(engine)
    trusted = cfg.train.trust_checkpoint or written_here(ckpt)
    if any_rank(not trusted):
        raise deepspeed_files.refused(ckpt, unsafe)
    if process_groups.rank() == 0:
        why = "train.trust_checkpoint=true" if cfg.train.trust_checkpoint else "this install wrote it"
        print(f"megahash: loading the DeepSpeed files of {ckpt} with pickle ({why})", flush=True)
    return contextlib.nullcontext()


def load(engine, ckpt: Path, cfg: Config) -> dict:
    """Load model, optimizer, scheduler and this rank's RNG from ``ckpt``; return the state dict."""
    state = check_compatible(ckpt, cfg)
    from megahash.training import elastic

    if state.get("weights_only"):
        return elastic.load_weights_only(engine, ckpt, cfg, state)

    mode = elastic.resume_mode(ckpt, state, cfg, dist.get_world_size() if dist.is_initialized() else 1)
    if mode == "weights":
        # another DP size / ZeRO stage / TP size with train.resume_weights_only=true (checked before
        # DeepSpeed loads anything): the weights at this layout, a fresh optimizer, the LR schedule at the step
        return elastic.load_weights_only(engine, ckpt, cfg, state)
    if mode == "elastic":  # another layout: weights and optimizer state from the dist checkpoints
        return elastic.load_elastic(engine, ckpt, cfg, state)
    if state.get("deepspeed_files") is False:  # an asynchronous save (train.async_save): no DeepSpeed files
        elastic.load_elastic(engine, ckpt, cfg, state)  # the megatron pair at this (the saved) layout
    else:
        with deepspeed_loading(engine, ckpt, cfg):
            path, _client = engine.load_checkpoint(
                str(ckpt.parent), tag=ckpt.name, load_optimizer_states=True, load_lr_scheduler_states=True
            )
        if path is None:
            raise CheckpointError(f"DeepSpeed could not load checkpoint {ckpt}; its files are missing or corrupt")
    from megahash.checkpoint.rng import load_rng

    load_rng(ckpt)
    return state
