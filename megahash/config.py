"""The typed config tree of megahash: YAML files plus dotted ``a.b.c=value`` overrides.

One tree for every stage (model, embedding, attention, data, train, eval, parallel, logging).
YAML files may ``include:`` other YAML files (paths relative to the including file, or to
``configs/``); later files and overrides win. Unknown keys and wrong types raise
:class:`ConfigError` naming the key and the closest valid one. Every run writes the resolved
tree (``resolved_config.yaml``) beside its checkpoints.
"""

from __future__ import annotations

import dataclasses
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from megahash import safe_yaml
from megahash.config_files import CONFIG_ROOT, find_config  # shipped configs (package data)
from megahash.errors import ConfigError, did_you_mean


class KindOptions(dict):
    """``model.attention.options`` / ``model.embed.options``: the options the kinds declare in their own
    files (an options dataclass registered with the kind, :func:`megahash.catalog.option_specs`),
    every declared option present with its default; read as attributes (``options.chunk_size``)."""

    def __getattr__(self, key):
        try:
            return self[key]
        except KeyError:
            raise AttributeError(f"no kind declares the option {key!r}") from None

    def __setattr__(self, key, value):
        self[key] = value


def _default_options(group: str) -> KindOptions:
    return _build_options(group, {}, "")


@dataclass
class EmbeddingConfig:
    """The embedding and its word-hash codes ([Xue25] ch. 2). Unused by ``vocab``."""

    OPTION_GROUP: typing.ClassVar[str] = "embedding"
    hash_spec: str = "md5"  # side shard the embedding reads: md5, lsh128, md5-bucket50000, rolling3 ...
    num_buckets: int = 0  # bucketed codes: N rows (0 = from the hash spec)
    num_bits: int = 128  # T: bits of the code
    options: KindOptions = field(
        default_factory=lambda: _default_options("embedding")
    )  # declared by the embedding kinds' own files


@dataclass
class AttentionConfig:
    """Options of the attention layers ([Xue25] ch. 3-4)."""

    OPTION_GROUP: typing.ClassVar[str] = "attention"
    skip_nonstandard: bool = False  # `skip` evaluation mode ([Xue25] sec. 4.5)
    options: KindOptions = field(
        default_factory=lambda: _default_options("attention")
    )  # declared by the attention kinds' own files


def _standard_kind(group: str) -> str:
    from megahash import catalog

    return catalog.standard(group)


def _standard_objective() -> str:
    from megahash.objective_spec import standard

    return standard()


@dataclass
class ModelConfig:
    """Architecture: Qwen2.5-style decoder (default) or BERT-style encoder ([Xue25] Table 4.10)."""

    arch: str = "decoder"  # decoder | encoder
    layout: str = "prenorm"  # prenorm (pre-norm blocks, RoPE) | roberta (encoders: post-LN, learned positions, embedding LayerNorm, token types; megahash/models/roberta.py)
    type_vocab_size: int = 1  # roberta layout: token-type rows (RoBERTa-base 1, BERT 2)
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_query_groups: int = 0  # 0 = num_heads (MHA); fewer = GQA/MQA
    ffn_hidden_size: int = 256
    vocab_size: int = 0  # 0 = from the tokenizer / shard meta
    make_vocab_size_divisible_by: int = 128
    max_position_embeddings: int = 2048
    rotary_base: int = 1_000_000
    tie_embeddings: bool = True
    qkv_bias: bool = True
    qk_norm: bool = False  # Qwen3 QK-norm: RMSNorm (LayerNorm in encoders) over each head of q and k, before RoPE
    norm_eps: float = 1e-6
    init_std: float = 0.02
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    # defaults: the kinds registered as standard (caps.standard; megahash.catalog)
    embedding: str = field(default_factory=lambda: _standard_kind("embedding"))
    head: str = field(
        default_factory=lambda: _standard_kind("head")
    )  # output head for clm/mlm (megahash/models/heads/; sr uses its 3-way head)
    schedule: str = field(default_factory=lambda: f"uniform:{_standard_kind('attention')}")
    plugins: list[str] = field(
        default_factory=list
    )  # modules with more kinds (also MEGAHASH_PLUGINS, entry points megahash.kinds)
    embed: EmbeddingConfig = field(default_factory=EmbeddingConfig)
    attention: AttentionConfig = field(default_factory=AttentionConfig)


