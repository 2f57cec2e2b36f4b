"""DeepSpeed config of a run: ``configs/deepspeed/zero{stage}.json``, or the user's own JSON
(``train.deepspeed_config=FILE`` or ``pretrain.py --deepspeed --deepspeed_config FILE``), merged
with the keys megahash derives from its config.

The merge rule (Hugging Face Trainer's rule for DeepSpeed JSONs):

- every key of the user's JSON is kept (ZeRO bucket sizes, offload, communication options, ...);
- the keys megahash derives (:data:`DERIVED`: batch sizes, gradient accumulation, clipping,
  ZeRO stage, bf16/fp16, optimizer and scheduler hyper-parameters) are filled in from the megahash
  config when the JSON leaves them out or sets them to ``"auto"``;
- a JSON value that disagrees with the megahash config is refused: ONE line lists every conflict
  and the overrides that make the two agree (or: write ``"auto"`` in the JSON). Nothing is silently
  overwritten, and the run's resolved config stays the truth about what ran.

Pure Python (json only): the check runs before the heavy imports.
"""

from __future__ import annotations

import json
from pathlib import Path

from megahash.config import CONFIG_ROOT
from megahash.config_checks import check_batch_ramp, check_muon_layout
from megahash.errors import ConfigError

# DeepSpeed key (dotted) -> megahash key it must agree with
DERIVED = {
    "train_batch_size": "train.global_batch_size",
    "train_micro_batch_size_per_gpu": "train.micro_batch_size",
    "gradient_accumulation_steps": "train.global_batch_size / (train.micro_batch_size x data-parallel size)",
    "gradient_clipping": "train.clip_grad",
    "zero_optimization.stage": "train.zero_stage",
    "bf16.enabled": "train.precision",
    "fp16.enabled": "train.precision",
    "optimizer.params.lr": "train.lr",
    "optimizer.params.betas": "train.beta1,train.beta2",
    "optimizer.params.eps": "train.eps",
    "optimizer.params.weight_decay": "train.weight_decay",
}
_OPTIMIZERS = ("adam", "adamw")


def json_path(cfg) -> Path:
    t = cfg.train
    return Path(t.deepspeed_config) if t.deepspeed_config else CONFIG_ROOT / "deepspeed" / f"zero{t.zero_stage}.json"


def read_json(path: Path) -> dict:
    if not path.is_file():
        raise ConfigError(f"DeepSpeed config {path} does not exist; set train.deepspeed_config or train.zero_stage")
    try:
        ds = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(
            f"DeepSpeed config {path} is not valid JSON ({e.msg}, line {e.lineno}); fix the file"
        ) from None
    except RecursionError:  # Python's decoder recurses per level
        raise ConfigError(f"DeepSpeed config {path} is nested too deeply to read; fix the file") from None
    if not isinstance(ds, dict):
        raise ConfigError(f"DeepSpeed config {path} must hold a JSON object")
    return ds


def _get(ds: dict, dotted: str):
    node = ds
    for k in dotted.split("."):
        if not isinstance(node, dict) or k not in node:
            return None
        node = node[k]
    return node


def _same(a, b) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b or a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return abs(float(a) - float(b)) <= 1e-12 * max(1.0, abs(float(a)), abs(float(b)))
    return a == b


def wanted_values(cfg, dp_size: int | None, bf16: bool | None) -> dict:
    """DeepSpeed key -> (value megahash derives, override that would set it to the JSON's value)."""
    t = cfg.train
    out = {
        "train_batch_size": (t.global_batch_size, lambda v: f"train.global_batch_size={v}"),
        "train_micro_batch_size_per_gpu": (t.micro_batch_size, lambda v: f"train.micro_batch_size={v}"),
        "gradient_clipping": (t.clip_grad, lambda v: f"train.clip_grad={v}"),
        "zero_optimization.stage": (t.zero_stage, lambda v: f"train.zero_stage={v}"),
        "fp16.enabled": (False, lambda v: "train.precision=bf16 (megahash has no fp16)" if v else ""),
        "optimizer.params.lr": (t.lr, lambda v: f"train.lr={v}"),
        "optimizer.params.betas": ([t.beta1, t.beta2], lambda v: f"train.beta1={v[0]} train.beta2={v[1]}"),
        "optimizer.params.eps": (t.eps, lambda v: f"train.eps={v}"),
        "optimizer.params.weight_decay": (t.weight_decay, lambda v: f"train.weight_decay={v}"),
    }
    if bf16 is None and t.precision != "auto":
        bf16 = t.precision == "bf16"
    if bf16 is not None:
        out["bf16.enabled"] = (bool(bf16), lambda v: f"train.precision={'bf16' if v else 'fp32'}")
    if dp_size:
        per_step = t.micro_batch_size * dp_size
        out["gradient_accumulation_steps"] = (
            t.global_batch_size // per_step,
            lambda v: f"train.global_batch_size={int(v) * per_step} (data-parallel size {dp_size})",
        )
    return out


