"""Name -> ModuleSpec registry, and the per-layer block spec built from a schedule.

Every attention kind is a function ``cfg -> ModuleSpec`` for the ``self_attention`` slot of a
megatron-core ``TransformerLayer``; every embedding kind is a module class. A new variant is one
file plus one line here. ``block_spec`` turns ``model.schedule`` into
``TransformerBlockSubmodules(layer_specs=[...])`` so layers may differ in attention kind.
"""
from __future__ import annotations

from typing import Callable

from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

from megahash.models.attention.sdpa import SDPACoreAttention
from megahash.models.norm import HeadNorm, Norm
from megahash.models.schedules import layer_kinds, skip_mask, standard_kind


def mask_type(cfg) -> AttnMaskType:
    """Causal for decoders, padding (bidirectional) for encoders."""
    return AttnMaskType.causal if cfg.model.arch == "decoder" else AttnMaskType.padding


def _standard_attention(cfg) -> ModuleSpec:
    """megatron-core's own ``SelfAttention`` with the SDPA core (kind ``mha-megatron``).

    Reference only (tests compare megahash's ``mha`` against it): it has no ``decode_cache``
    support, so incremental decoding with it is not available."""
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


# name -> (cfg -> ModuleSpec of the self_attention slot)
ATTENTION: dict[str, Callable] = {
    "mha-megatron": _standard_attention,  # the megahash kinds (mha, sha, ...) register from models/attention/
}

# name -> embedding module class (constructor(config, cfg, vocab_size))
EMBEDDINGS: dict[str, type] = {}


# name -> the kind's own cost formulas as implemented (a class with static methods such as
# ``cache_elements(B, L, n, d_h, g)``; megahash.models.costs asks it, "n/a" when a kind has none)
COSTS: dict[str, type] = {}


def register_costs(name: str):
    def deco(obj):
        COSTS[name] = obj
        return obj
    return deco


def register_attention(name: str):
    def deco(fn):
        ATTENTION[name] = fn
        return fn
    return deco


def register_embedding(name: str):
    def deco(cls):
        EMBEDDINGS[name] = cls
        return cls
    return deco


def mlp_spec() -> ModuleSpec:
    """SwiGLU MLP (gated_linear_unit + SiLU in the TransformerConfig), TP-split."""
    return ModuleSpec(module=MLP, submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear))


class SkippedLayer(TransformerLayer):
    """`skip` evaluation mode (thesis sec. 4.5, Table 4.1 "HYBRID SKIP"): the whole layer (attention
    and MLP) is an identity, so information flows only through the residual stream. Its parameters
    are still built, so a hybrid checkpoint loads unchanged."""

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

    for pkg in (att_pkg, emb_pkg):
        for info in pkgutil.iter_modules(pkg.__path__):
            importlib.import_module(f"{pkg.__name__}.{info.name}")


# name -> the kind's plain-torch reference module (megatron-free, the parameter names of the HF
# export): the TP=1 reference of the parity tests and the kind's code in the HF remote-code folder
# (megahash.convert.remote_code). Heads register as ``head:NAME`` / ``objective:NAME``.
REFERENCES: dict[str, type] = {}


def register_reference(name: str):
    def deco(cls):
        REFERENCES[name] = cls
        return cls
    return deco
