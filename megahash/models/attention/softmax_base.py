"""Shared parts of the softmax attention kinds (not a kind): grouped K/V projections (split or replicated over
TP) and the project -> RoPE -> KV cache -> softmax core pipeline (``mha``/``gqa``/``mqa``, ``sha``, ``mhe-*``,
``skv``, ``el-att`` build on it; the linear kinds reuse :class:`GroupedKV`). Torch-only, written once
(:mod:`megahash.models.mixing`): the HF export copies it."""

from __future__ import annotations

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


class SoftmaxAttention(Mixing):
    """project -> QK-norm -> RoPE on q, k -> KV cache -> softmax core -> (select): a kind defines ``build`` and
    ``project(x) -> q [s, b, n_local, d], k, v [s, b, groups, d]``."""

    def assemble(self, setup, parts) -> None:
        super().assemble(setup, parts)
        self.core_attention = parts.core_attention(self)

    def project(self, x):  # pragma: no cover - abstract
        raise NotImplementedError

    def expand_kv(self, k, v):
        return k, v

    def select_output(self, out):
        return out

    def mix(self, x, attention_mask, rotary_pos_emb, state):
        q, k, v = self.project(x)
        q, k = self.norm_qk(q, k)
        q = rope(q, rotary_pos_emb)
        k = rope(k, rotary_pos_emb)
        cache = state.cache(self.layer_number)
        k = append_cache(cache, "k", k)
        v = append_cache(cache, "v", v)
        k, v = self.expand_kv(k, v)
        with self.dropout_rng():  # packed documents: attention inside each (None: off, decoding)
            out = self.core_attention(q, k, v, attention_mask, document_ids=state.document_ids)
        return self.select_output(out)