@dataclass
class DataConfig:
    prefix: list[str] = field(
        default_factory=list
    )  # shard prefixes (PREFIX_text_document ...) or "weight prefix" pairs
    tokenizer: str = ""  # sentencepiece .model, tokenizer.json, HF tokenizer folder/name (or "words")
    special_ids: dict = field(
        default_factory=dict
    )  # role -> id (bos pad eos unk mask); filled from the shard meta; {} = 0-4
    seq_length: int = 128
    split: str = "98,2,0"
    seed: int = 1234
    cache_dir: str = ""  # index cache (default: <save_dir>/data_cache)
    valid_samples: int = (
        64  # validation set: the first N sequences of the validation split (megahash/data/validation.py)
    )
    valid_micro_batch: int = 8  # validation chunk size (fixed, so mlm/sr corruption does not depend on the DP size)
    num_workers: int = 0
    verify: str = "cheap"  # shard checks before step 1: cheap (sizes, headers, counts) | full (+ sha256) | none
    # named held-out validation sets, NAME=PREFIX each (megahash/data/valid_sets.py); reported by name beside
    # the data.split set ("valid")
    valid: list[str] = field(default_factory=list)
    # issue 34: packed documents (Megatron's flags; megahash/data/documents.py, docs/data.md#packed-documents):
    # positions restart at each document, attention stays inside its document, no loss at EOD inputs
    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    eod_mask_loss: bool = False


