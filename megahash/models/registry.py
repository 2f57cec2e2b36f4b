"""Name -> ModuleSpec registry, and the per-layer block spec built from a schedule.

Every attention kind is a function ``cfg -> ModuleSpec`` for the ``self_attention`` slot of a
megatron-core ``TransformerLayer``; every embedding kind and head is a module class. A new variant is one
file (its ``register_*`` line with its costs and capabilities, :mod:`megahash.models.declarations`);
plugins outside the package are discovered from ``MEGAHASH_PLUGINS``, ``model.plugins`` and the
``megahash.kinds`` entry-point group. ``block_spec`` turns ``model.schedule`` into
``TransformerBlockSubmodules(layer_specs=[...])`` so layers may differ in attention kind.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

from megahash.errors import ConfigError, did_you_mean
from megahash.models import declarations
from megahash.models.declarations import AttentionCaps, EmbeddingCaps, HeadCaps, InputCaps  # noqa: F401 - the kind files import them from here
from megahash.models.norm import Norm
from megahash.models.arch import arch_of
from megahash.models.schedules import layer_kinds, skip_mask, standard_kind


def mask_type(cfg) -> AttnMaskType:
    """Causal for decoders, padding (bidirectional) for encoders."""
    return AttnMaskType.causal if arch_of(cfg.model.arch).causal else AttnMaskType.padding


@dataclass
class KindSpec:
    """Everything about one kind, declared by the register line of its own file: what builds it, what it
    can do, what it costs, its options and the hooks the rest of the library calls. Nothing outside the
    kind's file names the kind; the library asks :func:`spec`."""

    name: str
    group: str  # attention | embedding | head | input
    build: Callable  # attention: cfg -> ModuleSpec of the self_attention slot; embedding / head: module class;
    # input: build(model, cfg) -> KindInput | None
    caps: object  # AttentionCaps | EmbeddingCaps | HeadCaps (megahash.models.declarations)
    costs: type | None = None  # static formulas (megahash.models.costs), None: "measured only"
    options: type | None = None  # options dataclass (model.attention.options / model.embed.options)
    maps: Callable | None = None  # the indicators' attention-map capture (megahash.eval.indicators)
    export: Callable | None = None  # attention: export_spec(module) -> dict; embedding: export_meta(emb, cfg) -> dict
    model_input: Callable | None = None  # build(model, cfg) -> KindInput | None (megahash.models.kind_input)


# group -> name -> KindSpec: the registry itself
KINDS: dict[str, dict[str, KindSpec]] = {"attention": {}, "embedding": {}, "head": {}, "input": {}}


def spec(group: str, name: str) -> KindSpec:
    """The :class:`KindSpec` of a registered kind (the kind files loaded first if it is not yet known)."""
    if name not in KINDS[group]:
        _load_variants()
    try:
        return KINDS[group][name]
    except KeyError:
        raise ConfigError(f"unknown {group} kind {name!r}{did_you_mean(name, KINDS[group])}") from None


def names(group: str) -> list[str]:
    """Registered kinds of a group, sorted (every kind file loaded first)."""
    _load_variants()
    return sorted(KINDS[group])


# By-name views of KINDS (filled by the same register lines; tests and plugins read them)
ATTENTION: dict[str, Callable] = {}
EMBEDDINGS: dict[str, type] = {}
HEADS: dict[str, type] = {}
INPUTS: dict[str, Callable] = {}  # model inputs registered on their own: name -> build(model, cfg)
COSTS: dict[str, type] = {}
CAPS: dict[str, dict] = {"attention": {}, "embedding": {}, "head": {}, "input": {}}
EXPORT_SPEC: dict[str, Callable | None] = {}
EXPORT_META: dict[str, Callable | None] = {}
MAPS: dict[str, Callable] = {}
OPTIONS: dict[str, type] = {}
MODEL_INPUTS: dict[str, Callable] = {}


def _add(kind: KindSpec) -> None:
    KINDS[kind.group][kind.name] = kind


def register_costs(name: str):
    def deco(obj):
        COSTS[name] = obj
        if name in KINDS["attention"]:
            KINDS["attention"][name].costs = obj
        return obj
    return deco


