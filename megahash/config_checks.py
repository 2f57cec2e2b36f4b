"""Allowed range of every number in the config tree, checked when a config is loaded.

Pure Python (no torch, no megatron): ``megahash.config.validate`` calls :func:`check_ranges` first,
before any cross-field arithmetic (``hidden_size % num_heads`` with ``num_heads=0`` would divide by
zero) and before anything is imported or written. A value outside its range is one line naming the
key, the value and the allowed range::

    config key 'train.steps' must be >= 1 (the number of optimizer steps), got -5

``RANGES`` maps the dotted key of every int/float field to ``(low, high, low_open, high_open,
meaning)``; ``None`` bounds are unbounded. tests/test_config.py checks that every numeric field of
the tree has an entry, so a new field cannot skip validation.
"""

from __future__ import annotations

import dataclasses
import math
import re
import types
import typing

from megahash.errors import ConfigError

INF = None  # an unbounded side

# key: (low, high, low_open, high_open, meaning)
RANGES: dict[str, tuple] = {
    # model.embed ([Xue25] ch. 2)
    "model.embed.num_buckets": (0, INF, False, False, "hash-emb rows; 0 = from the hash spec"),
    "model.embed.num_bits": (1, 128, False, False, "bits of the hash code"),
    # model
    "model.hidden_size": (1, INF, False, False, "hidden width"),
    "model.num_layers": (1, INF, False, False, "transformer layers"),
    "model.num_heads": (1, INF, False, False, "attention heads"),
    "model.num_query_groups": (0, INF, False, False, "K/V groups; 0 = num_heads"),
    "model.ffn_hidden_size": (1, INF, False, False, "MLP width"),
    "model.vocab_size": (0, INF, False, False, "vocabulary; 0 = from the tokenizer"),
    "model.type_vocab_size": (1, INF, False, False, "token-type rows of the roberta layout"),
    "model.make_vocab_size_divisible_by": (1, INF, False, False, "vocabulary padding multiple"),
    "model.max_position_embeddings": (1, INF, False, False, "longest sequence"),
    "model.rotary_base": (1, INF, False, False, "RoPE base"),
    "model.norm_eps": (0.0, 1.0, True, False, "norm epsilon"),
    "model.init_std": (0.0, INF, True, False, "init standard deviation"),
    "model.embed_init_std": (0.0, INF, False, False, "init std of the embedding tables; 0 = model.init_std"),
    "model.logit_softcap": (0.0, INF, False, False, "logit soft-cap c (c tanh(z / c)); 0 = off"),
    "model.qk_gain": (0.0, INF, False, False, "initial per-head query gain after QK-norm; 0 = off"),
    "model.mup_base_hidden_size": (0, INF, False, False, "muP's base hidden size; 0 = off"),
    "model.hidden_dropout": (0.0, 1.0, False, True, "dropout probability"),
    "model.attention_dropout": (0.0, 1.0, False, True, "dropout probability"),
    # data
    "data.seq_length": (1, INF, False, False, "tokens per sample"),
    "data.seed": (0, 2**32 - 1, False, False, "seed"),
    "data.num_workers": (0, INF, False, False, "loader processes"),
    "data.valid_samples": (1, INF, False, False, "validation sequences"),
    "data.valid_micro_batch": (1, INF, False, False, "validation chunk size"),
    # train
    "train.steps": (1, INF, False, False, "the number of optimizer steps"),
    "train.micro_batch_size": (1, INF, False, False, "sequences per rank per micro-batch"),
    "train.global_batch_size": (1, INF, False, False, "sequences per optimizer step"),
    "train.lr": (0.0, INF, True, False, "peak learning rate"),
    "train.min_lr": (0.0, INF, False, False, "final learning rate"),
    "train.warmup_steps": (0, INF, False, False, "warmup steps"),
    "train.warmup_fraction": (0.0, 1.0, False, True, "warmup as a fraction of the decay length; 0 = warmup_steps"),
    "train.decay_steps": (0, INF, False, False, "LR decay length; 0 = train.steps"),
    "train.decay_fraction": (0.0, 1.0, True, False, "wsd: annealed fraction of the decay length"),
    "train.weight_decay": (0.0, INF, False, False, "AdamW weight decay"),
    "train.beta1": (0.0, 1.0, False, True, "Adam beta1"),
    "train.beta2": (0.0, 1.0, False, True, "Adam beta2"),
    "train.eps": (0.0, INF, True, False, "Adam epsilon"),
    "train.clip_grad": (0.0, INF, False, False, "gradient clipping norm; 0 = off"),
    "train.seed": (0, 2**32 - 1, False, False, "seed"),
    "train.zero_stage": (0, 3, False, False, "DeepSpeed ZeRO stage"),
    "train.save_interval": (0, INF, False, False, "steps between checkpoints; 0 = only at the end"),
    "train.keep_last": (0, INF, False, False, "checkpoints kept; 0 = all"),
    "train.eval_interval": (0, INF, False, False, "steps between validations; 0 = off"),
    "train.log_interval": (1, INF, False, False, "steps between printed lines"),
    "train.stop_after": (0, INF, False, False, "stop after this step; 0 = off"),
    "train.hang_timeout_s": (0.0, INF, False, False, "seconds a step may take before the watchdog fires; 0 = off"),
    "train.hang_factor": (0.0, INF, False, False, "multiple of the median step time that counts as a hang; 0 = off"),
    "train.distributed_timeout_s": (1, INF, False, False, "seconds a collective may wait"),
    "train.spike_factor": (0.0, INF, False, False, "skip a loss above this x the running median; 0 = off"),
    "train.spike_window": (1, INF, False, False, "losses in the spike rule's running median"),
    "train.max_skips": (0, INF, False, False, "consecutive skipped steps that stop the run; 0 = never"),
    "train.muon_lr": (0.0, INF, True, False, "Muon's peak learning rate (hidden matrices)"),
    "train.muon_momentum": (0.0, 1.0, False, True, "Muon's momentum"),
    "train.muon_ns_steps": (1, 99, False, False, "Newton-Schulz steps (torch.optim.Muon: < 100)"),
    "train.embed_lr": (0.0, INF, False, False, "peak learning rate of the embedding tables; 0 = train.lr"),
    "train.z_loss": (0.0, INF, False, False, "z-loss coefficient; 0 = off"),
    "train.ema_decay": (0.0, 1.0, False, True, "decay of the weight average; 0 = off"),
    "train.qat_bits": (0, 8, False, False, "bits of the fake quantization; 0 = off"),
    "train.qat_fraction": (0.0, 1.0, True, False, "the last fraction of the steps trained with fake quantization"),
    # parallel, eval
    "parallel.tensor": (1, INF, False, False, "tensor-parallel size"),
    "eval.batch_size": (1, INF, False, False, "evaluation batch size"),
    "eval.interval": (0, INF, False, False, "steps between evaluations of eval.tasks during training; 0 = off"),
    "eval.wait_s": (0.0, INF, False, False, "seconds the end of a run waits for evaluations still running"),
}


