"""Resuming at another layout (TP size, data-parallel size, ZeRO stage): detection and the
weights-only continuation (docs/resume.md).

DeepSpeed's own checkpoint files (model states, ZeRO optimizer partitions) load only into the
layout that wrote them (ZeRO-1 <-> ZeRO-2 at the same sizes excepted); loading them elsewhere ends
in a long DeepSpeed traceback. :func:`check_layout` compares the layout recorded in
``megahash_state.json`` with the run's before DeepSpeed loads anything: a change is one line naming
both layouts and the documented continuation, ``train.resume_weights_only=true``, which loads the
TP-independent megatron dist checkpoint of the weights (``model/``) at the new layout, starts the
optimizer afresh and puts the LR schedule at the saved step. The data order continues exactly at
any DP size: sampling is a pure function of the consumed-sample count (global sample ids in
order, each DP rank taking its slice of every global batch).
"""
from __future__ import annotations

from pathlib import Path

from megahash.errors import CheckpointError


def layout(cfg, world: int) -> dict:
    """The checkpoint layout of a run: TP size, DP size, ZeRO stage."""
    return {"tensor_parallel": cfg.parallel.tensor, "data_parallel": world // cfg.parallel.tensor,
            "zero_stage": cfg.train.zero_stage}


def saved_layout(state: dict, ckpt: Path) -> dict:
    """The layout recorded in a checkpoint (ZeRO stage from its resolved config for older ones)."""
    tp = int(state.get("signature", {}).get("tensor_parallel", 1))
    out = {"tensor_parallel": tp, "data_parallel": int(state.get("world_size", tp)) // tp}
    if "zero_stage" in state:
        out["zero_stage"] = int(state["zero_stage"])
    else:
        import yaml

        try:
            out["zero_stage"] = int(yaml.safe_load((ckpt / "resolved_config.yaml").read_text())["train"]["zero_stage"])
        except (OSError, KeyError, TypeError, ValueError):
            out["zero_stage"] = None
    return out


def _same(old: dict, new: dict) -> bool:
    if old == new:
        return True
    # DeepSpeed loads ZeRO-1 and ZeRO-2 partitions into each other at the same sizes
    return ({old.get("zero_stage"), new["zero_stage"]} <= {1, 2}
            and all(old.get(k) == new[k] for k in ("tensor_parallel", "data_parallel")))


def check_layout(ckpt: Path, state: dict, cfg, world: int) -> bool:
    """False: same layout (DeepSpeed loads its files). True: another layout and
    ``train.resume_weights_only=true`` (load the weights only). Otherwise one-line CheckpointError."""
    if state.get("weights_only"):
        return False
    old, new = saved_layout(state, ckpt), layout(cfg, world)
    if _same(old, new):
        return False
    if cfg.train.resume_weights_only:
        return True
    diff = ", ".join(f"{k.replace('_', ' ')} {old.get(k)} -> {new[k]}" for k in new if old.get(k) != new[k])
    raise CheckpointError(
        f"checkpoint {ckpt} was saved at another layout ({diff}); DeepSpeed's optimizer state loads only at its own "
        f"layout: resume with the saved sizes, or continue from its weights with a fresh optimizer: "
        f"train.resume_weights_only=true (docs/resume.md)")
