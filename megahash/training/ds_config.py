"""DeepSpeed config of a run: ``configs/deepspeed/zero{stage}.json`` (or train.deepspeed_config)
with batch sizes, precision and clipping filled in from the megahash config."""
from __future__ import annotations

import json
from pathlib import Path

from megahash.config import CONFIG_ROOT
from megahash.errors import ConfigError


def deepspeed_config(cfg, dp_size: int, bf16: bool) -> dict:
    t = cfg.train
    path = Path(t.deepspeed_config) if t.deepspeed_config else CONFIG_ROOT / "deepspeed" / f"zero{t.zero_stage}.json"
    if not path.is_file():
        raise ConfigError(f"DeepSpeed config {path} does not exist; set train.deepspeed_config or train.zero_stage")
    ds = json.loads(path.read_text())
    per_step = t.micro_batch_size * dp_size
    if t.global_batch_size % per_step:
        raise ConfigError(
            f"train.global_batch_size={t.global_batch_size} is not a multiple of micro_batch_size x data-parallel "
            f"size = {t.micro_batch_size} x {dp_size}; pick a multiple of {per_step}"
        )
    ds["train_batch_size"] = t.global_batch_size
    ds["train_micro_batch_size_per_gpu"] = t.micro_batch_size
    ds["gradient_accumulation_steps"] = t.global_batch_size // per_step
    ds["gradient_clipping"] = t.clip_grad
    ds.setdefault("zero_optimization", {})["stage"] = effective_zero_stage(t.zero_stage, dp_size, bf16)
    ds["bf16"] = {"enabled": bool(bf16)}
    ds["fp16"] = {"enabled": False}
    ds["steps_per_print"] = 10**9  # megahash logs itself
    ds["wall_clock_breakdown"] = False
    return ds


def effective_zero_stage(stage: int, dp_size: int, bf16: bool) -> int:
    """ZeRO stages 1 and 2 partition optimizer states and gradients over the data-parallel ranks; at
    one data-parallel rank they partition nothing and only add copies (flat fp32 groups, gradient
    buckets, the copy back into the parameters). There, in fp32, the engine runs the optimizer
    itself (stage 0). bf16 keeps the configured stage (its fp32 master weights live in the ZeRO
    optimizer), and so does stage 3 (parameter partitioning and offload are asked for explicitly)."""
    if dp_size == 1 and not bf16 and stage in (1, 2):
        return 0
    return stage


def tune_engine(engine, dp_size: int) -> None:
    """Per-run settings of a DeepSpeed engine that its JSON config cannot express.

    At ZeRO stage 0 in fp32: (1) one data-parallel rank has nothing to all-reduce, so the
    engine's backward all-reduce (flatten every gradient, reduce over a 1-rank group, copy back)
    is switched off; (2) the engine clips gradients with DeepSpeed's TP-aware ``clip_grad_norm_``
    but keeps no norm for ``get_global_grad_norm`` (ZeRO optimizers do): record it; at one rank
    in all (TP 1, DP 1) torch's ``clip_grad_norm_`` does the same without two all-reduces over
    one-rank groups."""
    if engine.zero_optimization_stage() != 0 or engine.bfloat16_enabled() or engine.fp16_enabled():
        return
    import torch
    from deepspeed.runtime.utils import clip_grad_norm_
    from megatron.core import parallel_state

    if dp_size == 1:
        engine.enable_backward_allreduce = False
    one_rank = dp_size == 1 and parallel_state.get_tensor_model_parallel_world_size() == 1

    def clip_and_record():
        params = engine.module.parameters()
        if one_rank:  # the same clipping (coefficient max / (norm + 1e-6)) without collectives over 1-rank groups
            norm = torch.nn.utils.clip_grad_norm_(params, engine.gradient_clipping())
        else:
            norm = clip_grad_norm_(parameters=params, max_norm=engine.gradient_clipping(), mpu=engine.mpu)
        engine.optimizer._global_grad_norm = norm

    engine.clip_fp32_gradients = clip_and_record
