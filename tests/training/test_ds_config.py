"""DeepSpeed conventions: `--deepspeed --deepspeed_config FILE`, the user's JSON merged with
megahash's keys (Hugging Face Trainer's rule: "auto"/absent filled in, disagreements refused in one
line with the fix), and several `--config` files merged left to right."""

import json

import pytest

from conftest import pretrain_here
from megahash.config import load_config
from megahash.errors import ConfigError
from megahash.training.ds_config import deepspeed_config


def _cfg(tmp_path, ds: dict, *extra):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ds))
    return load_config("configs/quickstart.yaml", [f"train.deepspeed_config={path}", *extra])


def test_user_json_keeps_its_keys_and_fills_auto(tmp_path):
    user = {
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": 8,
        "gradient_clipping": "auto",
        "zero_optimization": {"stage": 2, "overlap_comm": True, "reduce_bucket_size": 12345},
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": [0.9, 0.99], "weight_decay": 0.1}},
        "steps_per_print": 7,
        "comms_logger": {"enabled": False},
    }
    cfg = _cfg(tmp_path, user, "train.zero_stage=2")
    ds = deepspeed_config(cfg, dp_size=2, bf16=False)
    assert ds["train_batch_size"] == 16 and ds["train_micro_batch_size_per_gpu"] == 8
    assert ds["gradient_accumulation_steps"] == 1 and ds["gradient_clipping"] == 1.0
    assert ds["zero_optimization"] == {"stage": 2, "overlap_comm": True, "reduce_bucket_size": 12345}
    assert ds["steps_per_print"] == 7 and ds["comms_logger"] == {"enabled": False}
    assert "optimizer" not in ds  # megahash passes its own AdamW with the same (checked) values
    assert ds["bf16"] == {"enabled": False}


def test_every_conflict_in_one_line_with_the_fix(tmp_path):
    user = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_clipping": 0.5,
        "zero_optimization": {"stage": 3},
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.95]}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 100}},
    }
    with pytest.raises(ConfigError) as e:
        deepspeed_config(_cfg(tmp_path, user, "train.precision=fp32"), dp_size=2, bf16=False)
    msg = str(e.value)
    assert "\n" not in msg
    for part in (
        "train_micro_batch_size_per_gpu=2 vs train.micro_batch_size=8",
        "gradient_clipping=0.5 vs train.clip_grad=1.0",
        "zero_optimization.stage=3 vs train.zero_stage=1",
        'bf16.enabled=true vs train.precision="fp32"',
        "optimizer.params.lr=0.001 vs train.lr=0.002",
        "optimizer.params.betas=[0.9, 0.95] vs train.beta1,train.beta2=[0.9, 0.99]",
        'scheduler="WarmupLR"',
        'write "auto"',
        "train.micro_batch_size=2",
        "train.clip_grad=0.5",
        "train.zero_stage=3",
        "train.precision=bf16",
        "train.lr=0.001",
        "train.beta2=0.95",
    ):
        assert part in msg, (part, msg)
    # the fixes it names make the run agree
    fixed = _cfg(
        tmp_path,
        {k: v for k, v in user.items() if k != "scheduler"},
        "train.micro_batch_size=2",
        "train.clip_grad=0.5",
        "train.zero_stage=3",
        "train.precision=bf16",
        "train.lr=0.001",
        "train.beta2=0.95",
    )
    assert deepspeed_config(fixed, dp_size=2, bf16=True)["gradient_accumulation_steps"] == 4


def test_configs_merge_left_to_right(tmp_path):
    a, b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    a.write_text("include: [quickstart.yaml]\ntrain: {steps: 11, lr: 1.0e-3}\nmodel: {num_layers: 3}\n")
    b.write_text("train: {steps: 22}\nparallel: {tensor: 2}\n")
    cfg = load_config([str(a), str(b)], ["train.warmup_steps=5"])
    assert (cfg.train.steps, cfg.train.lr, cfg.model.num_layers, cfg.parallel.tensor) == (22, 1e-3, 3, 2)
    assert cfg.model.hidden_size == 128 and cfg.train.warmup_steps == 5  # from quickstart's include, override
    assert load_config([str(b), str(a)]).train.steps == 11


def test_pretrain_accepts_deepspeed_flags(shakespeare_shards, tmp_path):
    """DeepSpeed's `--deepspeed --deepspeed_config FILE` (and HF's `--deepspeed FILE`) on the real
    entry point: a conflict is refused before the heavy imports; an agreeing JSON trains."""
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 0}}))
    extra = tmp_path / "extra.yaml"
    extra.write_text(
        "train: {steps: 2, eval_interval: 0, log_interval: 1}\nlogging: {plot: false, tensorboard: false}\n"
    )
    common = [
        "--config",
        "configs/quickstart.yaml",
        "--config",
        str(extra),
        f"data.prefix=[{shakespeare_shards['prefix']}]",
        f"data.tokenizer={shakespeare_shards['tokenizer']}",
        "data.seq_length=64",
        f"train.save_dir={tmp_path / 'run'}",
    ]
    r = pretrain_here(["--deepspeed", str(ds), *common])  # the entry point's argv, in this process
    assert r.returncode == 2 and "Traceback" not in r.stderr
    err = [l for l in r.stderr.splitlines() if l.startswith("error:")]
    assert len(err) == 1 and "train_micro_batch_size_per_gpu=2 vs train.micro_batch_size=8" in err[0], r.stderr[-2000:]
    r = pretrain_here(
        [
            "--deepspeed",
            "--deepspeed_config",
            str(ds),
            *common,
            "train.micro_batch_size=2",
            "train.global_batch_size=4",
            "train.zero_stage=0",
        ]
    )
    assert r.returncode == 0, r.stderr[-3000:]
    resolved = (tmp_path / "run" / "resolved_config.yaml").read_text()
    assert f"deepspeed_config: {ds}" in resolved and "steps: 2" in resolved and "hidden_size: 128" in resolved