def check_user_json(cfg, ds: dict, path: Path, dp_size: int | None = None, bf16: bool | None = None) -> None:
    """Refuse, in one line, every value of the user's JSON that disagrees with the megahash config."""
    conflicts, fixes = [], []
    for key, (want, fix) in wanted_values(cfg, dp_size, bf16).items():
        got = _get(ds, key)
        if got is None or got == "auto" or _same(got, want):
            continue
        shown = ("bf16" if want else "fp32") if key.endswith("16.enabled") else want
        conflicts.append(f"{key}={json.dumps(got)} vs {DERIVED[key]}={json.dumps(shown)}")
        f = fix(got)
        if f:
            fixes.append(f)
    opt = ds.get("optimizer")
    if isinstance(opt, dict) and str(opt.get("type", "adamw")).lower() not in _OPTIMIZERS:
        conflicts.append(f"optimizer.type={json.dumps(opt.get('type'))} vs megahash's AdamW")
        fixes.append('remove "optimizer" from the JSON')
    sched = ds.get("scheduler")
    if isinstance(sched, dict) and any(v != "auto" for v in (sched.get("params") or {}).values()):
        conflicts.append(f"scheduler={json.dumps(sched.get('type'))} vs train.decay={cfg.train.decay}")
        fixes.append(
            'remove "scheduler" from the JSON (the LR schedule is train.decay/lr/min_lr/warmup_steps/decay_steps)'
        )
    if conflicts:
        raise ConfigError(
            f"DeepSpeed config {path} disagrees with the megahash config: {'; '.join(conflicts)}; "
            f'write "auto" for these keys in the JSON or pass {" ".join(dict.fromkeys(fixes))}'
        )


def check_early(cfg) -> None:
    """The checks that need no process group (run before the heavy imports)."""
    if cfg.train.deepspeed_config:
        path = json_path(cfg)
        check_user_json(cfg, read_json(path), path)


def deepspeed_config(cfg, dp_size: int, bf16: bool, autocast=None) -> dict:
    """The engine's JSON. ``bf16``: DeepSpeed's bf16 mode (bf16 parameters, fp32 copies in its
    optimizer); ``autocast`` (a dtype, e.g. ``torch.bfloat16``): fp32 parameters and DeepSpeed's
    ``torch_autocast`` section instead (``accelerator.policy.autocast_dtype``), with ``bf16`` off."""
    t = cfg.train
    path = json_path(cfg)
    ds = read_json(path)
    per_step = t.micro_batch_size * dp_size
    if t.global_batch_size % per_step:
        raise ConfigError(
            f"train.global_batch_size={t.global_batch_size} is not a multiple of micro_batch_size x data-parallel "
            f"size = {t.micro_batch_size} x {dp_size}; pick a multiple of {per_step}"
        )
    check_batch_ramp(t, dp_size)  # its START and INCREMENT too (megahash/training/batch_ramp.py)
    user = bool(t.deepspeed_config)
    if user:
        check_user_json(cfg, ds, path, dp_size, None if autocast is not None else bf16)
        # megahash passes its own AdamW and LR scheduler (equal to the JSON's values, checked above)
        ds.pop("optimizer", None)
        ds.pop("scheduler", None)
    ds["train_batch_size"] = t.global_batch_size
    ds["train_micro_batch_size_per_gpu"] = t.micro_batch_size
    ds["gradient_accumulation_steps"] = t.global_batch_size // per_step
    ds["gradient_clipping"] = t.clip_grad
    ds.setdefault("zero_optimization", {})["stage"] = effective_zero_stage(t.zero_stage, dp_size, bf16, t.optimizer)
    check_muon_layout(t, ds["zero_optimization"]["stage"], bool(bf16))  # train.optimizer=muon: whole matrices only
    ds["bf16"] = {**(ds.get("bf16") or {}), "enabled": bool(bf16)}
    if autocast is not None:
        ds["torch_autocast"] = {
            **(ds.get("torch_autocast") or {}),
            "enabled": True,
            "dtype": str(autocast).replace("torch.", ""),
        }
    ds["fp16"] = {**(ds.get("fp16") or {}), "enabled": False}
    if not user or "steps_per_print" not in ds:
        ds["steps_per_print"] = 10**9  # megahash logs itself
    if not user or "wall_clock_breakdown" not in ds:
        ds["wall_clock_breakdown"] = False
    ds.setdefault("zero_allow_untested_optimizer", True)  # megahash's AdamW is a torch optimizer
    return ds


def effective_zero_stage(stage: int, dp_size: int, bf16: bool, optimizer: str = "adamw") -> int:
    """ZeRO stages 1 and 2 partition optimizer states and gradients over the data-parallel ranks; at
    one data-parallel rank they partition nothing and only add copies (flat fp32 groups, gradient
    buckets, the copy back into the parameters). There, in fp32, the engine runs the optimizer
    itself (stage 0). bf16 keeps the configured stage (its fp32 master weights live in the ZeRO
    optimizer), and so does stage 3 (parameter partitioning and offload are asked for explicitly).
    ``train.optimizer=muon`` at stages 1 and 2 runs the engine at stage 0 (gradient all-reduce, clipping)
    with the optimizer sharding its own state over the data-parallel ranks (megahash/training/muon.py)."""
    if stage in (1, 2) and (optimizer == "muon" or (dp_size == 1 and not bf16)):
        return 0
    return stage


def tune_engine(engine, dp_size: int) -> None:
    """Per-run settings of a DeepSpeed engine that its JSON config cannot express.

    At ZeRO stage 0 in fp32: (1) one data-parallel rank has nothing to all-reduce, so the
    engine's backward all-reduce (flatten every gradient, reduce over a 1-rank group, copy back)
    is switched off; (2) the gradient norm the engine computes while clipping is kept
    (:func:`megahash.training.grad_norm.keep_zero0_grad_norm`; at one rank in all, without collectives)."""
    if engine.zero_optimization_stage() != 0 or engine.bfloat16_enabled() or engine.fp16_enabled():
        return
    from megatron.core import parallel_state

    from megahash.training.grad_norm import keep_zero0_grad_norm

    if dp_size == 1:
        engine.enable_backward_allreduce = False
    keep_zero0_grad_norm(engine, one_rank=dp_size == 1 and parallel_state.get_tensor_model_parallel_world_size() == 1)