@dataclass
class TrainConfig:
    objective: str = field(default_factory=_standard_objective)  # megahash/objectives/ (clm | mlm | sr)
    sr_random: str = "codes"  # sr random replacements: codes (the authors' collators: random bits/codeword/bucket/id) | batch (words of the batch)
    steps: int = 100
    micro_batch_size: int = 4
    global_batch_size: int = 8
    lr: float = 4e-4
    min_lr: float = 4e-5  # floor the decay ends at (0 = decay to zero)
    warmup_steps: int = 10
    warmup_fraction: float = 0.0  # > 0: warmup = this fraction of the decay length (Megatron's lr-warmup-fraction)
    decay: str = "cosine"  # cosine | linear | wsd (warmup-stable-decay) | constant
    decay_steps: int = 0  # decay length (Megatron's lr-decay-iters); 0 = train.steps; min_lr after it
    decay_fraction: float = 0.1  # wsd: the last fraction of decay_steps that anneals lr -> min_lr
    wsd_decay_style: str = "linear"  # wsd anneal shape: linear | cosine | 1-sqrt
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.9999
    eps: float = 1e-8
    clip_grad: float = 1.0
    seed: int = 1234
    zero_stage: int = 1
    deepspeed_config: str = ""  # path of a DeepSpeed JSON; "" = configs/deepspeed/zero{stage}.json
    precision: str = "auto"  # auto (bf16 on GPU, fp32 on CPU) | fp32 | bf16
    save_dir: str = "runs/default"
    save_interval: int = 0  # 0 = only at the end
    keep_last: int = 2
    resume: str = "auto"  # auto | none | PATH
    resume_weights_only: bool = False  # on a layout change: weights only, fresh optimizer (docs/resume.md)
    # checks of a checkpoint before it is resumed, evaluated or exported (megahash/checkpoint/manifest.py,
    # docs/security.md): cheap (sizes, zip structure) | full (+ sha256 of every file it reads)
    verify_checkpoint: str = "full"
    # resume a checkpoint that was not written by this install and whose DeepSpeed files need more than
    # weights-only loading (pickle: it can run code) (docs/security.md)
    trust_checkpoint: bool = False
    eval_interval: int = 50
    log_interval: int = 10
    recompute: str = "none"  # none | selective | full
    compile: str = (
        "auto"  # torch.compile each transformer layer (regional compilation): auto (on for GPUs) | true | false
    )
    exit_signal_handler: bool = True  # SIGUSR1/SIGTERM -> checkpoint at next step, exit for requeue
    stop_after: int = 0  # stop (as if interrupted) after this many steps; 0 = off. For tests and budget runs
    # [START, END]: torch.profiler traces of steps START..END of the run under save_dir/profile/ (and on CUDA a
    # memory snapshot); [] = off (megahash/training/profile_steps.py, docs/long_runs.md)
    profile_steps: list[int] = field(default_factory=list)
    # hang watchdog (megahash/training/watchdog.py, docs/long_runs.md): a step past the limit dumps the
    # rank's stacks to save_dir/hang/ and exits 3 (requeue); the collective timeout of the process group
    hang_timeout_s: float = 0.0  # a step (or validation/save) longer than this hangs; 0 = off
    hang_factor: float = 0.0  # a step longer than this x the median step time hangs (after 3 steps); 0 = off
    distributed_timeout_s: int = (
        600  # torch.distributed timeout of collectives (Megatron's --distributed-timeout-minutes)
    )
    # batch-size ramp (Megatron's --rampup-batch-size START INCREMENT SAMPLES; [] = off): the global batch grows
    # from START by INCREMENT over SAMPLES consumed samples to global_batch_size; LR schedule then in samples
    batch_ramp: list[int] = field(default_factory=list)
    # bad steps (megahash/training/step_guard.py): skip the update of a step whose loss or gradient norm is
    # non-finite, or whose loss exceeds spike_factor x the median loss of the last spike_window applied steps
    # (0 = no spike rule); stop after max_skips consecutive skipped steps (0 = never)
    skip_nonfinite: bool = False
    spike_factor: float = 0.0
    spike_window: int = 100
    max_skips: int = 10
    # issue 35: checkpoints written by a background writer (megatron-core async dist checkpointing;
    # latest published when it finishes; no DeepSpeed-native copy): megahash/training/async_save.py
    async_save: bool = False
    # issue 37: the optimizer (megahash/training/muon.py, docs/compact_models.md): adamw | muon. Muon takes the
    # 2-D matrices of the transformer layers at muon_lr (torch.optim.Muon's algorithm), AdamW the rest at train.lr;
    # the LR schedule scales both. muon_adjust_lr: original (sqrt(max(1, rows/cols))) | match_rms_adamw (0.2 sqrt(max))
    optimizer: str = "adamw"
    muon_lr: float = 0.02
    muon_momentum: float = 0.95
    muon_nesterov: bool = True
    muon_ns_steps: int = 5
    muon_adjust_lr: str = "original"
    # issue 37: exponential moving average of the weights, updated after every optimizer step
    # (megahash/training/ema.py, docs/compact_models.md); 0 = off
    ema_decay: float = 0.0
    ema_warmup: bool = False  # timm's warmup correction: decay min(ema_decay, (1 + n) / (10 + n)) after n steps
    # issue 37: quantization-aware training of the last qat_fraction of the steps: the hidden matrices
    # fake-quantized per row to qat_bits (8 | 6 | 4; 0 = off) with a straight-through estimator
    # (megahash/training/qat.py, docs/compact_models.md)
    qat_bits: int = 0
    qat_fraction: float = 0.1


@dataclass
class ParallelConfig:
    tensor: int = 1
    sequence: bool = False


@dataclass
class EvalConfig:
    tasks: list[str] = field(default_factory=list)
    tasks_dir: str = ""
    # let task files of tasks_dir run Python (lm-eval's !function, evaluate metrics, unsandboxed templates);
    # refused otherwise (megahash eval --trust-task-code; docs/security.md)
    trust_task_code: bool = False
    batch_size: int = 8
    at_end: bool = False
    # evaluation during training (megahash/training/eval_during.py): every `interval` steps the checkpoint of
    # that step (a save forced there) is evaluated on `tasks` by a `megahash eval` child process; 0 = off
    interval: int = 0
    wait_s: float = 1800.0  # at the end of the run, seconds to wait for the evaluations still running


