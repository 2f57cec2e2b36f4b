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
    ds.setdefault("zero_optimization", {})["stage"] = t.zero_stage
    ds["bf16"] = {"enabled": bool(bf16)}
    ds["fp16"] = {"enabled": False}
    ds["steps_per_print"] = 10**9  # megahash logs itself
    ds["wall_clock_breakdown"] = False
    return ds