def _range_text(low, high, low_open, high_open) -> str:
    if high is None:
        return f"{'>' if low_open else '>='} {low}"
    if low is None:
        return f"{'<' if high_open else '<='} {high}"
    return f"in {'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"


def coerce(value, typ, dotted: str):
    """Check/convert a YAML value to a dataclass field type; one-line error otherwise."""
    origin = typing.get_origin(typ)
    if origin is list:
        (inner,) = typing.get_args(typ)
        if isinstance(value, str):
            value = [v for v in value.split(",") if v] if "," in value or value else []
        if not isinstance(value, list):
            value = [value]
        return [coerce(v, inner, dotted) for v in value]
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(typ) if a is not type(None)]
        if value is None:
            return None
        return coerce(value, args[0], dotted)
    if typ is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        raise ConfigError(f"config key {dotted!r} must be true/false, got {value!r}")
    if typ is int:
        if isinstance(value, bool):
            raise ConfigError(f"config key {dotted!r} must be an integer, got {value!r}")
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                return int(float(value)) if value.replace(".", "", 1).replace("e", "", 1).isdigit() else int(value)
            except ValueError:
                pass
        raise ConfigError(f"config key {dotted!r} must be an integer, got {value!r}")
    if typ is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"config key {dotted!r} must be a number, got {value!r}")
    if typ is str:
        if isinstance(value, (dict, list)):
            raise ConfigError(f"config key {dotted!r} must be a string, got {value!r}")
        return "" if value is None else str(value)
    return value


