"""Resuming at another layout (TP size, data-parallel size, ZeRO stage): detection, the elastic
resume with optimizer state, and the weights-only continuation (docs/resume.md).

DeepSpeed's own checkpoint files (model states, ZeRO optimizer partitions) load only into the
layout that wrote them (ZeRO-1 <-> ZeRO-2 at the same sizes excepted); loading them elsewhere ends
in a long DeepSpeed traceback. :func:`resume_mode` compares the layout recorded in
``megahash_state.json`` with the run's before DeepSpeed loads anything:

- same layout: DeepSpeed loads its own files (bit-exact resume);
- another layout: the weights come from the TP-independent megatron dist checkpoint (``model/``),
  Adam's moments, step count and (bf16) fp32 masters from the second one (``optimizer/``,
  megahash/checkpoint/optimizer_state.py), the LR schedule is put at the saved step;
- ``train.resume_weights_only=true``: the weights only, a fresh optimizer;
- another layout and no movable optimizer state (a checkpoint of an older megahash, an optimizer
  megahash cannot address per parameter): one line naming both layouts and the reason, offering
  ``train.resume_weights_only=true``.

The data order continues exactly at any DP size: sampling is a pure function of the consumed-sample
count (global sample ids in order, each DP rank taking its slice of every global batch).
"""

from __future__ import annotations

from pathlib import Path

from megahash.errors import CheckpointError


def layout(cfg, world: int) -> dict:
    """The checkpoint layout of a run: TP size, DP size, ZeRO stage, optimizer (train.optimizer: another one's
    state is not DeepSpeed's to load; megahash/training/muon.py)."""
    return {
        "tensor_parallel": cfg.parallel.tensor,
        "data_parallel": world // cfg.parallel.tensor,
        "zero_stage": cfg.train.zero_stage,
        "optimizer": cfg.train.optimizer,
    }


def saved_layout(state: dict, ckpt: Path) -> dict:
    """The layout recorded in a checkpoint (ZeRO stage from its resolved config for older ones)."""
    tp = int(state.get("signature", {}).get("tensor_parallel", 1))
    out = {"tensor_parallel": tp, "data_parallel": int(state.get("world_size", tp)) // tp}
    if "zero_stage" in state:
        out["zero_stage"] = int(state["zero_stage"])
    else:
        from megahash import safe_yaml

        path = ckpt / "resolved_config.yaml"
        try:
            out["zero_stage"] = int(safe_yaml.load(path.read_text(), str(path))["train"]["zero_stage"])
        except safe_yaml.YAMLLimitError:
            raise  # a hostile file: one line
        except (OSError, KeyError, TypeError, ValueError):
            out["zero_stage"] = None
    out["optimizer"] = state.get("optimizer", "adamw")  # checkpoints before train.optimizer: AdamW
    return out


def _same(old: dict, new: dict) -> bool:
    if old == new:
        return True
    # DeepSpeed loads ZeRO-1 and ZeRO-2 partitions into each other at the same sizes
    return {old.get("zero_stage"), new["zero_stage"]} <= {1, 2} and all(
        old.get(k) == new[k] for k in ("tensor_parallel", "data_parallel", "optimizer")
    )


def resume_mode(ckpt: Path, state: dict, cfg, world: int) -> str:
    """How ``ckpt`` resumes in this run: ``"same"`` (DeepSpeed loads its files), ``"elastic"`` (another
    layout with the optimizer state of ``optimizer/``) or ``"weights"`` (weights only, fresh optimizer).
    One-line CheckpointError when the layout changed and no optimizer state can follow."""
    if state.get("weights_only"):
        return "same"  # a weights-only checkpoint (import-hf) loads its weights at any layout
    old, new = saved_layout(state, ckpt), layout(cfg, world)
    if _same(old, new):
        return "same"
    if cfg.train.resume_weights_only:
        return "weights"
    if old.get("optimizer") not in (None, new["optimizer"]):  # refused before loading: no damage to fall back from
        raise CheckpointError(
            f"checkpoint {ckpt} holds the state of train.optimizer={old['optimizer']} and this run uses "
            f"{new['optimizer']}, which cannot take it: resume with train.optimizer={old['optimizer']}, or continue "
            f"from its weights with a fresh optimizer: train.resume_weights_only=true (docs/resume.md)"
        )
    from megahash.checkpoint.optimizer_state import OPTIM_DIR, read_info

    info = read_info(ckpt / OPTIM_DIR)
    if info.get("complete"):
        return "elastic"
    diff = ", ".join(f"{k.replace('_', ' ')} {old.get(k)} -> {new[k]}" for k in new if old.get(k) != new[k])
    raise CheckpointError(
        f"checkpoint {ckpt} was saved at another layout ({diff}) and its optimizer state cannot follow "
        f"({info['reason']}): resume with the saved sizes, or continue from its weights with a fresh optimizer: "
        f"train.resume_weights_only=true (docs/resume.md)"
    )


def check_layout(ckpt: Path, state: dict, cfg, world: int) -> bool:
    """True: load the weights only (``train.resume_weights_only=true`` at another layout); False otherwise
    (same layout, or another one with its optimizer state). One-line CheckpointError if impossible."""
    return resume_mode(ckpt, state, cfg, world) == "weights"


def load_elastic(engine, ckpt: Path, cfg, state: dict) -> dict:
    """Resume at another layout: weights from ``model/`` and the LR schedule at the saved step (as the
    weights-only continuation does), then Adam's state from ``optimizer/`` into this run's partitions."""
    from megahash.checkpoint.optimizer_state import OPTIM_DIR, load

    load_weights_only(engine, ckpt, cfg, state)
    load(engine, ckpt / OPTIM_DIR, cfg.train.zero_stage)
    step = int(state.get("step", 0))
    engine.global_steps = step  # DeepSpeed's own counters, as its checkpoint load sets them
    from megahash.data.samples import consumed_samples

    engine.global_samples = int(state.get("consumed_samples", consumed_samples(cfg.train, step)))
    return state


def load_weights_only(engine, ckpt: Path, cfg, state: dict) -> dict:
    """A checkpoint holding only model weights (``megahash import-hf``, marked ``weights_only``):
    load them from its megatron dist checkpoint at this run's TP size; the optimizer starts fresh
    (its fp32 master copies are refreshed from the loaded weights) and the LR scheduler is
    fast-forwarded to the checkpoint's step."""
    from megahash.checkpoint.layout import WEIGHTS_DIR
    from megahash.checkpoint.weights import gathered, load_weights

    with gathered(engine.module, cfg.train.zero_stage, modifier_rank=0):
        load_weights(engine.module, ckpt / WEIGHTS_DIR)
    refresh = getattr(engine.optimizer, "refresh_fp32_params", None)
    if refresh is not None:
        refresh()
    scheduler = getattr(engine, "lr_scheduler", None)
    if scheduler is not None:
        for _ in range(int(state.get("step", 0))):
            scheduler.step()
    return state
