"""A token-mixing kind written once: its parts and its mixing. The megatron-core layer (training, TP/SP) and
the plain-torch layer (the Hugging Face export, the parity tests' TP=1 reference) are derived from it.

A kind is a :class:`Mixing` subclass in its own file, registered with its name and costs by ``register_attention``:

- ``build(parts)`` declares its projections against injected builders, megatron-core's submodules style
  (``SelfAttentionSubmodules``: ``linear_qkv``, ``core_attention``, ``linear_proj`` are swappable parts):
  ``parts.column(in, out, bias)`` a projection split by head over TP (megatron's ``ColumnParallelLinear``;
  ``nn.Linear`` in plain torch), ``parts.replicated(...)`` one that cannot be split by head (whole on every TP
  rank, its input gathered), ``parts.per_head(heads, dim, init=None, flat=False)`` a [heads, dim] parameter split by head
  (``init(master)`` fills the whole master tensor in place; ``flat``: a head-major vector, a 1-D parameter),
  ``parts.norm(dim)`` a per-head norm, ``parts.core_attention(self)`` the softmax core (SDPA with the
  accelerator's document masks / plain SDPA), ``parts.row(in, out)`` the output projection (built after
  ``build`` as ``linear_proj`` of width n d_h unless the kind built it). Forward-time parts: ``parts.gather(x)``
  (the full sequence on every TP rank), ``parts.rng(name)`` (the dropout RNG).
- ``mix(x, attention_mask, rotary_pos_emb, state)`` mixes x [s(/tp under SP), b, h] into [s, b, width/tp] for
  ``linear_proj``, written once in megatron-core's sequence-first layout for the ``n_local`` heads of this TP
  rank (all n in plain torch): ``attention_mask`` [b, 1, 1, s] (True = masked; encoders) or None,
  ``rotary_pos_emb`` the RoPE angles [s, 1 | b, 1, d_h] or None, ``state`` the forward's :class:`MixState`
  (``state.cache(self.layer_number)``: the layer's decoding cache, None in training; packed documents; the
  tensors a kind input hands its layers).

Torch-only: ``megahash export-hf`` copies this file into the exported folder.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

from megahash.errors import ConfigError


@dataclass(frozen=True)
class Setup:
    """What one layer of a kind is built from (each backend fills it from its own config)."""

    kind: str  # the registered name (one class may serve several, e.g. mha/gqa/mqa)
    layer_number: int  # 1-based, megatron's
    hidden: int
    heads: int
    head_dim: int
    groups: int  # key/value groups of the layer
    causal: bool
    qkv_bias: bool
    qk_norm: bool  # model.qk_norm: per-head norms of q and k (Qwen3)
    qk_gain: float = 0.0  # model.qk_gain: a learnable per-head gain on the normed queries, its initial value; 0 = off
    tp: int = 1
    tp_rank: int = 0
    sequence_parallel: bool = False  # x arrives split over the sequence (``parts.column`` gathers it)
    attention_dropout: float = 0.0
    recompute: str | None = None  # megatron's recompute granularity (None | "selective" | "full")
    options: Any = None  # the kinds' options (model.attention.options): an object or a dict; None: the defaults
    mup_base: int = 0  # model.mup_base_hidden_size B (0 = off): muP's attention scale (:func:`score_scale`)

    def option(self, name: str, default=None):
        if isinstance(self.options, dict):
            return self.options.get(name, default)
        return getattr(self.options, name, default)


@dataclass(eq=False)
class MixState:
    """What one pass of the block hands every layer (all optional: a layer run alone gets ``MixState()``).
    The megatron model's is :class:`megahash.models.forward_state.ForwardState` (this, as megatron-core's
    inference context)."""

    embeddings: torch.Tensor | None = None  # the block's input [s(/tp under SP), b, h] (Q, K of eq. 4.13)
    offset: int = 0  # position of the first token (> 0 while decoding)
    tokens: torch.Tensor | None = None  # [b, s], the new tokens only while decoding
    document_ids: torch.Tensor | None = None  # [b, s] packed documents (megahash/data/documents.py) or None
    position_ids: torch.Tensor | None = None  # [b, s] positions within each document or None
    decode: Any = None  # the decoding session (``.layer(i)``: its per-layer cache dicts), None in training
    inputs: dict = field(default_factory=dict)  # what the model's kind inputs hand their layers, by input attr
    capture: dict | None = None  # a kind input's own pass: its layers record into it, by layer number
    recompute: bool = True  # False: this pass runs without activation recompute (a kind input's plain pass)
    masks: dict = field(default_factory=dict)  # attention masks built once per forward, shared by its layers
    value_embeds: Any = None  # model.value_embeds: the model's ValueEmbeds (megahash/models/value_embeds.py) or None

    def cache(self, layer_number: int) -> dict | None:
        """The decoding cache of a layer (1-based ``layer_number``); None when not decoding."""
        return None if self.decode is None else self.decode.layer(layer_number - 1)

    def tensors(self) -> dict:
        """{field: tensor} of the tensor fields set (what a recomputation takes as its inputs)."""
        return {
            f.name: getattr(self, f.name) for f in dataclasses.fields(self) if torch.is_tensor(getattr(self, f.name))
        }

    def replace(self, **changes):
        """A copy with some fields replaced (the dicts are shared)."""
        return dataclasses.replace(self, **changes)


class Mixing(nn.Module):
    """A kind's token mixing (see the module docstring): a kind defines ``build(parts)`` and ``mix``, never
    ``__init__`` or ``forward`` (the backend's). Sizes after :meth:`assemble`: ``d_m`` (hidden), ``n`` heads
    (``n_local`` on this TP rank), ``d_h`` head dim, ``groups``, ``tp``/``tp_rank``, ``causal``, ``qkv_bias``.

    Parameters: everything except ``linear_proj`` is the kind's "qkv" part ([Xue25] Table 3.4 counts it)."""

    kind = "base"
    replicated_heads = False  # the same heads on every TP rank (SHA): dropout with the data-parallel RNG

    def assemble(self, setup: Setup, parts) -> None:
        """Called by the backend's constructor: sizes, QK-norm, the kind's ``build``, ``linear_proj``."""
        self.setup, self.parts = setup, parts
        self.kind, self.layer_number, self.causal = setup.kind, setup.layer_number, setup.causal
        self.n, self.d_h, self.d_m, self.groups = setup.heads, setup.head_dim, setup.hidden, setup.groups
        self.tp, self.tp_rank, self.qkv_bias = setup.tp, setup.tp_rank, setup.qkv_bias
        self.attention_dropout = setup.attention_dropout
        if self.n % self.tp:
            raise ConfigError(f"parallel.tensor={self.tp} does not divide model.num_heads={self.n}")
        self.n_local = self.n // self.tp
        if setup.qk_norm:  # Qwen3 QK-norm over each head of q and k
            self.build_qk_norm(self.d_h)
        self.build(parts)
        if "linear_proj" not in self._modules:
            self.linear_proj = parts.row(self.n * self.d_h, self.d_m)
        if setup.qk_gain:
            self.build_qk_gain(setup.qk_gain)

    def build(self, parts) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def mix(self, x, attention_mask, rotary_pos_emb, state):  # pragma: no cover - abstract
        raise NotImplementedError

    # -- helpers --------------------------------------------------------------------------
    def build_qk_norm(self, dim: int) -> None:
        """``model.qk_norm``: ``q_layernorm``/``k_layernorm`` (megatron-core's names) over ``dim``."""
        self.q_layernorm = self.parts.norm(dim)
        self.k_layernorm = self.parts.norm(dim)

    def build_qk_gain(self, gain: float) -> None:
        """``model.qk_gain``: ``q_gain`` [n_local], one learnable gain per query head (split by head over TP),
        every one ``gain`` at init (Parameter Golf's ``q_gain``, [OpenAI26]); 1-D: AdamW without decay. Built
        last, its draw on a forked RNG, so the other weights are those of the model without it."""
        with torch.random.fork_rng(devices=[]):
            self.q_gain = self.parts.per_head(self.n, 1)
        w = self.q_gain.weight
        w.data = torch.full((w.shape[0],), float(gain), dtype=w.dtype, device=w.device)

    def norm_qk(self, q, k):
        """QK-norm of per-head q, k [s, b, heads, d] (identity without ``model.qk_norm``), then the queries times
        their head's ``q_gain`` (``model.qk_gain``); before RoPE."""
        if getattr(self, "q_layernorm", None) is None:
            return q, k
        q, k = self.q_layernorm(q), self.k_layernorm(k)
        gain = getattr(self, "q_gain", None)
        if gain is not None:
            q = q * gain.weight.to(q.dtype)[:, None]
        return q, k

    def score_scale(self, d: int | None = None) -> float:
        """The scale of the layer's scores q.k over ``d`` (default the head dim) dims: :func:`score_scale`, under
        muP with the base model's d_0 = d B / hidden."""
        d = d or self.d_h
        return score_scale(d, d * self.setup.mup_base / self.setup.hidden if self.setup.mup_base else 0.0)

    def dropout_rng(self, name: str | None = None):
        """Where attention dropout draws (megatron's RNG tracker, the data-parallel stream for heads replicated
        over TP); nothing to fork in eval or without dropout."""
        if not (self.training and self.attention_dropout > 0):
            return contextlib.nullcontext()
        return self.parts.rng(name or ("data-parallel-rng" if self.replicated_heads else "model-parallel-rng"))

    def key_padding(self, attention_mask, b: int):
        """Encoder padding mask [b, 1, 1, s] (True = masked) -> keep mask [b, s] (True = valid), or None."""
        if attention_mask is None:
            return None
        return ~attention_mask.reshape(attention_mask.shape[0], attention_mask.shape[-1]).bool()

    def qkv_parameters(self) -> list[torch.nn.Parameter]:
        """All parameters of the sublayer except the output projection (Table 3.4 counts these)."""
        return [p for name, p in self.named_parameters() if not name.startswith("linear_proj.")]

    def num_qkv_parameters(self) -> int:
        return sum(p.numel() for p in self.qkv_parameters())


def score_scale(d: int, base_d: float = 0.0) -> float:
    """The scale of attention scores q.k of d-dim q, k: 1/sqrt(d) ([Vaswani17]); under muP (``base_d`` = d_0 > 0,
    the base model's head dim) sqrt(d_0) / d: 1/d as the width grows ([Yang22] sec. 4 / Tensor Programs V: q and k
    become correlated in training, so q.k grows as d, not sqrt(d); Megatron-LM's ``mup_attn_scale_power=1``, the
    ``mup`` package's ``attn_mult / d``) with the multiplier sqrt(d_0) that makes it 1/sqrt(d) at the base width,
    so the base model is the standard one (the ``mup`` package's advice for a standard base model)."""
    return math.sqrt(base_d) / d if base_d else 1.0 / math.sqrt(d)


def readout_multiplier(hidden: int, base: int) -> float:
    """muP's output multiplier base/width on the head's input (``mup.MuReadout``'s 1/width_mult; Megatron-LM's
    ``mup_output_mult``, 1/width_mult on the logits, the same for a bias-free head); 1 without muP (base 0)."""
    return base / hidden if base else 1.0


def heads(t: torch.Tensor, n: int) -> torch.Tensor:
    """[s, b, n*d] -> [s, b, n, d]."""
    return t.view(t.shape[0], t.shape[1], n, t.shape[2] // n)


class LayerCache(dict):
    """A layer's decoding cache (tensors by name) that knows each tensor's batch dimension (``batch_dims``:
    0 by default, e.g. the recurrent kernels' states; 1 for what :func:`append_cache` keeps; None for a tensor
    the batch shares), so a decoding session can reorder and repeat its rows (beam search)."""

    def __init__(self):
        super().__init__()
        self.batch_dims: dict = {}


def append_cache(
    cache: dict | None, key: str, t: torch.Tensor, shared: bool = False, keep: int | None = None
) -> torch.Tensor:
    """Concatenate ``t`` ([s, b, ...]; ``shared``: [s, 1, ...] for the whole batch) to ``cache[key]`` along the
    sequence and store it back; ``keep``: store only the last ``keep`` positions (a rolling cache: a sliding
    window's keys; a view while it shares at most twice its size of storage, else a copy, so a long prompt's
    keys are not held), the whole concatenation is still returned."""
    if cache is None:
        return t
    if key in cache:
        t = torch.cat([cache[key], t], dim=0)
    kept = t if keep is None or t.shape[0] <= keep else t[t.shape[0] - keep :]
    cache[key] = kept.clone() if t.shape[0] > 2 * kept.shape[0] + 1 else kept
    if isinstance(cache, LayerCache):
        cache.batch_dims[key] = None if shared else 1
    return t


def cached_state(cache: dict | None, keys: tuple) -> tuple | None:
    """A recurrent kernel's decoding state stored under ``keys`` in ``cache``; None without a cache
    or before the first call."""
    return tuple(cache[k] for k in keys) if cache is not None and keys[0] in cache else None


def store_state(cache: dict | None, keys: tuple, state) -> None:
    """Keep a recurrent kernel's new state in ``cache`` (nothing without a cache)."""
    if cache is not None:
        cache.update(zip(keys, state))


def rope(t: torch.Tensor, rotary_pos_emb) -> torch.Tensor:
    """RoPE on [s, b, heads, d] with the (already position-sliced) angles of the layer (megatron-core's
    non-interleaved rotary over all of d, its ``_apply_rotary_pos_emb_bshd`` term for term, t cos +
    rotate_half(t) sin (Su et al. 2021, eq. 34), bit for bit): rotate_half(t) sin = roll(t, d/2) sin' with sin'
    the table with its first half negated (the tables repeat the frequencies in both halves), so a call is
    two products, a roll and a sum. cos and sin' are computed once per table (:func:`rope_tables`)."""
    if rotary_pos_emb is None:
        return t
    freqs = rotary_pos_emb[0] if isinstance(rotary_pos_emb, tuple) else rotary_pos_emb
    cos, sin = rope_tables(freqs, t.dtype)
    return t * cos + torch.roll(t, t.shape[-1] // 2, dims=-1) * sin


def rope_tables(freqs: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin with its first half negated) of an angle table, in ``dtype``, on the table's device.

    Cached on the table object in eager mode (every layer of one forward gets the same table), computed
    afresh under ``torch.compile`` (where they fuse into the layer's kernels)."""
    cached = None if torch.compiler.is_compiling() else getattr(freqs, "_megahash_rope", None)
    if cached is not None and cached[0] == dtype:
        return cached[1], cached[2]
    cos = torch.cos(freqs).to(dtype)
    sin = torch.sin(freqs).to(dtype)
    sin = torch.cat((-sin[..., : sin.shape[-1] // 2], sin[..., sin.shape[-1] // 2 :]), dim=-1)  # the table only
    if not torch.compiler.is_compiling():
        freqs._megahash_rope = (dtype, cos, sin)
    return cos, sin


def rope_prefix(freqs, dim: int):
    """RoPE angles of a d_h-dim head restricted to ``dim`` < d_h dims: megatron's layout is
    [f_0..f_{d/2-1}, f_0..f_{d/2-1}] (pairs (i, i + d/2)); keep the first dim/2 pairs."""
    if freqs is None:
        return None
    freqs = freqs[0] if isinstance(freqs, tuple) else freqs
    half = freqs.shape[-1] // 2
    return torch.cat([freqs[..., : dim // 2], freqs[..., half : half + dim // 2]], dim=-1)