def check_value(key: str, value, rule: tuple | None = None) -> None:
    """Raise a one-line ConfigError if ``value`` is outside the range of ``key`` (``rule``: a kind
    option's range from its options class; unknown keys pass)."""
    rule = rule or RANGES.get(key)
    if rule is None or value is None:
        return
    low, high, low_open, high_open, meaning = rule
    bad = isinstance(value, float) and not math.isfinite(value)
    if not bad and low is not None:
        bad = value <= low if low_open else value < low
    if not bad and high is not None:
        bad = value >= high if high_open else value > high
    if bad:
        raise ConfigError(
            f"config key {key!r} must be {_range_text(low, high, low_open, high_open)} ({meaning}), got {value!r}"
        )


def numeric_fields(cls, prefix: str = "") -> list[str]:
    """Dotted keys of every int/float field of the dataclass tree ``cls``."""
    out = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        typ = hints[f.name]
        if dataclasses.is_dataclass(typ):
            out += numeric_fields(typ, prefix + f.name + ".")
        elif typ in (int, float):
            out.append(prefix + f.name)
    return out


def _walk(obj, prefix: str = ""):
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        if dataclasses.is_dataclass(v):
            yield from _walk(v, prefix + f.name + ".")
        else:
            yield prefix + f.name, v


def check_ranges(cfg) -> None:
    """Every number of the tree inside its range, plus the relations between numbers that need no
    model, data or world size (one-line ConfigError)."""
    for key, value in _walk(cfg):
        check_value(key, value)  # kind options: checked where they are built (config._build_options)
    t, d = cfg.train, cfg.data
    if t.global_batch_size % t.micro_batch_size:
        raise ConfigError(
            f"train.global_batch_size={t.global_batch_size} must be a multiple of "
            f"train.micro_batch_size={t.micro_batch_size}"
        )
    if t.min_lr > t.lr:
        raise ConfigError(f"train.min_lr={t.min_lr} must be <= train.lr={t.lr}")
    check_batch_ramp(t)
    if 0 < t.spike_factor <= 1:
        raise ConfigError(
            f"train.spike_factor={t.spike_factor} must be 0 (off) or > 1 (a spike is a loss above "
            f"that many times the running median)"
        )
    _check_split(d.split)
    parse_valid(d.valid)  # data.valid: NAME=PREFIX entries, names unique
    _check_profile_steps(t.profile_steps, t.steps)
    if t.hang_factor and t.hang_factor <= 1:
        raise ConfigError(
            f"train.hang_factor={t.hang_factor} must be > 1 (a multiple of the median step time) or 0 (off)"
        )
    if t.hang_timeout_s and t.hang_timeout_s >= t.distributed_timeout_s:
        raise ConfigError(
            f"train.hang_timeout_s={t.hang_timeout_s:g} must be below train.distributed_timeout_s="
            f"{t.distributed_timeout_s} (a collective timing out first ends the rank as a failure, "
            f"not for requeue)"
        )
    _check_optimizer(t)
    _check_levers(cfg)
    if t.qat_bits not in (0, 4, 6, 8):
        raise ConfigError(f"train.qat_bits must be 0 (off), 4, 6 or 8, got {t.qat_bits}")
    if t.qat_bits and t.zero_stage == 3:
        raise ConfigError(
            "train.qat_bits needs train.zero_stage 0, 1 or 2 (ZeRO-3 partitions the weights it fake-quantizes)"
        )
    if d.verify not in ("cheap", "full", "none"):
        raise ConfigError(f"config key 'data.verify' must be cheap, full or none, got {d.verify!r}")
    if t.verify_checkpoint not in ("cheap", "full"):
        raise ConfigError(f"config key 'train.verify_checkpoint' must be cheap or full, got {t.verify_checkpoint!r}")


def _check_levers(cfg) -> None:
    """The compact-model levers' choices and the combinations they refuse (issue 44, docs/compact_models.md#levers)."""
    m, t = cfg.model, cfg.train
    if m.mlp_activation not in ("auto", "relu2"):
        raise ConfigError(f"config key 'model.mlp_activation' must be auto or relu2, got {m.mlp_activation!r}")
    if m.qk_gain and not m.qk_norm:
        raise ConfigError("model.qk_gain scales the QK-normed queries: set model.qk_norm=true (or model.qk_gain=0)")
    if m.mlp_activation != "auto" and m.layout != "prenorm":
        raise ConfigError("model.mlp_activation=relu2 is a pre-norm lever; leave it auto with model.layout=roberta")
    if (m.logit_softcap or t.z_loss) and (m.head != "vocab" or t.objective == "sr"):
        raise ConfigError(
            "model.logit_softcap and train.z_loss act on the vocabulary head's logits; "
            "use model.head=vocab with train.objective clm or mlm (or set them to 0)"
        )
    if t.z_loss and cfg.parallel.tensor > 1:
        raise ConfigError("train.z_loss needs the whole vocabulary on one rank: parallel.tensor=1 (or train.z_loss=0)")