@dataclass
class LoggingConfig:
    tensorboard: bool = True
    wandb: bool = False
    wandb_project: str = "megahash"
    wandb_mode: str = "offline"  # offline | online | disabled
    run_name: str = ""
    plot: bool = True  # write loss_curve.png at the end
    x_axis: str = "step"  # TensorBoard/wandb x-axis: step | tokens | samples (consumed, logged every step)
    verbose: bool = (
        False  # = pretrain.py --verbose: the libraries' warnings, logs and progress bars too (known_warnings.py)
    )


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def to_dict(self) -> dict:
        return _plain(dataclasses.asdict(self))

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


# --------------------------------------------------------------------------------------- loading


def _plain(tree):
    """Nested dicts (KindOptions included) as plain dicts, for YAML and JSON."""
    if isinstance(tree, dict):
        return {k: _plain(v) for k, v in tree.items()}
    return tree


def _resolve_include(name: str, base_dir: Path) -> Path:
    for cand in (base_dir / name, CONFIG_ROOT / name, Path(name)):
        if cand.is_file():
            return cand
    raise ConfigError(f"included config {name!r} not found (looked in {base_dir} and {CONFIG_ROOT})")


def read_yaml_mapping(path, what: str) -> dict:
    """The mapping a YAML file holds; a missing file, bad YAML or a non-mapping is one line
    naming ``what`` file it is (config, grid)."""
    try:
        data = safe_yaml.load(Path(path).read_text(), f"{what} file {path}") or {}
    except FileNotFoundError:
        raise ConfigError(f"{what} file {str(path)!r} does not exist") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{what} file {path} is not UTF-8 text (byte {e.start}); give a YAML file") from None
    except OSError as e:  # a directory, no permission
        raise ConfigError(f"{what} file {path} cannot be read: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{what} file {path} is not valid YAML: {str(e).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{what} file {path} must hold a mapping at top level")
    return data


def _load_yaml_tree(path: Path, seen: tuple[Path, ...] = ()) -> dict:
    """Read a YAML file, merging its ``include:`` list first (depth-first, later wins)."""
    path = path.resolve()
    if path in seen:
        raise ConfigError(f"config include cycle at {path}")
    data = read_yaml_mapping(path, "config")
    includes = data.pop("include", []) or []
    if isinstance(includes, str):
        includes = [includes]
    merged: dict = {}
    for inc in includes:
        _deep_merge(merged, _load_yaml_tree(_resolve_include(inc, path.parent), seen + (path,)))
    _deep_merge(merged, data)
    return merged


def _deep_merge(dst: dict, src: dict) -> dict:
    for k, v in src.items():
        if isinstance(v, dict) and isinstance(dst.get(k), dict):
            _deep_merge(dst[k], v)
        else:
            dst[k] = v
    return dst


_suggest = did_you_mean


def _coerce(value: Any, typ: Any, dotted: str) -> Any:
    """Check/convert a YAML value to a dataclass field type; one-line error otherwise."""
    origin = typing.get_origin(typ)
    if origin is list:
        (inner,) = typing.get_args(typ)
        if isinstance(value, str):
            value = [v for v in value.split(",") if v] if "," in value or value else []
        if not isinstance(value, list):
            value = [value]
        return [_coerce(v, inner, dotted) for v in value]
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(typ) if a is not type(None)]
        if value is None:
            return None
        return _coerce(value, args[0], dotted)
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


