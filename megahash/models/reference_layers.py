"""The generic plain-torch model shell around the kinds (no megatron-core).

Pre-norm layers (RMSNorm + SwiGLU for decoders, LayerNorm + GELU with biases for encoders; post-LN
with ``model.layout=roberta``), one attention kind per layer, its plain-torch layer derived from the kind
written once (:func:`torch_layer`, :mod:`megahash.models.mixing`; the table of kinds:
:func:`megahash.models.reference_table.references`), `skip` layers as identities, the special-token table of
hash embeddings and the kinds' embedding, head and input references. The layers run sequence-first
([s, b, h]) as megatron-core's do. Parameter names are megahash's TP=1 names, which are also those of the
Hugging Face export. ``megahash export-hf`` copies this file verbatim (imports rewritten to the folder's
relative ones); it imports torch, math, typing and the torch-only megahash modules only.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn
import torch.nn.functional as F

from megahash.models.arch import arch_of
from megahash.models.mixing import Setup
from megahash.models.reference_ops import (
    NUM_SPECIAL,
    PerHeadWeight,
    SoftmaxCore,
    is_roberta,
    make_norm,
    megahash_option,
)
from megahash.models.residual_mix import build as build_residual_mix
from megahash.models.residual_mix import run_layers

# =============================================================================== attention


class TorchParts:
    """The builders a kind declares its projections against (:mod:`megahash.models.mixing`), plain torch at
    TP=1: ``nn.Linear`` for split and replicated projections alike."""

    def __init__(self, config):
        self.config = config

    def column(self, in_f: int, out_f: int, bias: bool):
        return nn.Linear(in_f, out_f, bias=bias)

    replicated = column

    def per_head(self, heads: int, dim: int, init=None, flat: bool = False):
        return PerHeadWeight(heads, dim, init, flat)

    def norm(self, dim: int):
        return make_norm(self.config, dim)

    def core_attention(self, layer):
        return SoftmaxCore(layer.causal, layer.score_scale())

    def row(self, in_f: int, out_f: int):
        return nn.Linear(in_f, out_f, bias=not arch_of(self.config.arch).swiglu)

    def gather(self, x):
        return x

    def rng(self, name: str = ""):
        return contextlib.nullcontext()


class TorchLayer(nn.Module):
    """The plain-torch layer of a kind (``torch_layer(Kind)`` puts it before the kind's class): built from the
    export's config and the layer's spec (``kind``, ``groups``, what the kind's ``export_spec`` adds; its
    options otherwise from ``config.megahash_config``); ``forward`` is ``linear_proj(mix(...))``."""

    def __init__(self, config, spec: dict, layer_number: int = 1):
        super().__init__()
        n = config.num_attention_heads
        options = dict(megahash_option(config, "model", "attention.options", None) or {})
        setup = Setup(
            kind=spec["kind"],
            layer_number=layer_number,
            hidden=config.hidden_size,
            heads=n,
            head_dim=config.hidden_size // n,
            groups=int(spec.get("groups") or n),
            causal=arch_of(config.arch).causal,
            qkv_bias=bool(config.qkv_bias),
            qk_norm=bool(megahash_option(config, "model", "qk_norm", False)),
            qk_gain=float(megahash_option(config, "model", "qk_gain", 0.0) or 0.0),
            options={**options, **spec},
            mup_base=int(megahash_option(config, "model", "mup_base_hidden_size", 0) or 0),
        )
        self.assemble(setup, TorchParts(config))

    def forward(self, x, attention_mask, rotary_pos_emb, state):
        return self.linear_proj(self.mix(x, attention_mask, rotary_pos_emb, state))


def rebuildable(module: nn.Module, ctor, *args) -> nn.Module:
    """Mark a kind's module (and each of its submodules, with its path) as made by ``ctor(*args)``: transformers
    builds a model on the meta device and leaves non-persistent buffers empty (``torch.empty_like``) after loading,
    so :meth:`megahash.models.hf_model.MegahashPreTrainedModel._init_weights` rebuilds the kind's module on the
    CPU and copies them (a kind computes e.g. its ALiBi slopes in ``build``, as in training; nothing to declare)."""
    for path, sub in module.named_modules():
        sub.__dict__["_megahash_rebuild"] = (ctor, args, path)  # not an attribute nn.Module tracks
    return module


def rebuild_buffers(module: nn.Module) -> None:
    """Fill the non-persistent buffers of ``module`` itself from a CPU rebuild of the kind's module it belongs
    to (:func:`rebuildable`); nothing for a module without such buffers or not part of a kind."""
    names = [n for n in getattr(module, "_non_persistent_buffers_set", ()) if module._buffers.get(n) is not None]
    made = module.__dict__.get("_megahash_rebuild")
    if not names or made is None:
        return
    ctor, args, path = made
    with torch.device("cpu"):
        twin = ctor(*args).get_submodule(path)
    for n in names:
        old = module._buffers[n]
        module._buffers[n] = twin._buffers[n].to(device=old.device, dtype=old.dtype)


_LAYERS: dict = {}


def torch_layer(kind_class: type) -> type:
    """The plain-torch module class of a kind (:class:`TorchLayer` first, then the kind's class)."""
    if kind_class not in _LAYERS:
        _LAYERS[kind_class] = type(kind_class.__name__, (TorchLayer, kind_class), {"__module__": kind_class.__module__})
    return _LAYERS[kind_class]


def build_attention(config, spec, table: dict, layer_number: int = 1):
    """The ``self_attention`` module of one layer: the plain-torch layer of the kind (``table``: the kinds,
    :func:`megahash.models.reference_table.references`, handed down by the shell)."""
    kind = spec["kind"]
    if kind not in table:
        raise ValueError(f"attention kind {kind!r} has no plain-torch form (a Mixing class registered with its name)")
    cls = torch_layer(table[kind])
    return rebuildable(cls(config, spec, layer_number), cls, config, spec, layer_number)


# =============================================================================== layers


class MLP(nn.Module):
    """SwiGLU (decoder: fc1 rows [gate; up], no biases), ReLU squared without biases (``model.mlp_activation``
    relu2) or GELU with biases (encoder)."""

    def __init__(self, config):
        super().__init__()
        self.relu2 = megahash_option(config, "model", "mlp_activation", "auto") == "relu2"
        self.gated = arch_of(config.arch).swiglu and not self.relu2
        bias = not (arch_of(config.arch).swiglu or self.relu2)
        f, h = config.intermediate_size, config.hidden_size
        self.linear_fc1 = nn.Linear(h, 2 * f if self.gated else f, bias=bias)
        self.linear_fc2 = nn.Linear(f, h, bias=bias)

    def forward(self, x):
        y = self.linear_fc1(x)
        if self.gated:
            a, b = torch.chunk(y, 2, dim=-1)
            y = F.silu(a) * b
        elif self.relu2:
            y = F.relu(y).square()
        else:
            y = F.gelu(y)
        return self.linear_fc2(y)


class Layer(nn.Module):
    def __init__(self, config, spec, table: dict, layer_number: int = 1):
        super().__init__()
        self.kind = spec["kind"]
        self.skip = bool(spec.get("skip", False))
        self.input_layernorm = make_norm(config)
        self.self_attention = build_attention(config, spec, table, layer_number)
        self.pre_mlp_layernorm = make_norm(config)
        self.mlp = MLP(config)
        self.post_norm = is_roberta(config)

    def forward(self, x, attention_mask, rotary_pos_emb, state):
        """x [s, b, h]; the layer's mask, RoPE angles and the forward's state (:class:`MixState`)."""
        if self.skip:  # `skip` mode: the whole layer is an identity
            return x
        attention = self.self_attention
        if self.post_norm:  # model.layout=roberta: post-LN (input_layernorm after attention, pre_mlp after MLP)
            x = self.input_layernorm(x + attention(x, attention_mask, rotary_pos_emb, state))
            return self.pre_mlp_layernorm(x + self.mlp(x))
        x = x + attention(self.input_layernorm(x), attention_mask, rotary_pos_emb, state)
        return x + self.mlp(self.pre_mlp_layernorm(x))


class Decoder(nn.Module):
    def __init__(self, config, table: dict):
        super().__init__()
        self.layers = nn.ModuleList([Layer(config, spec, table, i + 1) for i, spec in enumerate(config.layer_specs)])
        self.final_layernorm = None if is_roberta(config) else make_norm(config)
        # model.x0_mix / model.unet_skips (megahash/models/residual_mix.py), as megatron_model.Block
        self.residual = build_residual_mix(
            bool(megahash_option(config, "model", "x0_mix", False)),
            bool(megahash_option(config, "model", "unet_skips", False)),
            len(self.layers),
            float(config.norm_eps),
        )

    def run(self, x, layer):
        """``layer(i, x) -> x`` over the layers, through the residual mixing where the model has it."""
        return run_layers(self.residual, len(self.layers), x, layer)


class RobertaEmbeddingExtras(nn.Module):
    """``model.layout=roberta``: LayerNorm(emb + P[pos] + T[0]), positions 2.. for real tokens, 1 for padding."""

    def __init__(self, config):
        super().__init__()
        h = config.hidden_size
        self.position_embeddings = nn.Embedding(config.max_position_embeddings + 2, h)
        self.token_type_embeddings = nn.Embedding(
            max(1, int(megahash_option(config, "model", "type_vocab_size", 1))), h
        )
        self.layernorm = nn.LayerNorm(h, eps=config.norm_eps)

    def forward(self, emb, key_mask=None, positions=None):
        b, s = emb.shape[:2]
        idx = (torch.arange(s, device=emb.device).unsqueeze(0).expand(b, s) if positions is None else positions) + 2
        if key_mask is not None:
            idx = torch.where(key_mask.bool(), idx, torch.ones_like(idx))
        extra = self.position_embeddings(idx) + self.token_type_embeddings(torch.zeros_like(idx))
        return self.layernorm(emb + extra.to(emb.dtype))


def build_embedding(config, table: dict):
    if config.embedding not in table:
        raise ValueError(f"embedding kind {config.embedding!r} has no plain-torch reference (@register_reference)")
    cls = table[config.embedding]
    return rebuildable(cls(config), cls, config)


def build_head(config, table: dict):
    """The output head's reference (``head:NAME``: the export writes the head the objective trains), or None:
    the vocabulary logits of the model's ``output_layer`` (or tied table)."""
    cls = table.get(f"head:{config.head}")
    return None if cls is None else rebuildable(cls(config), cls, config)


# =============================================================================== embeddings


class TorchHashEmbedding(nn.Module):
    """Special table (ids 0-4) + the word embedding of subclasses (``embed_words``)."""

    tieable = False
    needs_codes = True

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.special = nn.Parameter(torch.zeros(NUM_SPECIAL, config.hidden_size))

    def check(self, codes, width):
        if codes is None:
            raise ValueError(
                f"embedding {self.config.embedding!r} reads word-hash codes: pass hash_codes "
                f"[batch, seq, {width}] (model.encode_text(text) computes them)"
            )
        if codes.shape[-1] != width:
            raise ValueError(f"hash_codes width {codes.shape[-1]} != {width} ({self.config.hash_spec})")

    def special_rows(self, tokens):
        """Row of ``special`` of each token, by role (bos pad eos unk mask = rows 0-4; the ids are
        the tokenizer's, ``megahash_config.data.special_ids``; default the word ids 0-4); -1 else."""
        return special_rows(tokens, self.config)

    def forward(self, tokens, codes=None):
        rows = self.special_rows(tokens)
        word = rows < 0
        emb = self.embed_words(tokens, codes, word)
        special = self.special[rows.clamp(0, NUM_SPECIAL - 1)].to(emb.dtype)
        return torch.where(word.unsqueeze(-1), emb, special)


SPECIAL_ROLES = ("bos", "pad", "eos", "unk", "mask")


def special_ids(config) -> list:
    """The tokenizer's id of each special role (-1 if absent) from the exported megahash config."""
    ids = ((getattr(config, "megahash_config", None) or {}).get("data") or {}).get("special_ids") or {}
    if not ids:
        return list(range(NUM_SPECIAL))
    return [-1 if ids.get(r) is None else int(ids[r]) for r in SPECIAL_ROLES]


def special_rows(tokens, config):
    rows = torch.full_like(tokens, -1)
    for r, i in reversed(list(enumerate(special_ids(config)))):
        if i >= 0:
            rows = torch.where(tokens == i, torch.full_like(tokens, r), rows)
    return rows


def build_kind_input(config, meta: dict, table: dict):
    """The plain-torch reference of an input a kind adds (``input:KIND``, e.g. the fixed input)."""
    cls = table.get(f"input:{meta['kind']}")
    if cls is None:
        raise ValueError(
            f"attention kind {meta['kind']!r} adds an input but has no reference for it (@register_reference)"
        )
    return rebuildable(cls(config, meta), cls, config, meta)