def _check_optimizer(t) -> None:
    """``train.optimizer`` and Muon's choices (megahash/training/muon.py; its layouts: muon.check_layout)."""
    if t.optimizer not in ("adamw", "muon"):
        raise ConfigError(f"config key 'train.optimizer' must be adamw or muon, got {t.optimizer!r}")
    if t.muon_adjust_lr not in ("original", "match_rms_adamw"):
        raise ConfigError(
            f"config key 'train.muon_adjust_lr' must be original or match_rms_adamw, got {t.muon_adjust_lr!r}"
        )
    if t.optimizer == "muon" and t.zero_stage == 3:
        raise ConfigError(
            "train.optimizer=muon orthogonalizes whole matrices and ZeRO stage 3 partitions every weight into flat "
            "slices on every rank; set train.zero_stage=1 (Muon's state and Newton-Schulz work sharded over the "
            "data-parallel ranks, the weights whole on each) or train.optimizer=adamw"
        )


def check_muon_layout(t, stage: int, bf16_params: bool) -> None:
    """``train.optimizer=muon`` once the DeepSpeed stage is known (megahash/training/ds_config.py): refused in
    one line where the optimizer would not see whole fp32 matrices (megahash/training/muon.py)."""
    if t.optimizer != "muon":
        return
    if stage > 0:  # stage 3 (refused with the config already); 1 and 2 run as 0 with the optimizer sharded
        raise ConfigError(
            f"train.optimizer=muon orthogonalizes whole matrices and ZeRO stage {stage} partitions them into flat "
            f"slices; set train.zero_stage=1 (Muon's state and work sharded over the data-parallel ranks) "
            f"or train.optimizer=adamw"
        )
    if bf16_params:
        raise ConfigError(
            "train.optimizer=muon needs fp32 parameters (DeepSpeed's bf16 optimizer keeps flat "
            "masters); use train.precision=bf16 (autocast over fp32 parameters)"
        )


def _check_profile_steps(steps: list, total: int) -> None:
    """``train.profile_steps``: [] (off) or [START, END] with 1 <= START <= END <= train.steps."""
    if not steps:
        return
    why = (
        "must be two step numbers [start, end] ([] = off)"
        if len(steps) != 2
        else f"must lie within 1..train.steps={total}"
        if not (1 <= steps[0] <= total and 1 <= steps[1] <= total)
        else "must have end >= start"
        if steps[1] < steps[0]
        else None
    )
    if why:
        raise ConfigError(f"config key 'train.profile_steps' {why}, got {steps!r}")


def check_batch_ramp(t, dp_size: int = 1) -> None:
    """``train.batch_ramp`` = [START, INCREMENT, SAMPLES] (Megatron's ``--rampup-batch-size``) or []: the
    assertions of megatron-core's ``RampupBatchsizeNumMicroBatchesCalculator`` (and the divisions by zero
    it leaves: START = global batch, SAMPLES = 0) as one-line errors; ``dp_size`` once the world is known."""
    ramp = t.batch_ramp
    if not ramp:
        return
    if len(ramp) != 3:
        raise ConfigError(
            f"train.batch_ramp must be [START, INCREMENT, SAMPLES] (Megatron's --rampup-batch-size) "
            f"or [] (off), got {ramp}"
        )
    start, inc, samples = ramp
    if start < 1 or inc < 1 or samples < 1:
        raise ConfigError(f"train.batch_ramp={ramp}: START and INCREMENT (sequences) and SAMPLES must be >= 1")
    gbs, per = t.global_batch_size, t.micro_batch_size * dp_size
    where = f"train.micro_batch_size x data-parallel size = {t.micro_batch_size} x {dp_size}"
    for name, v in (("START", start), ("INCREMENT", inc)):
        if v % per:
            raise ConfigError(f"train.batch_ramp {name} {v} is not a multiple of {where}; pick a multiple of {per}")
    if start >= gbs:
        raise ConfigError(
            f"train.batch_ramp START {start} must be below train.global_batch_size={gbs} (the batch "
            f"it ramps to); lower START or set train.batch_ramp=[]"
        )
    if (gbs - start) % inc:
        fits = [d for d in range(per, gbs - start + 1, per) if (gbs - start) % d == 0]
        raise ConfigError(
            f"train.batch_ramp INCREMENT {inc} does not divide train.global_batch_size - START = "
            f"{gbs} - {start} = {gbs - start}; pick INCREMENT among {fits}"
        )


