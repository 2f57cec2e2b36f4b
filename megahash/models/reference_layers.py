"""The generic plain-torch model shell around the kinds' reference forwards (no megatron-core).

Pre-norm layers (RMSNorm + SwiGLU for decoders, LayerNorm + GELU with biases for encoders; post-LN
with ``model.layout=roberta``), one attention kind per layer, built from the kind's own
``@register_reference`` class (:func:`megahash.models.reference_table.references`), `skip` layers as
identities, the base classes the kind references derive from (softmax attention over a KV cache,
linear attention over a recurrent state, separate Q/K/V projections, the special-token table of
hash embeddings) and the fixed input of the fixed-Q/K kinds. Parameter names are megahash's TP=1
names, which are also those of the Hugging Face export. ``megahash export-hf`` copies this file
verbatim (imports rewritten to the folder's relative ones); it imports torch, math, typing and the
torch-only megahash modules only.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from megahash.models.arch import arch_of
from megahash.models.reference_ops import (
    NUM_SPECIAL,
    append_state,
    apply_rope,
    is_roberta,
    make_norm,
    megahash_option,
    softmax_attention,
    split_heads,
)
from megahash.ops.utils.documents import document_rows

# =============================================================================== attention bases


class TorchAttention(nn.Module):
    """``linear_proj(mix(x))``; the sizes every kind shares, and the optional Qwen3 QK-norm."""

    qk_norm = True  # False: the kind has no queries/keys to normalise

    def __init__(self, config, spec: dict, proj_in: int | None = None):
        super().__init__()
        self.kind = spec["kind"]
        self.n = config.num_attention_heads
        self.d = config.hidden_size // config.num_attention_heads
        self.d_m = config.hidden_size
        self.groups = int(spec.get("groups") or self.n)
        arch = arch_of(config.arch)
        self.causal = arch.causal
        self.qkv_bias = bool(config.qkv_bias)
        self.linear_proj = nn.Linear(proj_in or self.n * self.d, self.d_m, bias=not arch.swiglu)
        if megahash_option(config, "model", "qk_norm", False) and self.qk_norm:  # Qwen3 QK-norm
            self.q_layernorm, self.k_layernorm = make_norm(config, self.d), make_norm(config, self.d)

    def norm_qk(self, q, k):
        if getattr(self, "q_layernorm", None) is None:
            return q, k
        return self.q_layernorm(q), self.k_layernorm(k)

    def forward(self, x, ctx, cache):
        return self.linear_proj(self.mix(x, ctx, cache))


class SoftmaxAttention(TorchAttention):
    """project -> RoPE on q, k -> KV cache -> softmax -> linear_proj. Subclasses define
    ``project(x) -> q [b, n, s, d], k, v [b, g, s, d]``."""

    def project(self, x):  # pragma: no cover - abstract
        raise NotImplementedError

    def mix(self, x, ctx, cache):
        q, k, v = self.project(x)
        q, k = self.norm_qk(q, k)
        q = apply_rope(q, ctx["cos"], ctx["sin"])
        k = apply_rope(k, ctx["cos"], ctx["sin"])
        k = append_state(cache, "k", k)
        v = append_state(cache, "v", v)
        return softmax_attention(q, k, v, self.causal, ctx.get("key_mask"), document_ids=ctx.get("document_ids"))


class LinearAttention(TorchAttention):
    """Linear attention over a recurrent state: ``linear_q`` + ``linear_kv`` (g groups), q/k through
    :meth:`transform_qk` (RoPE by default), then the kind's :meth:`kernel` in float32 (float64 kept).
    A kind whose q, k have another width than the head (Based's projected features) says so in
    :meth:`qk_features`."""

    def qk_features(self, config, spec) -> int:
        """Width of q, k per head; 0 = the head dim."""
        return 0

    def __init__(self, config, spec):
        super().__init__(config, spec)
        fd = self.qk_features(config, spec)
        self.fd = fd if fd and fd != self.d else 0  # projected feature dim d' of q, k
        self.linear_q = nn.Linear(self.d_m, self.n * (self.fd or self.d), bias=self.qkv_bias)
        if self.fd:  # rows [g][k (d'), v (d_h)]
            self.linear_kv = nn.Linear(self.d_m, self.groups * (self.fd + self.d), bias=self.qkv_bias)
            if getattr(self, "q_layernorm", None) is not None:
                self.q_layernorm, self.k_layernorm = make_norm(config, self.fd), make_norm(config, self.fd)
        else:
            self.linear_kv = nn.Linear(self.d_m, 2 * self.groups * self.d, bias=self.qkv_bias)

    def transform_qk(self, q, k, cos, sin):
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin)

    def kernel(self, q, k, v, key_mask, cache, doc, offset):  # pragma: no cover - abstract
        """q [b, g, n/g, s, f], k [b, g, 1, s, f], v [b, g, 1, s, d] -> [b, g, n/g, s, d]; ``doc``: document
        ids [b, 1, 1, s] or None; ``offset``: position of the first token."""
        raise NotImplementedError

    def mix(self, x, ctx, cache):
        b, s, _ = x.shape
        n, g, d = self.n, self.groups, self.d
        q = split_heads(self.linear_q(x), n)
        cos, sin = ctx["cos"], ctx["sin"]
        if self.fd:
            kv = self.linear_kv(x).view(b, s, g, self.fd + d)
            k, v = kv[..., : self.fd].transpose(1, 2), kv[..., self.fd :].transpose(1, 2)
            h, f2 = d // 2, self.fd // 2  # RoPE with the head's first d'/2 frequency pairs
            cos = torch.cat([cos[..., :f2], cos[..., h : h + f2]], -1)
            sin = torch.cat([sin[..., :f2], sin[..., h : h + f2]], -1)
        else:
            kv = self.linear_kv(x).view(b, s, g, 2, d)
            k, v = kv[:, :, :, 0].transpose(1, 2), kv[:, :, :, 1].transpose(1, 2)
        q, k = self.norm_qk(q, k)
        q, k = self.transform_qk(q, k, cos, sin)
        dt = torch.float64 if q.dtype == torch.float64 else torch.float32
        qh = q.reshape(b, g, n // g, s, q.shape[-1]).to(dt)
        kh, vh = k.unsqueeze(2).to(dt), v.unsqueeze(2).to(dt)
        key_mask = ctx.get("key_mask")
        km = None if key_mask is None else key_mask[:, None, None, :].bool()
        doc = document_rows(ctx.get("document_ids"), qh)
        out = self.kernel(qh, kh, vh, km, cache, doc, ctx.get("offset", 0))
        return out.reshape(b, n, s, d).transpose(1, 2).reshape(b, s, n * d).to(x.dtype)


class SeparateQKV(TorchAttention):
    """``linear_q`` (n heads), ``linear_k`` and ``linear_v`` (g groups); :meth:`qk` applies RoPE."""

    def __init__(self, config, spec):
        super().__init__(config, spec)
        g = self.groups
        self.linear_q = nn.Linear(self.d_m, self.n * self.d, bias=self.qkv_bias)
        self.linear_k = nn.Linear(self.d_m, g * self.d, bias=self.qkv_bias)
        self.linear_v = nn.Linear(self.d_m, g * self.d, bias=self.qkv_bias)

    def qk(self, x, cos, sin):
        q, k = self.norm_qk(split_heads(self.linear_q(x), self.n), split_heads(self.linear_k(x), self.groups))
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin)


def build_attention(config, spec, table: dict):
    """The ``self_attention`` module of one layer: the kind's reference class (``table``: the
    references, :func:`megahash.models.reference_table.references`, handed down by the shell)."""
    kind = spec["kind"]
    if kind not in table:
        raise ValueError(f"attention kind {kind!r} has no plain-torch reference (@register_reference)")
    return table[kind](config, spec)


# =============================================================================== layers


class MLP(nn.Module):
    """SwiGLU (decoder: fc1 rows [gate; up], no biases) or GELU with biases (encoder)."""

    def __init__(self, config):
        super().__init__()
        self.gated = arch_of(config.arch).swiglu
        f, h = config.intermediate_size, config.hidden_size
        self.linear_fc1 = nn.Linear(h, 2 * f if self.gated else f, bias=not self.gated)
        self.linear_fc2 = nn.Linear(f, h, bias=not self.gated)

    def forward(self, x):
        y = self.linear_fc1(x)
        if self.gated:
            a, b = torch.chunk(y, 2, dim=-1)
            y = F.silu(a) * b
        else:
            y = F.gelu(y)
        return self.linear_fc2(y)


class Layer(nn.Module):
    def __init__(self, config, spec, table: dict):
        super().__init__()
        self.kind = spec["kind"]
        self.skip = bool(spec.get("skip", False))
        self.input_layernorm = make_norm(config)
        self.self_attention = build_attention(config, spec, table)
        self.pre_mlp_layernorm = make_norm(config)
        self.mlp = MLP(config)
        self.post_norm = is_roberta(config)

    def forward(self, x, ctx, cache):
        if self.skip:  # `skip` mode: the whole layer is an identity
            return x
        if (
            self.post_norm
        ):  # model.layout=roberta: post-LN (input_layernorm after attention, pre_mlp_layernorm after MLP)
            x = self.input_layernorm(x + self.self_attention(x, ctx, cache))
            return self.pre_mlp_layernorm(x + self.mlp(x))
        x = x + self.self_attention(self.input_layernorm(x), ctx, cache)
        return x + self.mlp(self.pre_mlp_layernorm(x))


class Decoder(nn.Module):
    def __init__(self, config, table: dict):
        super().__init__()
        self.layers = nn.ModuleList([Layer(config, spec, table) for spec in config.layer_specs])
        self.final_layernorm = None if is_roberta(config) else make_norm(config)


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
    return table[config.embedding](config)


def build_head(config, table: dict):
    """The output head's reference (``head:NAME``: the export writes the head the objective trains), or None:
    the vocabulary logits of the model's ``output_layer`` (or tied table)."""
    cls = table.get(f"head:{config.head}")
    return None if cls is None else cls(config)


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
    return cls(config, meta)
