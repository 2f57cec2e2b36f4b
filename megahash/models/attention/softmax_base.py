"""Shared parts of the softmax attention kinds (not a kind): grouped K/V projections (split or replicated over
TP), the project -> RoPE -> KV cache -> softmax core pipeline (``mha``/``gqa``/``mqa``, ``sha``, ``mhe-*``,
``skv``, ``el-att`` build on it; the linear kinds reuse :class:`GroupedKV`), a sliding window over the keys
with its rolling KV cache (a kind sets ``window``) and the sigmoid output gate (a kind that offers it calls
``build_output_gate``; its option ``gated``, :class:`GatedOptions`). Torch-only, written once
(:mod:`megahash.models.mixing`): the HF export copies it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megahash.errors import ConfigError
from megahash.models.mixing import Mixing, append_cache, heads, rope


def default_gqa_groups(n: int) -> int:
    """Largest divisor of n that is at most n/4 (at least 1)."""
    return max([g for g in range(1, max(1, n // 4) + 1) if n % g == 0])


class GroupedKV:
    """Mixin: ``linear_q`` (n heads) + ``linear_kv`` (g groups, rows ``[g][k (d_h), v (d_h)]``), split over TP,
    or replicated when TP does not divide g (each query head then picks its group: ``head_group``)."""

    def build_grouped_qkv(self, parts, groups: int) -> None:
        n, d_h, tp = self.n, self.d_h, self.tp
        if groups < 1 or n % groups:
            raise ConfigError(f"{self.kind}: model.num_heads={n} is not divisible by {groups} key/value groups")
        self.groups = groups
        self.linear_q = parts.column(self.d_m, n * d_h, self.qkv_bias)
        self.kv_split = groups % tp == 0
        if self.kv_split:
            self.linear_kv = parts.column(self.d_m, 2 * groups * d_h, self.qkv_bias)
            self.g_local = groups // tp
        else:
            self.linear_kv = parts.replicated(self.d_m, 2 * groups * d_h, self.qkv_bias)
            self.g_local = groups
            rep, r = n // groups, self.tp_rank
            self.register_buffer(
                "head_group",
                torch.tensor([(r * self.n_local + i) // rep for i in range(self.n_local)]),
                persistent=False,
            )

    @property
    def value_heads(self) -> int:
        """The value heads (``model.value_embeds`` sizes its tables by them): the key/value groups."""
        return self.groups

    def grouped_q(self, x):
        return heads(self.linear_q(x), self.n_local)

    def grouped_kv(self, x):
        """-> k, v [s, b, g_local, d_h] (all g groups when replicated)."""
        kv = self.linear_kv(x)
        s, b = kv.shape[:2]
        kv = kv.view(s, b, self.g_local, 2, self.d_h)
        return kv.unbind(3)  # backward stacks the two gradients (indexing would zero-fill and copy twice)

    def local_kv(self, k, v):
        """Replicated groups -> one K/V per local query head (so the core sees matching groups)."""
        if self.kv_split:
            return k, v
        return k.index_select(2, self.head_group), v.index_select(2, self.head_group)


@dataclass(frozen=True)
class GatedOptions:
    """``model.attention.options`` of the softmax kinds that offer the output gate (a schedule item
    ``KIND+gated`` sets it for one layer). ``EXAMPLES``: the per-layer settings (schedule-item suffixes, "" =
    the defaults) the registry-derived tests run such a kind with."""

    gated: bool = False  # sigmoid output gate per head and channel (Qwen3-Next; megatron's attention_output_gate)
    EXAMPLES = ("", "gated")


class SoftmaxAttention(Mixing):
    """project -> QK-norm -> RoPE on q, k -> KV cache -> softmax core -> (select) -> (output gate): a kind defines
    ``build`` and ``project(x) -> q [s, b, n_local, d], k, v [s, b, groups, d]``.

    ``window`` (set by a kind, e.g. in ``build``): query i sees only keys i - window < j <= i (a sliding window,
    :mod:`megahash.ops.utils.window`), and the decoding cache keeps only the last ``window - 1`` keys and values
    (a rolling cache: its size and a decoding step's work stay flat in the generated length)."""

    window = None  # keys a query sees (a sliding window), None: all

    def assemble(self, setup, parts) -> None:
        super().assemble(setup, parts)
        self.core_attention = parts.core_attention(self)

    def build_output_gate(self, parts) -> None:
        """``model.attention.options.gated``: o_i <- o_i * sigmoid(x W_g,i) for every head i and channel, before
        ``linear_proj`` (the output gate of [Qiu25] at position G1, after the scaled dot-product attention,
        elementwise: Qwen3-Next's gated attention [Qwen25], megatron-core's ``attention_output_gate``);
        ``linear_output_gate`` d_m -> n d_h split by head over TP, with the q/k/v bias setting."""
        if self.setup.option("gated", False):
            self.linear_output_gate = parts.column(self.d_m, self.n * self.d_h, self.qkv_bias)

    def output_gate(self, out, x):
        """out [s, b, n_local d_h] times the gate of x (the sigmoid in at least fp32, as megatron-core's
        ``_apply_output_gate``)."""
        gate = getattr(self, "linear_output_gate", None)
        if gate is None:
            return out
        g = gate(x)
        return (out * torch.sigmoid(g.to(torch.promote_types(g.dtype, torch.float32)))).to(out.dtype)

    def project(self, x):  # pragma: no cover - abstract
        raise NotImplementedError

    def expand_kv(self, k, v):
        return k, v

    def select_output(self, out):
        return out

    def mix(self, x, attention_mask, rotary_pos_emb, state):
        q, k, v = self.project(x)
        if state.value_embeds is not None:  # model.value_embeds (megahash/models/value_embeds.py)
            v = state.value_embeds.add(v, self.layer_number - 1, state.tokens, self.tp_rank)
        q, k = self.norm_qk(q, k)
        q = rope(q, rotary_pos_emb)
        k = rope(k, rotary_pos_emb)
        cache = state.cache(self.layer_number)
        keep = None if self.window is None else self.window - 1  # the rolling cache of a sliding window
        k = append_cache(cache, "k", k, keep=keep)
        v = append_cache(cache, "v", v, keep=keep)
        k, v = self.expand_kv(k, v)
        with self.dropout_rng():  # packed documents: attention inside each (None: off, decoding)
            out = self.core_attention(
                q, k, v, attention_mask, document_ids=state.document_ids, window=self.window, masks=state.masks
            )
        return self.output_gate(self.select_output(out), x)


class GroupedSoftmax(GroupedKV, SoftmaxAttention):
    """softmax(Q_i K_g(i)^T / sqrt(d_h)) V_g(i) ([Xue25] eq. 3.1-3.3): ``linear_q`` (n heads) and ``linear_kv``
    (g groups, rows ``[g][k (d_h), v (d_h)]``), the output gate when ``gated`` (the ``mha`` family and the kinds
    that are ``mha`` with one change, e.g. a sliding window)."""

    def build(self, parts):
        self.build_grouped_qkv(parts, self.groups)
        self.build_output_gate(parts)

    def project(self, x):
        q = self.grouped_q(x)
        k, v = self.grouped_kv(x)
        return q, k, v

    def expand_kv(self, k, v):
        return self.local_kv(k, v)
