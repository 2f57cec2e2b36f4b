"""The typed config tree of megahash: YAML files plus dotted ``a.b.c=value`` overrides.

One tree for every stage (model, embedding, attention, data, train, eval, parallel, logging, export).
YAML files may ``include:`` other YAML files (paths relative to the including file, or to
``configs/``); later files and overrides win. Unknown keys and wrong types raise
:class:`ConfigError` naming the key and the closest valid one. Every run writes the resolved
tree (``resolved_config.yaml``) beside its checkpoints.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from megahash import feature_configs, safe_yaml
from megahash.config_checks import coerce as _coerce  # a value to its field's type, one-line error otherwise
from megahash.config_checks import ranged
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
    num_buckets: int = ranged(0, "[0, inf)", "hash-emb rows; 0 = from the hash spec")  # N rows (0 = from the hash spec)
    num_bits: int = ranged(128, "[1, 128]", "bits of the hash code")  # T: bits of the code
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
    # prenorm (pre-norm blocks, RoPE) | roberta (encoders: post-LN, learned positions, embedding LayerNorm, token
    # types; megahash/models/roberta.py)
    layout: Literal["prenorm", "roberta"] = "prenorm"
    type_vocab_size: int = ranged(1, "[1, inf)", "token-type rows of the roberta layout")  # RoBERTa-base 1, BERT 2
    hidden_size: int = ranged(64, "[1, inf)", "hidden width")
    num_layers: int = ranged(2, "[1, inf)", "transformer layers")
    num_heads: int = ranged(4, "[1, inf)", "attention heads")
    num_query_groups: int = ranged(0, "[0, inf)", "K/V groups; 0 = num_heads")  # fewer = GQA/MQA
    ffn_hidden_size: int = ranged(256, "[1, inf)", "MLP width")
    vocab_size: int = ranged(0, "[0, inf)", "vocabulary; 0 = from the tokenizer")  # or the shard meta
    make_vocab_size_divisible_by: int = ranged(128, "[1, inf)", "vocabulary padding multiple")
    max_position_embeddings: int = ranged(2048, "[1, inf)", "longest sequence")
    rotary_base: int = ranged(1_000_000, "[1, inf)", "RoPE base")
    tie_embeddings: bool = True
    qkv_bias: bool = True
    qk_norm: bool = False  # Qwen3 QK-norm: RMSNorm (LayerNorm in encoders) over each head of q and k, before RoPE
    norm_eps: float = ranged(1e-6, "(0, 1]", "norm epsilon")
    init_std: float = ranged(0.02, "(0, inf)", "init standard deviation")
    hidden_dropout: float = ranged(0.0, "[0, 1)", "dropout probability")
    attention_dropout: float = ranged(0.0, "[0, 1)", "dropout probability")
    # issue 44 (docs/compact_models.md#levers): the compact-model levers of the model, each off by default
    # std of the embedding tables (vocabulary, hash tables; the tied head); 0 = init_std
    embed_init_std: float = ranged(0.0, "[0, inf)", "init std of the embedding tables; 0 = model.init_std")
    # vocabulary logits c tanh(z / c) with c this (Gemma 2, modded-nanogpt); 0 = off
    logit_softcap: float = ranged(0.0, "[0, inf)", "logit soft-cap c (c tanh(z / c)); 0 = off")
    zero_init_proj: bool = False  # attention and MLP output projections (linear_proj, linear_fc2) start at zero
    # a learnable per-head gain on the QK-normed queries, its initial value (needs qk_norm); 0 = off
    qk_gain: float = ranged(0.0, "[0, inf)", "initial per-head query gain after QK-norm; 0 = off")
    # auto (SwiGLU in decoders, GELU in encoders) | relu2 (ReLU squared, 2 matrices)
    mlp_activation: Literal["auto", "relu2"] = "auto"
    # layer i's input a_i x + b_i RMSNorm(embedding), learnable (a_i, b_i) from (1, 0) (modded-nanogpt)
    x0_mix: bool = False
    # U-Net: layer i < L//2's output, times a learnable weight (1 at init), added to layer L-1-i's input
    unet_skips: bool = False
    # value embeddings: N token tables added (times a learnable gain) to the values of layers 0..N-1 and L-N..L-1
    value_embeds: int = ranged(0, "[0, inf)", "value-embedding tables (layers k and L-N+k share table k); 0 = off")
    # issue 48: maximal-update parametrization (megahash/models/mup.py, docs/compact_models.md): the base model's
    # hidden size B; the learning rates tuned at width B hold at any hidden_size (0 = off, the standard model)
    mup_base_hidden_size: int = ranged(0, "[0, inf)", "muP's base hidden size; 0 = off")
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
    seq_length: int = ranged(128, "[1, inf)", "tokens per sample")
    split: str = "98,2,0"
    seed: int = ranged(1234, "[0, 4294967295]", "seed")
    cache_dir: str = ""  # index cache (default: <save_dir>/data_cache)
    # validation set: the first N sequences of the validation split (megahash/data/validation.py)
    valid_samples: int = ranged(64, "[1, inf)", "validation sequences")
    # validation chunk size (fixed, so mlm/sr corruption does not depend on the DP size)
    valid_micro_batch: int = ranged(8, "[1, inf)", "validation chunk size")
    num_workers: int = ranged(0, "[0, inf)", "loader processes")
    verify: Literal["cheap", "full", "none"] = "cheap"  # shard checks before step 1: cheap (sizes, headers,
    # counts) | full (+ sha256) | none
    # named held-out validation sets, NAME=PREFIX each (megahash/data/valid_sets.py); reported by name beside
    # the data.split set ("valid")
    valid: list[str] = field(default_factory=list)
    # issue 34: packed documents (Megatron's flags; megahash/data/documents.py, docs/data.md#packed-documents):
    # positions restart at each document, attention stays inside its document, no loss at EOD inputs
    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    eod_mask_loss: bool = False


@dataclass
class TrainCore:
    """``train``: the optimizer step, its schedule, checkpoints and the run (the training features' own
    sections join it: :data:`TrainConfig`)."""

    objective: str = field(default_factory=_standard_objective)  # megahash/objectives/ (clm | mlm | sr)
    # sr random replacements: codes (the authors' collators: random bits/codeword/bucket/id) | batch (words of
    # the batch)
    sr_random: Literal["codes", "batch"] = "codes"
    steps: int = ranged(100, "[1, inf)", "the number of optimizer steps")
    micro_batch_size: int = ranged(4, "[1, inf)", "sequences per rank per micro-batch")
    global_batch_size: int = ranged(8, "[1, inf)", "sequences per optimizer step")
    lr: float = ranged(4e-4, "(0, inf)", "peak learning rate")
    min_lr: float = ranged(4e-5, "[0, inf)", "final learning rate")  # floor the decay ends at (0 = decay to zero)
    warmup_steps: int = ranged(10, "[0, inf)", "warmup steps")
    # > 0: warmup = this fraction of the decay length (Megatron's lr-warmup-fraction)
    warmup_fraction: float = ranged(0.0, "[0, 1)", "warmup as a fraction of the decay length; 0 = warmup_steps")
    decay: Literal["cosine", "linear", "wsd", "constant"] = "cosine"  # wsd: warmup-stable-decay
    # decay length (Megatron's lr-decay-iters); 0 = train.steps; min_lr after it
    decay_steps: int = ranged(0, "[0, inf)", "LR decay length; 0 = train.steps")
    # wsd: the last fraction of decay_steps that anneals lr -> min_lr
    decay_fraction: float = ranged(0.1, "(0, 1]", "wsd: annealed fraction of the decay length")
    wsd_decay_style: Literal["linear", "cosine", "1-sqrt"] = "linear"  # wsd anneal shape
    weight_decay: float = ranged(0.1, "[0, inf)", "AdamW weight decay")
    beta1: float = ranged(0.9, "[0, 1)", "Adam beta1")
    beta2: float = ranged(0.9999, "[0, 1)", "Adam beta2")
    eps: float = ranged(1e-8, "(0, inf)", "Adam epsilon")
    clip_grad: float = ranged(1.0, "[0, inf)", "gradient clipping norm; 0 = off")
    seed: int = ranged(1234, "[0, 4294967295]", "seed")
    zero_stage: int = ranged(1, "[0, 3]", "DeepSpeed ZeRO stage")
    deepspeed_config: str = ""  # path of a DeepSpeed JSON; "" = configs/deepspeed/zero{stage}.json
    # auto: bf16 on GPU, fp32 on CPU (a run's resolved_config.yaml records which)
    precision: Literal["auto", "fp32", "bf16"] = "auto"
    save_dir: str = "runs/default"
    save_interval: int = ranged(0, "[0, inf)", "steps between checkpoints; 0 = only at the end")
    keep_last: int = ranged(2, "[0, inf)", "checkpoints kept; 0 = all")
    resume: str = "auto"  # auto | none (or false) | PATH
    resume_weights_only: bool = False  # on a layout change: weights only, fresh optimizer (docs/resume.md)
    # checks of a checkpoint before it is resumed, evaluated or exported (megahash/checkpoint/manifest.py,
    # docs/security.md): cheap (sizes, zip structure) | full (+ sha256 of every file it reads)
    verify_checkpoint: Literal["cheap", "full"] = "full"
    # resume a checkpoint that was not written by this install and whose DeepSpeed files need more than
    # weights-only loading (pickle: it can run code) (docs/security.md)
    trust_checkpoint: bool = False
    eval_interval: int = ranged(50, "[0, inf)", "steps between validations; 0 = off")
    log_interval: int = ranged(10, "[1, inf)", "steps between printed lines")
    recompute: Literal["none", "selective", "full"] = "none"
    # torch.compile each transformer layer (regional compilation): auto (on for GPUs) | true | false
    compile: Literal["auto", "true", "false"] = "auto"
    exit_signal_handler: bool = True  # SIGUSR1/SIGTERM -> checkpoint at next step, exit for requeue
    # stop (as if interrupted) after this many steps; 0 = off. For tests and budget runs
    stop_after: int = ranged(0, "[0, inf)", "stop after this step; 0 = off")
    # [START, END]: torch.profiler traces of steps START..END of the run under save_dir/profile/ (and on CUDA a
    # memory snapshot); [] = off (megahash/training/profile_steps.py, docs/long_runs.md)
    profile_steps: list[int] = field(default_factory=list)
    # torch.distributed timeout of collectives (Megatron's --distributed-timeout-minutes)
    distributed_timeout_s: int = ranged(600, "[1, inf)", "seconds a collective may wait")
    # batch-size ramp (Megatron's --rampup-batch-size START INCREMENT SAMPLES; [] = off): the global batch grows
    # from START by INCREMENT over SAMPLES consumed samples to global_batch_size; LR schedule then in samples
    batch_ramp: list[int] = field(default_factory=list)
    # issue 35: checkpoints written by a background writer (megatron-core async dist checkpointing;
    # latest published when it finishes; no DeepSpeed-native copy): megahash/training/async_save.py
    async_save: bool = False
    # issue 37: the optimizer (megahash/training/muon.py, docs/compact_models.md): adamw | muon (its options:
    # train.muon)
    optimizer: Literal["adamw", "muon"] = "adamw"
    # issue 44 (docs/compact_models.md#levers): a peak learning rate of their own for the embedding tables (and
    # the tied head), megahash/training/embed_group.py; 0 = train.lr
    embed_lr: float = ranged(0.0, "[0, inf)", "peak learning rate of the embedding tables; 0 = train.lr")
    # issue 44: z-loss coefficient (PaLM: loss += z logsumexp^2) in the vocabulary head's cross-entropy; 0 = off
    z_loss: float = ranged(0.0, "[0, inf)", "z-loss coefficient; 0 = off")


def _train_config() -> type:
    """``TrainConfig``: :class:`TrainCore` and one section per training feature that declares a ``Config`` in
    its own file (``train.ema``, ``train.step_guard``, ...: megahash/feature_configs.py), read from the
    source without importing the feature (torch). A section's class is named here too (``EmaConfig``), so a
    config pickles."""
    fields = []
    for name, cls in feature_configs.sections():
        cls.__name__ = cls.__qualname__ = "".join(part.title() for part in name.split("_")) + "Config"
        cls.__module__ = __name__
        globals()[cls.__name__] = cls
        fields.append((name, cls, field(default_factory=cls)))
    cls = dataclasses.make_dataclass("TrainConfig", fields, bases=(TrainCore,))
    cls.__module__, cls.__doc__ = __name__, TrainCore.__doc__
    return cls


TrainConfig = _train_config()


def reload_features() -> None:
    """Build :data:`TrainConfig` again (after ``MEGAHASH_FEATURES`` changed: a feature outside the package)."""
    from megahash import config_checks

    global TrainConfig
    feature_configs.sections.cache_clear()
    TrainConfig = _train_config()
    config_checks._hints.cache_clear()  # the tree's type hints name the old class


@dataclass
class ParallelConfig:
    tensor: int = ranged(1, "[1, inf)", "tensor-parallel size")
    sequence: bool = False


@dataclass
class EvalConfig:
    tasks: list[str] = field(default_factory=list)
    tasks_dir: str = ""
    # let task files of tasks_dir run Python (lm-eval's !function, evaluate metrics, unsandboxed templates);
    # refused otherwise (megahash eval --trust-task-code; docs/security.md)
    trust_task_code: bool = False
    batch_size: int = ranged(8, "[1, inf)", "evaluation batch size")
    at_end: bool = False
    # evaluation during training (megahash/training/eval_during.py): every `interval` steps the checkpoint of
    # that step (a save forced there) is evaluated on `tasks` by a `megahash eval` child process; 0 = off
    interval: int = ranged(0, "[0, inf)", "steps between evaluations of eval.tasks during training; 0 = off")
    # at the end of the run, seconds to wait for the evaluations still running
    wait_s: float = ranged(1800.0, "[0, inf)", "seconds the end of a run waits for evaluations still running")
    # `megahash eval --text`'s dynamic evaluation (megahash/eval/dynamic.py; --dynamic-lr/--dynamic-clip override):
    # SGD step size on each scored window (0 = off) and the clipping norm of its gradient
    dynamic_lr: float = ranged(0.0, "[0, inf)", "dynamic evaluation's SGD step size; 0 = off")
    dynamic_clip: float = ranged(1.0, "(0, inf)", "dynamic evaluation's gradient clipping norm")


ArtifactFormat = Literal["int8", "int6", "int4"]  # megahash/models/quantized.py FORMATS


@dataclass
class ArtifactConfig:
    """``export.artifact``: the quantized artifact ``megahash export --checkpoint RUN`` writes with no other
    flags (docs/convert.md#quantized-artifacts): a format per tensor group (megahash/models/tensor_groups.py:
    the module slot a tensor lies in) and the codec. ``--quantize`` overrides it (``int8`` every group,
    ``mlp=int4,attention=int6`` those groups)."""

    embedding: ArtifactFormat = "int8"  # embedding tables (token, hash, n-gram; the tied head) and projections
    attention: ArtifactFormat = "int8"  # every layer's self_attention slot, whatever its kind
    mlp: ArtifactFormat = "int8"  # every layer's mlp slot
    head: ArtifactFormat = "int8"  # an untied output layer, the objective's head
    other: ArtifactFormat = "int8"  # any other matrix above the size kept in floating point
    compress: Literal["zstd", "zlib"] = "zstd"


@dataclass
class ExportConfig:
    artifact: ArtifactConfig = field(default_factory=ArtifactConfig)


@dataclass
class LoggingConfig:
    tensorboard: bool = True
    wandb: bool = False
    wandb_project: str = "megahash"
    # wandb.init's mode (wandb's Settings.mode); a misspelt one failed at the first logged step, after the build
    wandb_mode: Literal["offline", "online", "shared", "disabled", "dryrun", "run"] = "offline"
    run_name: str = ""
    plot: bool = True  # write loss_curve.png at the end
    # TensorBoard/wandb x-axis (consumed, logged every step)
    x_axis: Literal["step", "tokens", "samples"] = "step"
    verbose: bool = (
        False  # = pretrain.py --verbose: the libraries' warnings, logs and progress bars too (known_warnings.py)
    )


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=lambda: TrainConfig())  # late: reload_features rebuilds it
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    export: ExportConfig = field(default_factory=ExportConfig)

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
        data = safe_yaml.load(Path(path).read_text(), f"{what} file {path}", safe_yaml.UniqueKeyLoader) or {}
    except FileNotFoundError:
        raise ConfigError(f"{what} file {str(path)!r} does not exist") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{what} file {path} is not UTF-8 text (byte {e.start}); give a YAML file") from None
    except OSError as e:  # a directory, no permission
        saved = Path(path) / "resolved_config.yaml"  # a run or step folder: its config is the file inside
        hint = f"; a run's config is {saved}" if Path(path).is_dir() and saved.is_file() else ""
        raise ConfigError(f"{what} file {path} cannot be read: {e.strerror}{hint}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{what} file {path} is not valid YAML: {yaml_problem(e)}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{what} file {path} must hold a mapping at top level")
    return data


def yaml_problem(e: yaml.YAMLError) -> str:
    """What PyYAML found wrong and where (``found character '\\t' that cannot start any token (line 2,
    column 1)``; a tab indents YAML): its problem and mark, not its first line, which is only the context
    (``while scanning for the next token``)."""
    problem, mark = getattr(e, "problem", None), getattr(e, "problem_mark", None)
    if not problem:
        return str(e).splitlines()[0]
    where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
    tab = "; indent with spaces, not tabs" if "'\\t'" in problem else ""
    context = getattr(e, "context", None)  # "expected a single document in the stream" (a second ---)
    context = f"{context}, " if context and not context.startswith("while ") else ""
    return f"{context}{problem}{where}{tab}"


# top-level keys of a DeepSpeed config (its JSON is YAML too): such a file given as --config is named as one
DEEPSPEED_KEYS = (
    "zero_optimization",
    "train_batch_size",
    "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps",
    "zero_allow_untested_optimizer",
    "steps_per_print",
    "wall_clock_breakdown",
    "gradient_clipping",
    "fp16",
    "bf16",
)


def _refuse_deepspeed_json(data: dict, path: Path) -> None:
    """A DeepSpeed config passed as ``--config`` (no megahash section, a DeepSpeed key): one line saying where it
    goes (it was 'unknown config key 'zero_optimization'', or a suggestion of a megahash key for its name)."""
    if any(k in data for k in (f.name for f in dataclasses.fields(Config))):
        return
    found = [k for k in DEEPSPEED_KEYS if k in data]
    if found:
        raise ConfigError(
            f"config file {path} is a DeepSpeed config ({found[0]}), not a megahash one; give it as "
            f"--deepspeed_config {path} (= train.deepspeed_config) beside a megahash --config YAML"
        )


def _load_yaml_tree(path: Path, seen: tuple[Path, ...] = (), notes: list | None = None) -> dict:
    """Read a YAML file, merging its ``include:`` list first (depth-first, later wins); old key names
    (:data:`RENAMED_KEYS`) moved to their new ones, each noted in ``notes``."""
    path = path.resolve()
    if path in seen:
        raise ConfigError(f"config include cycle at {path}")
    data = read_yaml_mapping(path, "config")
    _refuse_deepspeed_json(data, path)
    data = migrate(data, f"config file {path}", notes)
    includes = data.pop("include", []) or []
    if isinstance(includes, str):
        includes = [includes]
    if not isinstance(includes, list) or not all(isinstance(i, str) and i for i in includes):
        # include: 3, include: [a.yaml, null] were TypeError tracebacks; include: {a: 1} looked for a file 'a'
        raise ConfigError(f"config file {path}: include must be a file name or a list of them, got {includes!r}")
    merged: dict = {}
    for inc in includes:
        _deep_merge(merged, _load_yaml_tree(_resolve_include(inc, path.parent), seen + (path,), notes))
    _deep_merge(merged, data)
    return merged


def _deep_merge(dst: dict, src: dict, path: tuple = ()) -> dict:
    """``src`` into ``dst`` (in place), mappings key by key, later values winning. A section left empty in
    ``src`` (``model:`` with its keys commented out: YAML's null) merges nothing, as ``model: {}`` does;
    it used to replace the section of ``dst`` with the defaults."""
    for k, v in src.items():
        if isinstance(v, dict) and isinstance(dst.get(k), dict):
            _deep_merge(dst[k], v, (*path, k))
        elif v is None and isinstance(dst.get(k), dict) and is_section([*path, k]):
            continue
        else:
            dst[k] = v
    return dst


def field_type(keys):
    """The declared type of the dotted key path ``keys`` (a section's dataclass, ``KindOptions``, a kind option's
    type); None for a path the tree does not declare."""
    from megahash import catalog

    typ, owner = Config, None
    for key in keys:
        if typ is KindOptions:
            spec = catalog.option_specs(owner.OPTION_GROUP).get(key)
            typ, owner = (spec.type if spec is not None else None), None
        elif dataclasses.is_dataclass(typ):
            typ, owner = typing.get_type_hints(typ).get(key), typ
        else:
            return None
    return typ


def is_section(keys) -> bool:
    """Whether the dotted key path ``keys`` names a section of the tree (a dataclass, or a kind's options),
    not a value (``data.special_ids`` is a value that happens to be a mapping)."""
    typ = field_type(keys)
    return typ is KindOptions or dataclasses.is_dataclass(typ)


_suggest = did_you_mean

# names other trainers give megahash's keys (Megatron-LM / GPT-NeoX arguments, torchtitan's TOML) that differ
# from megahash's own leaf names; a key spelled so is unknown, with megahash's key as the suggestion
FOREIGN_NAMES = {
    "num_attention_heads": "model.num_heads",
    "n_heads": "model.num_heads",
    "n_layers": "model.num_layers",
    "dim": "model.hidden_size",
    "norm_epsilon": "model.norm_eps",
    "layernorm_epsilon": "model.norm_eps",
    "init_method_std": "model.init_std",
    "rotary_emb_base": "model.rotary_base",
    "rope_theta": "model.rotary_base",
    "padded_vocab_size": "model.vocab_size",
    "data_path": "data.prefix",
    "tokenizer_model": "data.tokenizer",
    "tokenizer_type": "data.tokenizer",
    "train_iters": "train.steps",
    "training_steps": "train.steps",
    "lr_warmup_iters": "train.warmup_steps",
    "lr_warmup_fraction": "train.warmup_fraction",
    "lr_decay_iters": "train.decay_steps",
    "lr_decay_style": "train.decay",
    "adam_beta1": "train.beta1",
    "adam_beta2": "train.beta2",
    "adam_eps": "train.eps",
    "gradient_clipping": "train.clip_grad",
    "max_norm": "train.clip_grad",
    "train_micro_batch_size_per_gpu": "train.micro_batch_size",
    "train_batch_size": "train.global_batch_size",
    "save": "train.save_dir",
    "load": "train.resume",
    "bf16": "train.precision",
    "fp16": "train.precision",
    "mixed_precision_param": "train.precision",
    "tensor_model_parallel_size": "parallel.tensor",
    "model_parallel_size": "parallel.tensor",
    "sequence_parallel": "parallel.sequence",
}


def _leaf_keys() -> dict[str, list[str]]:
    """{leaf name: [dotted keys]} over the whole tree, the kinds' options included."""
    from megahash import catalog

    out: dict[str, list[str]] = {}

    def walk(cls, prefix):
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            typ = hints[f.name]
            if dataclasses.is_dataclass(typ):
                walk(typ, f"{prefix}{f.name}.")
            elif typ is KindOptions:
                for name in catalog.option_specs(cls.OPTION_GROUP):
                    out.setdefault(name, []).append(f"{prefix}{f.name}.{name}")
            out.setdefault(f.name, []).append(prefix + f.name)

    walk(Config, "")
    return out


def suggest_key(dotted: str, options) -> str:
    """The tail of an unknown-key error for ``dotted`` (its section's keys are ``options``): a key of that
    name elsewhere in the tree (``train.seq_length`` -> ``data.seq_length``), megahash's name for another
    trainer's (:data:`FOREIGN_NAMES`), else the closest key of the section (or them all)."""
    key = dotted.rsplit(".", 1)[-1]
    leaf = key.replace("-", "_")  # GPT-NeoX's YAML spells its keys with dashes (num-layers)
    elsewhere = [k for k in _leaf_keys().get(leaf, []) if k != dotted]
    if not elsewhere and leaf in FOREIGN_NAMES:
        return f" (did you mean {FOREIGN_NAMES[leaf]!r}? megahash's name for {key!r})"
    if elsewhere:  # the section's close keys first (train.warmup: train.warmup_steps ... or train.ema.warmup)
        near = difflib.get_close_matches(key, list(options), n=1, cutoff=0.8)
        close = [
            dotted[: -len(key)] + k for k in dict.fromkeys(near + sorted(o for o in options if o.startswith(f"{key}_")))
        ]
        keys = list(dict.fromkeys(close + sorted(elsewhere, key=lambda k: (k.count("."), k))))
        return f" (did you mean {' or '.join(repr(k) for k in keys)}?)"
    return _suggest(key, options)


def _build(cls, data: dict, prefix: str):
    if not isinstance(data, dict):
        raise ConfigError(f"config key {prefix.rstrip('.')!r} must be a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        dotted = prefix + key
        if key not in names:
            raise ConfigError(f"unknown config key {dotted!r}{suggest_key(dotted, names)}")
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
                f"unknown config key {prefix + key!r}{suggest_key(prefix + key, specs)} (no {group} kind declares it)"
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
        value = safe_yaml.load(raw, f"override {key}", safe_yaml.UniqueKeyLoader) if raw != "" else ""
    except yaml.YAMLError as e:
        if raw.lstrip()[:1] in ("[", "{"):  # a list or mapping left open: was the text '[a' and 'b', two entries
            raise ConfigError(f"override {text!r} is not valid YAML: {yaml_problem(e)}; quote a text value") from None
        value = raw  # text YAML cannot read as a scalar (a: b): the text itself
    return key.strip().split("."), value


def apply_overrides(tree: dict, overrides: list[str], notes: list | None = None) -> dict:
    """``a.b.c=value`` overrides into ``tree`` (in place); an old key name (:data:`RENAMED_KEYS`) is set
    under its new one and noted in ``notes``."""
    for ov in overrides:
        keys, value = parse_override(ov)
        new = renamed(keys)
        if new != keys and notes is not None:
            notes.append(f"{'.'.join(keys)} -> {'.'.join(new)}")
        keys = new
        node = tree
        for i, k in enumerate(keys[:-1]):
            node = node.setdefault(k, {})
            if isinstance(node, list):  # data.prefix.0=x: a list is given whole
                whole = ".".join(keys[: i + 1])
                raise ConfigError(f"override {ov!r}: {whole!r} is a list, set as a whole: {whole}=[A, B]")
            if not isinstance(node, dict):
                raise ConfigError(f"override {ov!r}: {k!r} is not a section")
        raw = ov.split("=", 1)[1].strip()
        if isinstance(value, str) and " #" in raw and raw[:1] not in "'\"" and field_type(keys) is str:
            value = raw  # train.save_dir=runs/exp #2: a shell word has no YAML comment (it was 'runs/exp')
        elif isinstance(value, (int, float)) and not isinstance(value, bool):  # the text typed, as the key reads it
            typ = field_type(keys)
            if typ is str:  # YAML 1.1 reads 0123 as octal 83, 12:30 as 750, 0.10 as 0.1: logging.run_name=12:30
                value = raw  # was '750', train.save_dir=0123 wrote to '83'
            elif typ is int and re.fullmatch(r"[-+]?0[0-9_]+", raw):  # train.steps=010: 10 (YAML 1.2, argparse),
                value = int(raw, 10)  # not YAML 1.1's octal 8
        if is_section(keys) and (value is None or isinstance(value, dict)):
            # a section given whole merges key by key, as a later --config file does (and Hydra's
            # `model={...}`); it used to replace the section, its YAML values silently back at their defaults
            if value is None:
                raise ConfigError(
                    f"override {ov!r}: {'.'.join(keys)!r} is a section, not a value; set its keys "
                    f"({'.'.join(keys)}.KEY=VALUE) or merge a mapping into it ({'.'.join(keys)}={{KEY: VALUE}})"
                )
            if isinstance(node.get(keys[-1]), dict):
                _deep_merge(node[keys[-1]], value, tuple(keys))
                continue
        node[keys[-1]] = value
    return tree


def load_config(path: str | os.PathLike | list | tuple | None = None, overrides: list[str] | None = None) -> Config:
    """YAML file(s) (with includes) + dotted overrides -> validated :class:`Config`.

    Several files merge left to right (later files win, mappings merged key by key), as
    ``--config A --config B`` does.

    ``model.size: NAME`` in a YAML merges ``configs/model/NAME.yaml`` under the model keys the YAML files
    give; the override ``model.size=NAME`` merges it over them (the command line is the later word: it was
    silently beaten by the YAML's model keys, ``--config configs/quickstart.yaml model.size=500m`` the tiny
    model), under the other overrides.
    """
    tree: dict = {}
    notes: list = []  # old key names used (RENAMED_KEYS): one warning line
    for p in [p for p in ([path] if isinstance(path, (str, os.PathLike)) else list(path or [])) if p]:
        _deep_merge(tree, _load_yaml_tree(find_config(p), notes=notes))
    overrides = list(overrides or [])
    tree = _with_size(tree, under=True)  # the YAML's own model.size
    given = apply_overrides({}, overrides).get("model")
    size_override = given.get("size") if isinstance(given, dict) else None
    if size_override:
        _deep_merge(tree, _size_tree(size_override))
    tree = apply_overrides(tree, overrides, notes)
    tree = _with_size(tree, under=size_override is None)
    cfg = _build(Config, tree, "")
    validate(cfg)
    _warn_renamed(notes)
    return cfg


def _size_tree(size) -> dict:
    """The tree of ``configs/model/SIZE.yaml`` (``model.size``); an unknown size is one line naming the closest."""
    size_file = CONFIG_ROOT / "model" / f"{size}.yaml"
    if not size_file.is_file():
        names = [p.stem for p in (CONFIG_ROOT / "model").glob("*.yaml")]
        raise ConfigError(f"unknown model size {size!r}{_suggest(str(size), names)}")
    return _load_yaml_tree(size_file)


def _with_size(tree: dict, under: bool) -> dict:
    """``tree`` without its ``model.size`` key; that size's keys merged under the tree's model keys (``under``),
    or dropped (an override's size, merged over the YAML already)."""
    model = tree.get("model") or {}
    if not isinstance(model, dict):  # before its size key is read (_build would say the same, later)
        raise ConfigError(f"config key 'model' must be a mapping, got {model!r}")
    size = model.pop("size", None)
    return _deep_merge(_size_tree(size), tree) if size and under else tree


def _check_special_ids(ids) -> None:
    """``data.special_ids``: {role: token id >= 0 or null} over the tokenizer roles (megahash.tokenization.ROLES);
    a scalar or an unknown role was a TypeError traceback, or a role silently unused, at the data build."""
    from megahash.tokenization import ROLES

    if not isinstance(ids, dict):
        raise ConfigError(f"data.special_ids must be a mapping role: id over {', '.join(ROLES)}, got {ids!r}")
    for role, i in ids.items():
        if role not in ROLES:
            raise ConfigError(f"unknown config key 'data.special_ids.{role}'{_suggest(str(role), ROLES)}")
        if i is not None and (isinstance(i, bool) or not isinstance(i, int) or i < 0):
            raise ConfigError(f"config key 'data.special_ids.{role}' must be a token id >= 0 or null, got {i!r}")


def _closest(value: str, options) -> str:
    """`` (did you mean 'x'?)`` for a close option, else nothing (the line lists them already)."""
    close = difflib.get_close_matches(str(value).lower(), list(options), n=1, cutoff=0.5)
    return f" (did you mean {close[0]!r}?)" if close else ""


def validate(cfg: Config) -> None:
    """Cross-field checks that do not need the model or the data (one-line errors)."""
    from megahash.config_checks import check_ranges
    from megahash.models.arch import ARCHS, arch_of
    from megahash.objective_spec import objective_spec

    check_ranges(cfg)  # every field inside its range and choices first (megahash/config_checks.py)
    m, p = cfg.model, cfg.parallel
    if m.arch not in ARCHS:
        raise ConfigError(f"model.arch must be {' or '.join(ARCHS)}, got {m.arch!r}{_closest(m.arch, ARCHS)}")
    if m.layout == "roberta" and arch_of(m.arch).causal:
        raise ConfigError("model.layout=roberta is an encoder layout; set model.arch=encoder or model.layout=prenorm")
    if m.hidden_size % m.num_heads:
        raise ConfigError(f"model.hidden_size={m.hidden_size} is not divisible by model.num_heads={m.num_heads}")
    _check_special_ids(cfg.data.special_ids)
    head_dim = m.hidden_size // m.num_heads
    if m.layout == "prenorm" and head_dim % 2:  # RoPE rotates channel pairs ([Su21] eq. 34)
        raise ConfigError(
            f"model.hidden_size={m.hidden_size} / model.num_heads={m.num_heads} gives an odd head size {head_dim}; "
            "RoPE needs an even one: choose a hidden size that is an even multiple of the heads"
        )
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


def save_config(cfg: Config, path: str | os.PathLike) -> None:
    """Atomically write the resolved tree as YAML."""
    from megahash.atomic_write import write_text_atomic

    write_text_atomic(path, cfg.to_yaml())


# keys an earlier release wrote into resolved_config.yaml that no longer exist (key path: the release that dropped
# it); a checkpoint's saved tree drops them, so evaluation and export read checkpoints of that release. A YAML a
# user writes gets the unknown-key error for them as for any other key.
RETIRED_KEYS = {("train", "eval_iters"): "0.1.0 (issue 38: never read)"}

# keys of an earlier release that live elsewhere now (issue 46: the training features own their sections of
# ``train``): old path -> new path. A config file or override with an old key still loads, with one warning line
# naming the new keys; a saved tree (a checkpoint's resolved_config.yaml, an export's megahash_config) is
# read through the same table without one.
RENAMED_KEYS = {
    ("train", "ema_decay"): ("train", "ema", "decay"),
    ("train", "ema_warmup"): ("train", "ema", "warmup"),
    ("train", "qat_bits"): ("train", "qat", "bits"),
    ("train", "qat_fraction"): ("train", "qat", "fraction"),
    ("train", "muon_lr"): ("train", "muon", "lr"),
    ("train", "muon_momentum"): ("train", "muon", "momentum"),
    ("train", "muon_nesterov"): ("train", "muon", "nesterov"),
    ("train", "muon_ns_steps"): ("train", "muon", "ns_steps"),
    ("train", "muon_adjust_lr"): ("train", "muon", "adjust_lr"),
    ("train", "skip_nonfinite"): ("train", "step_guard", "skip_nonfinite"),
    ("train", "spike_factor"): ("train", "step_guard", "spike_factor"),
    ("train", "spike_window"): ("train", "step_guard", "spike_window"),
    ("train", "max_skips"): ("train", "step_guard", "max_skips"),
    ("train", "hang_timeout_s"): ("train", "watchdog", "timeout_s"),
    ("train", "hang_factor"): ("train", "watchdog", "factor"),
}


def renamed(keys: list[str]) -> list[str]:
    """A dotted key path under its current name (:data:`RENAMED_KEYS`; unchanged when it is current)."""
    for n in range(len(keys), 0, -1):
        new = RENAMED_KEYS.get(tuple(keys[:n]))
        if new is not None:
            return [*new, *keys[n:]]
    return keys


def migrate(tree: dict, where: str = "", notes: list | None = None) -> dict:
    """A config tree with the keys of :data:`RENAMED_KEYS` moved to their new names (in place; returns it);
    each move appended to ``notes`` as ``old -> new``. An old key beside its new name is one line."""
    for old, new in RENAMED_KEYS.items():
        node = tree
        for key in old[:-1]:
            node = node.get(key) if isinstance(node, dict) else None
        if not isinstance(node, dict) or old[-1] not in node:
            continue
        value, dest = node.pop(old[-1]), tree
        for key in new[:-1]:
            dest = dest.setdefault(key, {})
            if not isinstance(dest, dict):
                raise ConfigError(f"config key {'.'.join(new[:-1])!r} must be a mapping, got {dest!r}")
        if new[-1] in dest:
            raise ConfigError(
                f"{where or 'the config'} gives both {'.'.join(old)!r} and its new name {'.'.join(new)!r}; "
                f"keep {'.'.join(new)!r}"
            )
        dest[new[-1]] = value
        if notes is not None:
            notes.append(f"{'.'.join(old)} -> {'.'.join(new)}")
    return tree


def _warn_renamed(notes: list) -> None:
    """One warning line (rank 0) for the old key names a config used."""
    if notes and os.environ.get("RANK", "0") == "0":
        import sys

        print(
            f"warning: config keys renamed (issue 46), read under their new names: {', '.join(dict.fromkeys(notes))}; "
            "write the new names",
            file=sys.stderr,
            flush=True,
        )


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
    """A saved tree (a checkpoint's resolved config, an export's) as a :class:`Config`: keys of an earlier
    release dropped (:data:`RETIRED_KEYS`) or read under their new names (:data:`RENAMED_KEYS`)."""
    import copy

    return _build(Config, migrate(without_retired(copy.deepcopy(tree))), "")
