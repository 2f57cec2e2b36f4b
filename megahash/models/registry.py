"""Name -> ModuleSpec registry, and the per-layer block spec built from a schedule.

Every attention kind is a class written once (:mod:`megahash.models.mixing`), whose megatron-core layer for
the ``self_attention`` slot of a ``TransformerLayer`` is derived from it (or a function ``cfg -> ModuleSpec``
of a module of its own); every embedding kind and head is a module class. A new variant is one
file (its ``register_*`` line with its costs and capabilities, :mod:`megahash.catalog`);
plugins outside the package are discovered from ``MEGAHASH_PLUGINS``, ``model.plugins`` and the
``megahash.kinds`` entry-point group. The registry is :data:`KINDS` ({group: {name: KindSpec}}) and
nothing else; :func:`kinds`, :func:`spec`, :func:`names`, :func:`reference` and :func:`references` are
views of it (each loads the kind files first: :func:`load_kinds`). ``block_spec`` turns
``model.schedule`` into ``TransformerBlockSubmodules(layer_specs=[...])`` so layers may differ in
attention kind.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from dataclasses import dataclass

from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

from megahash import catalog
from megahash.catalog import AttentionCaps, EmbeddingCaps, HeadCaps, InputCaps  # noqa: F401 - the kind files import them from here
from megahash.errors import ConfigError, did_you_mean
from megahash.models.arch import arch_of
from megahash.models.norm import Norm
from megahash.models.schedules import layer_kinds, skip_mask, standard_kind


def mask_type(cfg) -> AttnMaskType:
    """Causal for decoders, padding (bidirectional) for encoders."""
    return AttnMaskType.causal if arch_of(cfg.model.arch).causal else AttnMaskType.padding


@dataclass
class KindSpec:
    """Everything about one kind, declared by its own file: what builds it, what it can do, what it costs,
    its options, its plain-torch reference and the hooks the rest of the library calls. Nothing outside
    the kind's file names the kind; the library asks :func:`spec`."""

    name: str
    group: str  # attention | embedding | head | input
    build: Callable  # attention: cfg -> ModuleSpec of the self_attention slot; embedding / head: module class;
    # input: build(model, cfg) -> KindInput | None
    caps: object  # AttentionCaps | EmbeddingCaps | HeadCaps | InputCaps (megahash.catalog)
    costs: type | None = None  # static formulas (megahash.models.costs), None: "measured only"
    options: type | None = None  # options dataclass (model.attention.options / model.embed.options)
    maps: Callable | None = None  # maps(layer, record) -> hook handles: the indicators' capture of its attention
    # maps (megahash.models.attention.maps; called by megahash.eval.attention_capture)
    export: Callable | None = None  # attention: export_spec(module) -> dict; embedding: export_meta(emb, cfg) -> dict
    model_input: Callable | None = None  # build(model, cfg) -> KindInput | None (megahash.models.kind_input)
    reference: type | None = None  # attention: the kind written once (megahash.models.mixing); embedding,
    # head, input: the plain-torch reference (@register_reference); HF export, parity tests
    input_reference: type | None = None  # reference of its model input (``input:NAME``), attention kinds


# group -> name -> KindSpec: the registry itself
KINDS: dict[str, dict[str, KindSpec]] = {"attention": {}, "embedding": {}, "head": {}, "input": {}}


def kinds(group: str) -> dict[str, KindSpec]:
    """{name: KindSpec} of a group, every kind file loaded first."""
    load_kinds()
    return dict(KINDS[group])


def spec(group: str, name: str) -> KindSpec:
    """The :class:`KindSpec` of a registered kind (the kind files loaded first if it is not yet known)."""
    if name not in KINDS[group]:
        load_kinds()
    try:
        return KINDS[group][name]
    except KeyError:
        raise ConfigError(f"unknown {group} kind {name!r}{did_you_mean(name, KINDS[group])}") from None


def names(group: str) -> list[str]:
    """Registered kinds of a group, sorted (every kind file loaded first)."""
    load_kinds()
    return sorted(KINDS[group])


def unregister(group: str, name: str) -> None:
    """Forget a kind (tests and plugins: a module imported again registers it again)."""
    KINDS[group].pop(name, None)
    _LOADED.clear()


