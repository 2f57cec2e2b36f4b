"""Name -> ModuleSpec registry, and the per-layer block spec built from a schedule.

Every attention kind is a function ``cfg -> ModuleSpec`` for the ``self_attention`` slot of a
megatron-core ``TransformerLayer``; every embedding kind and head is a module class. A new variant is one
file (its ``register_*`` line with its costs and capabilities, :mod:`megahash.models.catalog`);
plugins outside the package are discovered from ``MEGAHASH_PLUGINS``, ``model.plugins`` and the
``megahash.kinds`` entry-point group. ``block_spec`` turns ``model.schedule`` into
``TransformerBlockSubmodules(layer_specs=[...])`` so layers may differ in attention kind.
"""
from __future__ import annotations

from typing import Callable

from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

from megahash.models import catalog
from megahash.models.attention.sdpa import SDPACoreAttention
from megahash.models.catalog import AttentionCaps, EmbeddingCaps, HeadCaps  # noqa: F401 - the kind files import them from here
from megahash.models.norm import HeadNorm, Norm
from megahash.models.schedules import layer_kinds, skip_mask, standard_kind


def mask_type(cfg) -> AttnMaskType:
    """Causal for decoders, padding (bidirectional) for encoders."""
    return AttnMaskType.causal if cfg.model.arch == "decoder" else AttnMaskType.padding


# name -> (cfg -> ModuleSpec of the self_attention slot); the kinds register from models/attention/
ATTENTION: dict[str, Callable] = {}

# name -> embedding module class (constructor(config, cfg, vocab_size))
EMBEDDINGS: dict[str, type] = {}

# name -> head module class (constructor(config, cfg, vocab_size)); the heads register from models/heads/
HEADS: dict[str, type] = {}

# name -> the kind's own cost formulas as implemented (a class of static methods such as
# ``cache_elements(B, L, n, d_h, g)``; megahash.models.costs asks it, "n/a" when a kind has none)
COSTS: dict[str, type] = {}

# group -> name -> capability record (megahash.models.catalog: AttentionCaps, EmbeddingCaps, HeadCaps)
CAPS: dict[str, dict] = {"attention": {}, "embedding": {}, "head": {}}

# name -> what the Hugging Face export needs of a layer / an embedding (megahash.convert.export asks)
EXPORT_SPEC: dict[str, Callable | None] = {}
EXPORT_META: dict[str, Callable | None] = {}

# name -> the kind's attention-map capture for the indicators (megahash.eval.indicators asks it)
MAPS: dict[str, Callable] = {}


def register_costs(name: str):
    def deco(obj):
        COSTS[name] = obj
        return obj
    return deco


def _check_caps(group: str, name: str, caps):
    want = catalog.CAPS[group]
    if caps is None:
        return want()
    if not isinstance(caps, want):
        raise TypeError(f"register of {group} kind {name!r}: caps must be a {want.__name__}, got {type(caps).__name__}")
    return caps


def register_attention(name: str, costs=None, caps=None, maps=None, export_spec=None):
    """Register an attention kind: ``fn(cfg) -> ModuleSpec`` of the self_attention slot.

    ``costs``: a class of static formulas (Table 3.4 ``qkv_params``, Table 4.5-4.8 ``time_complexity``,
    ``flops``, ``activation_bytes``, ``cache_bytes``, the implementation's ``cache_elements``; see
    megahash.models.costs), or None: "measured only". ``caps``: an :class:`AttentionCaps` of literals.
    ``maps``: the indicators' attention-map capture (megahash.eval.indicators). ``export_spec(module)
    -> dict``: what the Hugging Face export needs of a layer beyond kind and groups."""
    def deco(fn):
        ATTENTION[name] = fn
        EXPORT_SPEC[name] = export_spec
        CAPS["attention"][name] = _check_caps("attention", name, caps)
        if costs is not None:
            COSTS[name] = costs
        if maps is not None:
            MAPS[name] = maps
        return fn
    return deco


def register_embedding(name: str, caps=None, export_meta=None):
    """Register an embedding kind (a module class ``(config, cfg, vocab_size)``) and its
    :class:`EmbeddingCaps`; ``export_meta(emb, cfg) -> dict``: what the Hugging Face export needs
    beyond the sizes."""
    def deco(cls):
        EMBEDDINGS[name] = cls
        CAPS["embedding"][name] = _check_caps("embedding", name, caps)
        EXPORT_META[name] = export_meta
        return cls
    return deco