def _build(cls, data: dict, prefix: str):
    if not isinstance(data, dict):
        raise ConfigError(f"config key {prefix.rstrip('.')!r} must be a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        dotted = prefix + key
        if key not in names:
            raise ConfigError(f"unknown config key {dotted!r}{_suggest(key, names)}")
        typ = hints[key]
        if dataclasses.is_dataclass(typ):
            kwargs[key] = _build(typ, value or {}, dotted + ".")
        elif typ is KindOptions:
            kwargs[key] = _build_options(cls.OPTION_GROUP, value or {}, dotted + ".")
        else:
            kwargs[key] = _coerce(value, typ, dotted)
    return cls(**kwargs)


def _build_options(group: str, data: dict, prefix: str) -> KindOptions:
    """Every option the ``group``'s kinds declare: given values coerced and range-checked, others at
    their defaults; a key no kind declares is one line naming the closest."""
    from megahash import catalog
    from megahash.config_checks import check_value

    if not isinstance(data, dict):
        raise ConfigError(f"config key {prefix.rstrip('.')!r} must be a mapping, got {data!r}")
    specs = catalog.option_specs(group)
    for key in data:
        if key not in specs:
            raise ConfigError(
                f"unknown config key {prefix + key!r}{_suggest(key, specs)} (no {group} kind declares it)"
            )
    out = KindOptions()
    for name, spec in sorted(specs.items()):
        value = _coerce(data[name], spec.type, prefix + name) if name in data else spec.default
        check_value(prefix + name, value, spec.range)
        out[name] = value
    return out


def parse_override(text: str) -> tuple[list[str], Any]:
    """``a.b.c=value`` -> (["a","b","c"], yaml-parsed value)."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} must look like key.sub=value")
    key, raw = text.split("=", 1)
    try:
        value = safe_yaml.load(raw, f"override {key}") if raw != "" else ""
    except yaml.YAMLError:
        value = raw
    return key.strip().split("."), value


def apply_overrides(tree: dict, overrides: list[str]) -> dict:
    for ov in overrides:
        keys, value = parse_override(ov)
        node = tree
        for k in keys[:-1]:
            node = node.setdefault(k, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {ov!r}: {k!r} is not a section")
        node[keys[-1]] = value
    return tree


def load_config(path: str | os.PathLike | list | tuple | None = None, overrides: list[str] | None = None) -> Config:
    """YAML file(s) (with includes) + dotted overrides -> validated :class:`Config`.

    Several files merge left to right (later files win, mappings merged key by key), as
    ``--config A --config B`` does.

    ``model.size=NAME`` (override or YAML) merges ``configs/model/NAME.yaml`` under the model keys
    given explicitly.
    """
    tree: dict = {}
    for p in [p for p in ([path] if isinstance(path, (str, os.PathLike)) else list(path or [])) if p]:
        _deep_merge(tree, _load_yaml_tree(find_config(p)))
    tree = apply_overrides(tree, list(overrides or []))
    size = (tree.get("model") or {}).pop("size", None)
    if size:
        size_file = CONFIG_ROOT / "model" / f"{size}.yaml"
        if not size_file.is_file():
            names = [p.stem for p in (CONFIG_ROOT / "model").glob("*.yaml")]
            raise ConfigError(f"unknown model size {size!r}{_suggest(str(size), names)}")
        base = _load_yaml_tree(size_file)
        tree = _deep_merge(base, tree)
    cfg = _build(Config, tree, "")
    validate(cfg)
    return cfg


def validate(cfg: Config) -> None:
    """Cross-field checks that do not need the model or the data (one-line errors)."""
    from megahash.config_checks import check_ranges
    from megahash.models.arch import ARCHS, arch_of
    from megahash.objective_spec import objective_spec

    check_ranges(cfg)  # every number inside its range first (megahash/config_checks.py)
    m, p = cfg.model, cfg.parallel
    if m.arch not in ARCHS:
        raise ConfigError(f"model.arch must be {' or '.join(ARCHS)}, got {m.arch!r}")
    if m.layout not in ("prenorm", "roberta"):
        raise ConfigError(f"model.layout must be prenorm or roberta, got {m.layout!r}")
    if m.layout == "roberta" and arch_of(m.arch).causal:
        raise ConfigError("model.layout=roberta is an encoder layout; set model.arch=encoder or model.layout=prenorm")
    if m.hidden_size % m.num_heads:
        raise ConfigError(f"model.hidden_size={m.hidden_size} is not divisible by model.num_heads={m.num_heads}")
    groups = m.num_query_groups or m.num_heads
    if m.num_heads % groups:
        raise ConfigError(f"model.num_heads={m.num_heads} is not divisible by model.num_query_groups={groups}")
    if p.tensor < 1:
        raise ConfigError(f"parallel.tensor must be >= 1, got {p.tensor}")
    if m.num_heads % p.tensor:
        raise ConfigError(
            f"parallel.tensor={p.tensor} does not divide model.num_heads={m.num_heads}; "
            f"choose a tensor size among {[d for d in range(1, m.num_heads + 1) if m.num_heads % d == 0]}"
        )
    if groups % p.tensor and groups >= p.tensor:
        raise ConfigError(f"parallel.tensor={p.tensor} does not divide model.num_query_groups={groups}")
    if m.ffn_hidden_size % p.tensor:
        raise ConfigError(f"parallel.tensor={p.tensor} does not divide model.ffn_hidden_size={m.ffn_hidden_size}")
    if p.sequence and p.tensor == 1:
        raise ConfigError(
            "parallel.sequence=true needs parallel.tensor >= 2 (sequence parallelism splits over the TP group)"
        )
    if cfg.data.seq_length > m.max_position_embeddings:
        raise ConfigError(
            f"data.seq_length={cfg.data.seq_length} exceeds model.max_position_embeddings="
            f"{m.max_position_embeddings}; lower data.seq_length or raise the position limit"
        )
    if p.sequence and cfg.data.seq_length % p.tensor:
        raise ConfigError(
            f"data.seq_length={cfg.data.seq_length} must be divisible by parallel.tensor={p.tensor} under sequence parallelism"
        )
    t = cfg.train
    objective_spec(t.objective)  # an unknown one: "train.objective must be clm, mlm or sr, got ..."
    if t.sr_random not in ("codes", "batch"):
        raise ConfigError(f"train.sr_random must be codes or batch, got {t.sr_random!r}")
    if t.decay not in ("cosine", "linear", "wsd", "constant"):
        raise ConfigError(f"train.decay must be cosine, linear, wsd or constant, got {t.decay!r}")
    if t.wsd_decay_style not in ("linear", "cosine", "1-sqrt"):
        raise ConfigError(f"train.wsd_decay_style must be linear, cosine or 1-sqrt, got {t.wsd_decay_style!r}")
    if t.precision not in ("auto", "fp32", "bf16"):
        raise ConfigError(f"train.precision must be auto, fp32 or bf16, got {t.precision!r}")
    t.compile = str(t.compile).lower()
    if t.compile not in ("auto", "true", "false"):
        raise ConfigError(f"train.compile must be auto, true or false, got {t.compile!r}")
    if t.zero_stage not in (0, 1, 2, 3):
        raise ConfigError(f"train.zero_stage must be 0-3, got {t.zero_stage}")
    if cfg.logging.x_axis not in ("step", "tokens", "samples"):
        raise ConfigError(f"logging.x_axis must be step, tokens or samples, got {cfg.logging.x_axis!r}")
    if t.recompute not in ("none", "selective", "full"):
        raise ConfigError(f"train.recompute must be none, selective or full, got {t.recompute!r}")


def save_config(cfg: Config, path: str | os.PathLike) -> None:
    """Atomically write the resolved tree as YAML."""
    from megahash.atomic_write import write_text_atomic

    write_text_atomic(path, cfg.to_yaml())


# keys an earlier release wrote into resolved_config.yaml that no longer exist (key path: the release that dropped
# it); a checkpoint's saved tree drops them, so evaluation and export read checkpoints of that release. A YAML a
# user writes gets the unknown-key error for them as for any other key.
RETIRED_KEYS = {("train", "eval_iters"): "0.1.0 (issue 38: never read)"}


def without_retired(tree: dict) -> dict:
    """A saved config tree without :data:`RETIRED_KEYS` (in place; returns it)."""
    for path in RETIRED_KEYS:
        node = tree
        for key in path[:-1]:
            node = node.get(key) if isinstance(node, dict) else None
        if isinstance(node, dict):
            node.pop(path[-1], None)
    return tree


def config_from_dict(tree: dict) -> Config:
    import copy

    return _build(Config, copy.deepcopy(tree), "")