def _reference_keys(kind: KindSpec) -> dict[str, str]:
    """{key of ``@register_reference``: KindSpec field} a kind's own file may register: attention and
    embedding kinds by name, their model input as ``input:NAME``, heads (an objective's own head too) as
    ``head:NAME``."""
    if kind.group in ("head", "input"):
        return {f"{kind.group}:{kind.name}": "reference"}
    return {kind.name: "reference", "input:" + kind.name: "input_reference"}


def _attach_references(kind: KindSpec) -> None:
    """The ``@register_reference`` classes of the kind's own module (defined above its register line)."""
    module = sys.modules.get(getattr(kind.reference or kind.build, "__module__", None) or "")
    keys = _reference_keys(kind)
    for obj in list(vars(module).values()) if module is not None else ():
        for key in vars(obj).get(_REFERENCE_KEYS, ()) if isinstance(obj, type) else ():
            if key in keys and obj.__module__ == module.__name__:
                setattr(kind, keys[key], obj)


def _add(kind: KindSpec) -> None:
    _attach_references(kind)
    KINDS[kind.group][kind.name] = kind


def _check_caps(group: str, name: str, caps):
    want = catalog.CAPS[group]
    if caps is None:
        return want()
    if not isinstance(caps, want):
        raise TypeError(f"register of {group} kind {name!r}: caps must be a {want.__name__}, got {type(caps).__name__}")
    return caps


def register_attention(
    name: str,
    kind: type | None = None,
    costs=None,
    caps=None,
    maps=None,
    export_spec=None,
    options=None,
    model_input=None,
    groups=None,
):
    """Register an attention kind: ``register_attention(name, Kind, ...)`` with ``Kind`` a
    :class:`megahash.models.mixing.Mixing` written once (its megatron-core layer and its plain-torch layer,
    the HF export's, are derived from it); or, as a decorator, ``fn(cfg) -> ModuleSpec`` of the
    self_attention slot (a module of its own, e.g. megatron-core's; no export).

    ``costs``: a class of static formulas (Table 3.4 ``qkv_params``, Table 4.5-4.8 ``time_complexity``,
    ``flops``, ``activation_bytes``, ``cache_bytes``, the implementation's ``cache_elements``; see
    megahash.models.costs), or None: "measured only". ``caps``: an :class:`AttentionCaps`.
    ``maps(layer, record) -> handles``: how ``megahash indicators`` captures the kind's attention maps (the
    families' hooks: megahash.models.attention.maps; None: "unavailable"). ``export_spec(module)
    -> dict``: what the Hugging Face export needs of a layer beyond kind and groups. ``options``: the
    kind's options dataclass (``model.attention.options.*``). Costs, options and caps are read without
    torch too (:mod:`megahash.catalog`): they use no torch. ``model_input``:
    ``build(model, cfg) -> KindInput | None`` (megahash.models.kind_input). ``groups(n, g)``: the layer's
    key/value groups for n heads under ``model.num_query_groups`` g (default: g, or n when 0)."""

    def deco(fn):
        build, reference = fn, None
        if isinstance(fn, type):  # a kind written once: its megatron layer is derived
            build, reference = functools.partial(_layer_spec, name, fn, groups), fn
        _add(
            KindSpec(
                name,
                "attention",
                build,
                _check_caps("attention", name, caps),
                costs,
                options,
                maps,
                export_spec,
                model_input,
                reference,
            )
        )
        return fn

    return deco if kind is None else deco(kind)


def _layer_spec(name: str, kind: type, groups, cfg) -> ModuleSpec:
    """The ``self_attention`` ModuleSpec of a kind written once: its derived megatron-core layer."""
    import importlib

    layer = importlib.import_module("megahash.models.attention.base").megatron_layer  # by name: the kinds import this
    params = {"attn_mask_type": mask_type(cfg), "cfg": cfg, "kind": name}
    if groups is not None:
        params["groups"] = groups(cfg.model.num_heads, cfg.model.num_query_groups)
    return ModuleSpec(module=layer(kind), params=params)