def _check_caps(group: str, name: str, caps):
    want = declarations.CAPS[group]
    if caps is None:
        return want()
    if not isinstance(caps, want):
        raise TypeError(f"register of {group} kind {name!r}: caps must be a {want.__name__}, got {type(caps).__name__}")
    return caps


def register_attention(name: str, costs=None, caps=None, maps=None, export_spec=None, options=None, model_input=None):
    """Register an attention kind: ``fn(cfg) -> ModuleSpec`` of the self_attention slot.

    ``costs``: a class of static formulas (Table 3.4 ``qkv_params``, Table 4.5-4.8 ``time_complexity``,
    ``flops``, ``activation_bytes``, ``cache_bytes``, the implementation's ``cache_elements``; see
    megahash.models.costs), or None: "measured only". ``caps``: an :class:`AttentionCaps` of literals.
    ``maps``: the indicators' attention-map capture (megahash.eval.indicators). ``export_spec(module)
    -> dict``: what the Hugging Face export needs of a layer beyond kind and groups. ``options``: the
    kind's options dataclass (``model.attention.options.*``; torch-free, literals only). ``model_input``:
    ``build(model, cfg) -> KindInput | None`` (megahash.models.kind_input)."""
    def deco(fn):
        _add(KindSpec(name, "attention", fn, _check_caps("attention", name, caps), costs, options, maps,
                      export_spec, model_input))
        ATTENTION[name] = fn
        if options is not None:
            OPTIONS[name] = options
        if model_input is not None:
            MODEL_INPUTS[name] = model_input
        EXPORT_SPEC[name] = export_spec
        CAPS["attention"][name] = KINDS["attention"][name].caps
        if costs is not None:
            COSTS[name] = costs
        if maps is not None:
            MAPS[name] = maps
        return fn
    return deco


def register_embedding(name: str, caps=None, export_meta=None, options=None):
    """Register an embedding kind (a module class ``(config, cfg, vocab_size)``) and its
    :class:`EmbeddingCaps`; ``export_meta(emb, cfg) -> dict``: what the Hugging Face export needs
    beyond the sizes; ``options``: its options dataclass (``model.embed.options.*``)."""
    def deco(cls):
        _add(KindSpec(name, "embedding", cls, _check_caps("embedding", name, caps), options=options, export=export_meta))
        EMBEDDINGS[name] = cls
        if options is not None:
            OPTIONS[name] = options
        CAPS["embedding"][name] = KINDS["embedding"][name].caps
        EXPORT_META[name] = export_meta
        return cls
    return deco


def register_head(name: str, caps=None):
    """Register an output head (a module class ``(config, cfg, vocab_size)``, ``model.head``) and its
    :class:`HeadCaps`."""
    def deco(cls):
        _add(KindSpec(name, "head", cls, _check_caps("head", name, caps)))
        HEADS[name] = cls
        CAPS["head"][name] = KINDS["head"][name].caps
        return cls
    return deco


def register_input(name: str, caps=None, options=None, costs=None):
    """Register a model input of its own (not an attention kind's): ``build(model, cfg) -> KindInput | None``
    (None: off in this config), built for every model, e.g. a table added to the input embedding whatever
    the embedding kind. ``caps``: an :class:`InputCaps` (its options live in ``model.<section>.options``);
    ``costs``: a class whose ``params(cfg) -> {label: n}`` counts it in closed form (``megahash params``)."""
    def deco(fn):
        _add(KindSpec(name, "input", fn, _check_caps("input", name, caps), costs, options, model_input=fn))
        INPUTS[name] = fn
        if options is not None:
            OPTIONS[name] = options
        CAPS["input"][name] = KINDS["input"][name].caps
        return fn
    return deco


def mlp_spec() -> type:
    """SwiGLU MLP (gated_linear_unit + SiLU in the TransformerConfig), TP-split: the class itself
    (its submodules are its defaults), since megatron's TransformerLayer logs "Unknown MLP type" for
    a ModuleSpec of any MLP subclass and then builds it with the default kwargs anyway."""
    from megahash.models.feedforward import FeedForward

    return FeedForward