# data.valid (megahash/data/valid_sets.py)
VALID_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")


def parse_valid(entries) -> list[tuple[str, str]]:
    """``data.valid`` -> [(name, prefix)] in the given order (one-line ConfigError on bad entries)."""
    out, seen = [], set()
    for entry in entries or []:
        name, eq, prefix = str(entry).partition("=")
        name, prefix = name.strip(), prefix.strip()
        if not eq or not prefix:
            raise ConfigError(f"data.valid entry {entry!r} must be NAME=PREFIX (e.g. data.valid=[wiki=data/wiki/wiki])")
        if not VALID_NAME.match(name) or name == "valid":
            raise ConfigError(
                f"data.valid name {name!r} must be letters, digits, _ . - and not 'valid' (the data.split set's name)"
            )
        if name in seen:
            raise ConfigError(f"data.valid names {name!r} twice; give each set its own name")
        seen.add(name)
        out.append((name, prefix))
    return out


def _check_split(split: str) -> None:
    """``data.split``: up to three non-negative numbers (train, valid, test weights), train > 0."""
    parts = [p.strip() for p in str(split).replace("/", ",").split(",") if p.strip()]
    try:
        nums = [float(p) for p in parts]
    except ValueError:
        nums = []
    if not 1 <= len(nums) <= 3 or any(not math.isfinite(x) or x < 0 for x in nums) or nums[0] <= 0:
        raise ConfigError(
            f"config key 'data.split' must be up to three non-negative weights train,valid,test with "
            f"train > 0 (e.g. 98,2,0), got {split!r}"
        )


def check_mup(cfg, kinds: list[str], caps_of) -> None:
    """``model.mup_base_hidden_size``: every layer kind takes muP's attention scale (``AttentionCaps.mup``);
    otherwise one line naming the kind (megahash/models/mup.py, docs/compact_models.md)."""
    if cfg.model.mup_base_hidden_size:
        _every_kind_can(
            kinds,
            caps_of,
            "mup",
            lambda kind: (
                f"model.mup_base_hidden_size={cfg.model.mup_base_hidden_size}: attention kind {kind!r} cannot take "
                f"muP's attention scale; use another model.schedule or model.mup_base_hidden_size=0"
            ),
        )


def check_encoder(cfg, causal: bool, kinds: list[str], caps_of) -> None:
    """A bidirectional ``model.arch`` (``causal`` False): every layer kind has a bidirectional form
    (``AttentionCaps.encoder``); otherwise one line naming the kind."""
    if not causal:
        _every_kind_can(
            kinds,
            caps_of,
            "encoder",
            lambda kind: (
                f"model.arch={cfg.model.arch}: attention kind {kind!r} is causal only (no bidirectional "
                f"form); use another model.schedule or model.arch=decoder"
            ),
        )


def check_documents(cfg, kinds: list[str], caps_of) -> None:
    """``data.reset_attention_mask``: every layer kind keeps attention inside its document
    (``AttentionCaps.documents``); otherwise one line naming the kind (docs/data.md#packed-documents)."""
    if cfg.data.reset_attention_mask:
        _every_kind_can(
            kinds,
            caps_of,
            "documents",
            lambda kind: (
                f"data.reset_attention_mask=true: attention kind {kind!r} cannot keep attention inside "
                f"documents; use another model.schedule or data.reset_attention_mask=false"
            ),
        )


def _every_kind_can(kinds: list[str], caps_of, cap: str, error) -> None:
    """A one-line ConfigError (``error(kind)``) for the first layer kind whose capability ``cap`` is False."""
    for kind in dict.fromkeys(kinds):
        if not getattr(caps_of(kind), cap, True):
            raise ConfigError(error(kind))