def register_embedding(name: str, caps=None, export_meta=None, options=None):
    """Register an embedding kind (a module class ``(config, cfg, vocab_size)``) and its
    :class:`EmbeddingCaps`; ``export_meta(emb, cfg) -> dict``: what the Hugging Face export needs
    beyond the sizes; ``options``: its options dataclass (``model.embed.options.*``)."""

    def deco(cls):
        _add(
            KindSpec(name, "embedding", cls, _check_caps("embedding", name, caps), options=options, export=export_meta)
        )
        return cls

    return deco


def register_head(name: str, caps=None):
    """Register an output head (a module class ``(config, cfg, vocab_size)``, ``model.head``) and its
    :class:`HeadCaps`."""

    def deco(cls):
        _add(KindSpec(name, "head", cls, _check_caps("head", name, caps)))
        return cls

    return deco


def register_input(name: str, caps=None, options=None, costs=None):
    """Register a model input of its own (not an attention kind's): ``build(model, cfg) -> KindInput | None``
    (None: off in this config), built for every model, e.g. a table added to the input embedding whatever
    the embedding kind. ``caps``: an :class:`InputCaps` (its options live in ``model.<section>.options``);
    ``costs``: a class whose ``params(cfg) -> {label: n}`` counts it in closed form (``megahash params``)."""

    def deco(fn):
        _add(KindSpec(name, "input", fn, _check_caps("input", name, caps), costs, options, model_input=fn))
        return fn

    return deco


_REFERENCE_KEYS = "megahash_reference_keys"  # class attribute @register_reference sets


def register_reference(key: str):
    """Mark a class of a kind's file as the kind's plain-torch reference (megatron-free, the parameter
    names of the HF export; the TP=1 reference of the parity tests, copied into the HF remote-code folder
    by megahash.convert.remote_code). The kind's register line, below it in the same file, puts it in the
    kind's :class:`KindSpec` (keys: :func:`_reference_keys`)."""

    def deco(cls):
        setattr(cls, _REFERENCE_KEYS, vars(cls).get(_REFERENCE_KEYS, ()) + (key,))
        return cls

    return deco


def references() -> dict[str, type]:
    """{reference key: class} of every registered kind (``NAME``, ``input:NAME``, ``head:NAME``):
    the table the plain-torch model (megahash.models.reference_layers) builds from."""
    load_kinds()
    return {
        key: getattr(kind, field)
        for specs in KINDS.values()
        for _, kind in sorted(specs.items())
        for key, field in _reference_keys(kind).items()
        if getattr(kind, field) is not None
    }


def reference(key: str) -> type | None:
    """The plain-torch reference registered under ``key`` (see :func:`references`), or None."""
    return references().get(key)


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
    catalog.add_plugins(getattr(cfg.model, "plugins", None))
    load_kinds()
    return layer_kinds(cfg.model.schedule, cfg.model.num_layers, set(KINDS["attention"]))


def skipped_layers(cfg, kinds: list[str] | None = None) -> list[bool]:
    """Per layer: dropped by ``model.attention.skip_nonstandard`` (every non-standard layer)."""
    kinds = kinds if kinds is not None else schedule_kinds(cfg)
    if not cfg.model.attention.skip_nonstandard:
        return [False] * len(kinds)
    return skip_mask(kinds, standard_kind(cfg.model.schedule))


def model_inputs(layers) -> list:
    """The distinct ``model_input`` hooks of the given layer kinds, in layer order, then those of the inputs
    registered on their own (:func:`register_input`, by name)."""
    hooks = [spec("attention", k).model_input for k in layers if spec("attention", k).model_input is not None]
    hooks += [s.model_input for _, s in sorted(kinds("input").items())]
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


def load_kinds() -> None:
    """Import the kind modules (the library's and the plugins') so their ``register_*`` lines run
    (idempotent; every view of the registry calls it)."""
    import importlib
    import pkgutil

    plugins = tuple(catalog.plugin_modules())
    if plugins in _LOADED:
        return
    for name in KIND_PACKAGES:  # by name: the kinds import this module, never the reverse
        pkg = importlib.import_module(name)
        for info in pkgutil.iter_modules(pkg.__path__):
            importlib.import_module(f"{name}.{info.name}")
    for name in catalog.plugin_import_names():  # MEGAHASH_PLUGINS, model.plugins, entry points
        importlib.import_module(name)
    _LOADED.add(plugins)


_LOADED: set = set()  # plugin lists already loaded