def register_head(name: str, caps=None):
    """Register an output head (a module class ``(config, cfg, vocab_size)``, ``model.head``) and its
    :class:`HeadCaps`."""
    def deco(cls):
        HEADS[name] = cls
        CAPS["head"][name] = _check_caps("head", name, caps)
        return cls
    return deco


@register_attention("mha-megatron", costs=None, caps=AttentionCaps(decodes=False, exportable=False))
def _standard_attention(cfg) -> ModuleSpec:
    """megatron-core's own ``SelfAttention`` with the SDPA core.

    Reference only (tests compare megahash's standard attention against it): it has no ``decode_cache``
    support, so incremental decoding with it is not available; no cost model ("measured only",
    and its module has no ``mix`` to measure: "n/a")."""
    return ModuleSpec(
        module=SelfAttention,
        params={"attn_mask_type": mask_type(cfg)},
        submodules=SelfAttentionSubmodules(
            linear_qkv=ColumnParallelLinear,
            core_attention=SDPACoreAttention,
            linear_proj=RowParallelLinear,
            q_layernorm=HeadNorm if cfg.model.qk_norm else IdentityOp,
            k_layernorm=HeadNorm if cfg.model.qk_norm else IdentityOp,
        ),
    )


def mlp_spec() -> type:
    """SwiGLU MLP (gated_linear_unit + SiLU in the TransformerConfig), TP-split: the class itself
    (its submodules are its defaults), since megatron's TransformerLayer logs "Unknown MLP type" for
    a ModuleSpec of any MLP subclass and then builds it with the default kwargs anyway."""
    from megahash.models.feedforward import FeedForward

    return FeedForward


class SkippedLayer(TransformerLayer):
    """`skip` evaluation mode (thesis sec. 4.5, Table 4.1 "HYBRID SKIP"): the whole layer (attention
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
            self_attention=ATTENTION[kind](cfg),
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=Norm,
            mlp=mlp_spec(),
            mlp_bda=get_bias_dropout_add,
        ),
    )


def schedule_kinds(cfg) -> list[str]:
    catalog.add_plugins(getattr(cfg.model, "plugins", None))
    _load_variants()
    return layer_kinds(cfg.model.schedule, cfg.model.num_layers, set(ATTENTION))


def skipped_layers(cfg, kinds: list[str] | None = None) -> list[bool]:
    """Per layer: dropped by ``model.attention.skip_nonstandard`` (every non-standard layer)."""
    kinds = kinds if kinds is not None else schedule_kinds(cfg)
    if not cfg.model.attention.skip_nonstandard:
        return [False] * len(kinds)
    return skip_mask(kinds, standard_kind(cfg.model.schedule))


def block_spec(cfg) -> TransformerBlockSubmodules:
    """One ModuleSpec per layer from ``model.schedule``, plus the final norm."""
    kinds = schedule_kinds(cfg)
    skip = skipped_layers(cfg, kinds)
    return TransformerBlockSubmodules(
        layer_specs=[layer_spec(cfg, k, s) for k, s in zip(kinds, skip)],
        layer_norm=None if cfg.model.layout == "roberta" else Norm,  # post-LN layers end normalised
    )


def _load_variants() -> None:
    """Import the variant modules so their ``register_*`` lines run (idempotent)."""
    import importlib
    import pkgutil

    import megahash.models.attention as att_pkg
    import megahash.models.embeddings as emb_pkg
    import megahash.models.heads as head_pkg

    for pkg in (att_pkg, emb_pkg, head_pkg):
        for info in pkgutil.iter_modules(pkg.__path__):
            importlib.import_module(f"{pkg.__name__}.{info.name}")
    for name in catalog.plugin_import_names():  # MEGAHASH_PLUGINS, model.plugins, entry points
        importlib.import_module(name)


# name -> the kind's plain-torch reference module (megatron-free, the parameter names of the HF
# export): the TP=1 reference of the parity tests and the kind's code in the HF remote-code folder
# (megahash.convert.remote_code). Heads register as ``head:NAME`` / ``objective:NAME``.
REFERENCES: dict[str, type] = {}


def register_reference(name: str):
    def deco(cls):
        REFERENCES[name] = cls
        return cls
    return deco
