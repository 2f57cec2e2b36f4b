"""The one check of every config field, run when a config is loaded: ranges, choices, cross-field rules.

Pure Python (no torch, no megatron): ``megahash.config.validate`` calls :func:`check_ranges` first,
before any cross-field arithmetic (``hidden_size % num_heads`` with ``num_heads=0`` would divide by
zero) and before anything is imported or written. A field declares what it accepts where it is declared
(the config tree, megahash/config.py, and the sections the training features own in their own files):

- a number its range, as field metadata (:func:`ranged`: ``lr: float = ranged(4e-4, "(0, inf)", "peak
  learning rate")``); a value outside it is one line naming the key, the value and the range::

      config key 'train.steps' must be >= 1 (the number of optimizer steps), got -5

- a closed set of values its ``Literal`` type (``decay: Literal["cosine", "linear", "wsd", "constant"]``);
  another value is one line naming the key, the choices and the closest one.

tests/test_config_ranges.py checks that every int/float field of the tree has a range, so a new number
cannot skip validation. Kind options declare their ranges in their options class (``RANGES``,
megahash/catalog.py) and are checked by the same :func:`check_value` where they are built.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import re
import types
import typing

from megahash.errors import ConfigError

INF = None  # an unbounded side
_INTERVAL = re.compile(r"^\s*([\[(])\s*([^,\s]+)\s*,\s*([^,\s]+)\s*([\])])\s*$")


def _bound(text: str, number: type):
    if text.lstrip("+-") == "inf":
        return INF
    return number(float(text)) if number is float else int(text)


def interval(text: str, meaning: str, number: type = float) -> tuple:
    """``"[1, inf)"`` -> the rule ``(low, high, low_open, high_open, meaning)`` of :func:`check_value`
    (bounds as ``number``: a float field's error shows float bounds)."""
    m = _INTERVAL.match(text)
    if m is None:
        raise ValueError(f"range {text!r} must look like [low, high] with ( ) for open ends and inf")
    return (_bound(m[2], number), _bound(m[3], number), m[1] == "(", m[4] == ")", meaning)


def ranged(default, bounds: str, meaning: str):
    """A config field (a dataclass field) whose value must lie in ``bounds`` (``"[0, 1)"``, ``"(0, inf)"``):
    its range as field metadata, checked by :func:`check_ranges` when a config loads."""
    rule = interval(bounds, meaning, float if isinstance(default, float) else int)
    return dataclasses.field(default=default, metadata={"range": rule})


def _range_text(low, high, low_open, high_open) -> str:
    if high is None:
        return f"{'>' if low_open else '>='} {low}"
    if low is None:
        return f"{'<' if high_open else '<='} {high}"
    return f"in {'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"


def coerce(value, typ, dotted: str):
    """Check/convert a YAML value to a dataclass field type; one-line error otherwise."""
    origin = typing.get_origin(typ)
    if (
        origin is typing.Literal
    ):  # a closed set: coerced to its values' type here, checked in config_checks.check_fields
        allowed = typing.get_args(typ)
        if isinstance(allowed[0], str):
            value = str(value).lower() if isinstance(value, bool) else value  # YAML's true: "true"
            lower = {str(a).lower(): a for a in allowed}
            value = lower.get(str(value).lower(), value) if isinstance(value, str) else value
        return coerce(value, type(allowed[0]), dotted)
    if origin is list:
        (inner,) = typing.get_args(typ)
        if value is None:  # `prefix: null`, `eval.tasks=~`, a key with no value: no entries (was [''])
            return []
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
        raw = value
        if isinstance(value, str):  # '5', '1e3' (PyYAML reads 1e3 as text: its floats need a dot), ' 7 '
            try:
                value = int(value)
            except ValueError:
                try:
                    value = float(value)
                except ValueError:
                    pass
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():  # 1e3, 128.0; never 1.5 or 2.5e0 (were 1 and 2)
            return int(value)
        raise ConfigError(f"config key {dotted!r} must be an integer, got {raw!r}")
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
        if isinstance(value, bool):  # YAML's true/yes/on: as YAML writes it back, not Python's 'True'
            return "true" if value else "false"
        return "" if value is None else str(value)
    return value


def check_value(key: str, value, rule: tuple | None) -> None:
    """Raise a one-line ConfigError if ``value`` is outside ``rule`` (a field's range; None: no range)."""
    if rule is None or value is None:
        return
    low, high, low_open, high_open, meaning = rule
    bad = isinstance(value, float) and not math.isfinite(value)
    if not bad and low is not None:
        bad = value <= low if low_open else value < low
    if not bad and high is not None:
        bad = value >= high if high_open else value > high
    if bad:
        finite = "a finite number " if isinstance(value, float) and not math.isfinite(value) else ""
        raise ConfigError(
            f"config key {key!r} must be {finite}{_range_text(low, high, low_open, high_open)} ({meaning}), "
            f"got {value!r}"
        )


def choices(typ) -> tuple | None:
    """The values of a ``Literal[...]`` field type (None: not a closed set)."""
    return typing.get_args(typ) if typing.get_origin(typ) is typing.Literal else None


def check_choice(key: str, value, typ) -> None:
    """Raise a one-line ConfigError if ``value`` is not one of the ``Literal`` type ``typ``'s values."""
    allowed = choices(typ)
    if allowed is None or value in allowed:
        return
    shown = [str(a) for a in allowed]
    close = difflib.get_close_matches(str(value), shown, n=1, cutoff=0.5) if isinstance(value, str) else []
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise ConfigError(f"config key {key!r} must be {', '.join(shown[:-1])} or {shown[-1]}, got {value!r}{hint}")


@functools.cache
def _hints(cls) -> dict:
    return typing.get_type_hints(cls)


def numeric_fields(cls, prefix: str = "") -> list[str]:
    """Dotted keys of every int/float field of the dataclass tree ``cls``."""
    out = []
    hints = _hints(cls)
    for f in dataclasses.fields(cls):
        typ = hints[f.name]
        if dataclasses.is_dataclass(typ):
            out += numeric_fields(typ, prefix + f.name + ".")
        elif typ in (int, float):
            out.append(prefix + f.name)
    return out


def field_ranges(cls, prefix: str = "") -> dict[str, tuple]:
    """{dotted key: range rule} of every field of the dataclass tree ``cls`` that declares one."""
    out = {}
    hints = _hints(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            out.update(field_ranges(hints[f.name], prefix + f.name + "."))
        elif "range" in f.metadata:
            out[prefix + f.name] = f.metadata["range"]
    return out


def check_fields(obj, prefix: str = "") -> None:
    """Every field of the dataclass tree ``obj``: its value inside its range and among its choices (one line)."""
    hints = _hints(type(obj))
    for f in dataclasses.fields(obj):
        value, key = getattr(obj, f.name), prefix + f.name
        if dataclasses.is_dataclass(value):
            check_fields(value, key + ".")
            continue
        check_choice(key, value, hints[f.name])
        check_value(key, value, f.metadata.get("range"))


def check_ranges(cfg) -> None:
    """Every field of the tree inside its range and among its choices, the relations between numbers that
    need no model, data or world size, and the rules each training feature's section declares (its
    ``check(cfg)``; one-line ConfigError)."""
    check_fields(cfg)  # kind options: checked where they are built (config._build_options)
    t, d = cfg.train, cfg.data
    if t.global_batch_size % t.micro_batch_size:
        raise ConfigError(
            f"train.global_batch_size={t.global_batch_size} must be a multiple of "
            f"train.micro_batch_size={t.micro_batch_size}"
        )
    if t.min_lr > t.lr:
        raise ConfigError(f"train.min_lr={t.min_lr} must be <= train.lr={t.lr}")
    check_batch_ramp(t)
    _check_split(d.split)
    parse_valid(d.valid)  # data.valid: NAME=PREFIX entries, names unique
    _check_profile_steps(t.profile_steps, t.steps)
    for f in dataclasses.fields(t):  # the sections of the training features (megahash/feature_configs.py)
        check = getattr(getattr(t, f.name), "check", None)
        if callable(check):
            check(cfg)
    _check_levers(cfg)


def _scores_tokens(cfg) -> bool:
    from megahash.objective_spec import scores_tokens  # the objective's and the head's capability (registries)

    return scores_tokens(cfg)


def _check_levers(cfg) -> None:
    """The combinations the compact-model levers refuse (issue 44, docs/compact_models.md#levers)."""
    m, t = cfg.model, cfg.train
    if m.qk_gain and not m.qk_norm:
        raise ConfigError("model.qk_gain scales the QK-normed queries: set model.qk_norm=true (or model.qk_gain=0)")
    if m.mlp_activation != "auto" and m.layout != "prenorm":
        raise ConfigError("model.mlp_activation=relu2 is a pre-norm lever; leave it auto with model.layout=roberta")
    for key in ("x0_mix", "unet_skips"):
        if getattr(m, key) and m.layout != "prenorm":
            raise ConfigError(f"model.{key} mixes the pre-norm residual stream; set it false with model.layout=roberta")
    if m.unet_skips and m.num_layers < 2:
        raise ConfigError(
            "model.unet_skips joins mirrored layers: set model.num_layers >= 2 (or model.unet_skips=false)"
        )
    if m.value_embeds and 2 * m.value_embeds > m.num_layers:
        raise ConfigError(
            f"model.value_embeds={m.value_embeds} feeds the first and the last {m.value_embeds} layers: set it to at "
            f"most model.num_layers // 2 = {m.num_layers // 2} (0 = off)"
        )
    if (m.logit_softcap or t.z_loss) and not _scores_tokens(cfg):
        raise ConfigError(
            f"model.logit_softcap and train.z_loss act on logits over the vocabulary, which model.head={m.head} "
            f"with train.objective={t.objective} does not score; use a vocabulary head and objective (or set them to 0)"
        )
    if t.z_loss and cfg.parallel.tensor > 1:
        raise ConfigError("train.z_loss needs the whole vocabulary on one rank: parallel.tensor=1 (or train.z_loss=0)")


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


def check_value_embeds(cfg, kinds: list[str], caps_of) -> None:
    """``model.value_embeds``: every layer kind adds them to its values (``AttentionCaps.value_embeds``: the
    softmax kinds with a value stream); otherwise one line naming the kind (docs/compact_models.md#levers)."""
    if cfg.model.value_embeds:
        _every_kind_can(
            kinds,
            caps_of,
            "value_embeds",
            lambda kind: (
                f"model.value_embeds={cfg.model.value_embeds}: attention kind {kind!r} has no value stream to add "
                f"them to; use mha, gqa, mqa, mhe-add or mhe-mul layers or model.value_embeds=0"
            ),
        )


def _every_kind_can(kinds: list[str], caps_of, cap: str, error) -> None:
    """A one-line ConfigError (``error(kind)``) for the first layer kind whose capability ``cap`` is False."""
    for kind in dict.fromkeys(kinds):
        if not getattr(caps_of(kind), cap, True):
            raise ConfigError(error(kind))