class SkippedLayer(TransformerLayer):
    """`skip` evaluation mode ([Xue25] sec. 4.5, Table 4.1 "HYBRID SKIP"): the whole layer (attention
    and MLP) is an identity, so information flows only through the residual stream. Its parameters
    are still built, so a hybrid checkpoint loads unchanged, and frozen: they never get a gradient,
    so no optimizer holds or touches them (no weight decay under ZeRO) and checkpoints keep them as built."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        for p in self.parameters():
            p.requires_grad_(False)

    def forward(self, hidden_states=None, *args, context=None, **kwargs):
        return hidden_states, context


def layer_spec(cfg, kind: str, skip: bool = False) -> ModuleSpec:
    from megahash.models.roberta import PostNormLayer  # model.layout=roberta: post-LN layers

    layer = PostNormLayer if cfg.model.layout == "roberta" else TransformerLayer
    return ModuleSpec(
        module=SkippedLayer if skip else layer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=Norm,
            self_attention=spec("attention", kind).build(cfg),
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=Norm,
            mlp=mlp_spec(),
            mlp_bda=get_bias_dropout_add,
        ),
    )


def schedule_kinds(cfg) -> list[str]:
    declarations.add_plugins(getattr(cfg.model, "plugins", None))
    _load_variants()
    return layer_kinds(cfg.model.schedule, cfg.model.num_layers, set(ATTENTION))


def skipped_layers(cfg, kinds: list[str] | None = None) -> list[bool]:
    """Per layer: dropped by ``model.attention.skip_nonstandard`` (every non-standard layer)."""
    kinds = kinds if kinds is not None else schedule_kinds(cfg)
    if not cfg.model.attention.skip_nonstandard:
        return [False] * len(kinds)
    return skip_mask(kinds, standard_kind(cfg.model.schedule))


def model_inputs(kinds) -> list:
    """The distinct ``model_input`` hooks of the given layer kinds, in layer order, then those of the inputs
    registered on their own (:func:`register_input`, by name)."""
    hooks = [spec("attention", k).model_input for k in kinds if spec("attention", k).model_input is not None]
    _load_variants()
    hooks += [KINDS["input"][n].model_input for n in sorted(KINDS["input"])]
    return [h for i, h in enumerate(hooks) if h not in hooks[:i]]


def block_spec(cfg) -> TransformerBlockSubmodules:
    """One ModuleSpec per layer from ``model.schedule``, plus the final norm."""
    kinds = schedule_kinds(cfg)
    skip = skipped_layers(cfg, kinds)
    return TransformerBlockSubmodules(
        layer_specs=[layer_spec(cfg, k, s) for k, s in zip(kinds, skip)],
        layer_norm=None if cfg.model.layout == "roberta" else Norm,  # post-LN layers end normalised
    )


KIND_PACKAGES = ("megahash.models.attention", "megahash.models.embeddings", "megahash.models.heads")


def _load_variants() -> None:
    """Import the variant modules so their ``register_*`` lines run (idempotent)."""
    import importlib
    import pkgutil

    plugins = tuple(declarations.plugin_modules())
    if plugins in _LOADED:
        return
    for name in KIND_PACKAGES:  # by name: the kinds import this module, never the reverse
        pkg = importlib.import_module(name)
        for info in pkgutil.iter_modules(pkg.__path__):
            importlib.import_module(f"{name}.{info.name}")
    for name in declarations.plugin_import_names():  # MEGAHASH_PLUGINS, model.plugins, entry points
        importlib.import_module(name)
    _LOADED.add(plugins)


_LOADED: set = set()  # plugin lists already loaded


# name -> the kind's plain-torch reference module (megatron-free, the parameter names of the HF
# export): the TP=1 reference of the parity tests and the kind's code in the HF remote-code folder
# (megahash.convert.remote_code). Heads register as ``head:NAME`` / ``objective:NAME``.
REFERENCES: dict[str, type] = {}


def register_reference(name: str):
    def deco(cls):
        REFERENCES[name] = cls
        return cls
    return deco
