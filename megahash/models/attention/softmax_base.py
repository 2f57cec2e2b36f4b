"""Shared parts of the softmax attention kinds: grouped K/V projections (split or replicated over TP)
and the project -> RoPE -> KV cache -> SDPA core pipeline (``mha``/``gqa``/``mqa``, ``sha``, ``mhe-*``,
``skv``, ``el-att`` build on it; the linear kinds reuse :class:`GroupedKV`)."""

from __future__ import annotations

import torch
from megatron.core import tensor_parallel

from megahash.errors import ConfigError
from megahash.models.attention.base import (
    AttentionBase,
    ReplicatedLinear,
    append_cache,
    column,
    gather_input,
    heads,
    rope,
    tp_rank,
)
from megahash.models.attention.sdpa import SDPACoreAttention


def default_gqa_groups(n: int) -> int:
    """Largest divisor of n that is at most n/4 (at least 1)."""
    return max([g for g in range(1, max(1, n // 4) + 1) if n % g == 0])


class GroupedKV:
    """Mixin: ``linear_q`` (n heads) + ``linear_kv`` (g groups), split or replicated over TP."""

    def build_grouped_qkv(self, groups: int) -> None:
        n, d_h, tp = self.n, self.d_h, self.tp
        if groups < 1 or n % groups:
            raise ConfigError(f"{self.kind}: model.num_heads={n} is not divisible by {groups} key/value groups")
        self.groups = groups
        self.linear_q = column(self.d_m, n * d_h, self.config, self.qkv_bias)
        self.kv_split = groups % tp == 0
        if self.kv_split:
            self.linear_kv = column(self.d_m, 2 * groups * d_h, self.config, self.qkv_bias)
            self.g_local = groups // tp
        else:
            self.linear_kv = ReplicatedLinear(self.d_m, 2 * groups * d_h, self.config, self.qkv_bias)
            self.g_local = groups
            rep = n // groups
            r = tp_rank()
            self.register_buffer(
                "head_group",
                torch.tensor([(r * self.n_local + i) // rep for i in range(self.n_local)]),
                persistent=False,
            )

    def grouped_q(self, x):
        return heads(self.linear_q(x)[0], self.n_local)

    def grouped_kv(self, x):
        """-> k, v [s, b, g_local, d_h] (all g groups when replicated)."""
        if self.kv_split:
            kv = self.linear_kv(x)[0]
        else:
            kv = self.linear_kv(gather_input(x, self.config))
        s, b = kv.shape[:2]
        kv = kv.view(s, b, self.g_local, 2, self.d_h)
        return kv.unbind(3)  # backward stacks the two gradients (indexing would zero-fill and copy twice)

    def local_kv(self, k, v):
        """Replicated groups -> one K/V per local query head (so SDPA sees matching groups)."""
        if self.kv_split:
            return k, v
        return k.index_select(2, self.head_group), v.index_select(2, self.head_group)


class SoftmaxAttentionBase(AttentionBase):
    """project -> RoPE on q, k -> KV cache -> SDPA core -> (select) -> linear_proj."""

    replicated_heads = False  # SHA: the same head on every TP rank (dropout RNG must agree)

    def __init__(self, config, layer_number, attn_mask_type, cfg=None, **kw):
        super().__init__(config, layer_number, attn_mask_type, cfg, **kw)
        self.core_attention = SDPACoreAttention(config, layer_number, attn_mask_type)

    def project(self, x):  # pragma: no cover - abstract
        raise NotImplementedError

    def expand_kv(self, k, v):
        return k, v

    def select_output(self, out):
        return out

    def mix(self, x, attention_mask, rotary_pos_emb, state):
        q, k, v = self.project(x)
        q, k = self.norm_qk(q, k)
        q = rope(q, rotary_pos_emb, self.config)
        k = rope(k, rotary_pos_emb, self.config)
        cache = state.cache(self.layer_number)
        k = append_cache(cache, "k", k)
        v = append_cache(cache, "v", v)
        k, v = self.expand_kv(k, v)
        docs = state.document_ids  # packed documents: attention inside each (None: off, decoding)
        if self.training and self.config.attention_dropout > 0:
            name = "data-parallel-rng" if self.replicated_heads else "model-parallel-rng"
            with tensor_parallel.get_cuda_rng_tracker().fork(name):
                out = self.core_attention(q, k, v, attention_mask, document_ids=docs)
        else:
            out = self.core_attention(q, k, v, attention_mask, document_ids=docs)
        return self.select_output(out)
