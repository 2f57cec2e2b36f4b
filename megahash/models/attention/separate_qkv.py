"""Shared part of the kinds whose Q, K come from another input than V (``rndembqk``/``fixedseqqk``, from
a fixed input; ``staticembqk``, from the layer-0 embeddings): separate ``linear_q``/``linear_k``/``linear_v``
and ONE attention map shared by the batch (:func:`megahash.ops.shared_map.parallel.shared_softmax`)."""

from __future__ import annotations

import math

import torch.nn.functional as F
from megatron.core import tensor_parallel

from megahash.errors import ConfigError
from megahash.models.attention.base import AttentionBase, column, heads, rope
from megahash.ops.shared_map.parallel import shared_softmax


class SeparateQKVAttention(AttentionBase):
    """``linear_q``, ``linear_k`` (Q, K from one input) and ``linear_v`` (V from the hidden states)."""

    def __init__(self, config, layer_number, attn_mask_type, cfg=None, groups: int | None = None, **kw):
        super().__init__(config, layer_number, attn_mask_type, cfg, **kw)
        g = groups or config.num_query_groups or self.n
        if self.n % g or g % self.tp:
            raise ConfigError(
                f"{self.kind}: num_query_groups={g} must divide num_heads={self.n} and be divisible "
                f"by parallel.tensor={self.tp}"
            )
        self.groups, self.g_local = g, g // self.tp
        self.linear_q = column(self.d_m, self.n * self.d_h, config, self.qkv_bias)
        self.linear_k = column(self.d_m, g * self.d_h, config, self.qkv_bias)
        self.linear_v = column(self.d_m, g * self.d_h, config, self.qkv_bias)
        self.build_proj(self.n * self.d_h)
        self.scale = 1.0 / math.sqrt(self.d_h)

    def qk(self, x, rotary_pos_emb):
        q, k = self.norm_qk(heads(self.linear_q(x)[0], self.n_local), heads(self.linear_k(x)[0], self.g_local))
        q, k = rope(q, rotary_pos_emb, self.config), rope(k, rotary_pos_emb, self.config)
        return q, k

    def attend(self, q, k, v, attention_mask):
        """q [s, 1, n_l, d], k [sk, 1, g_l, d] (the fixed sequence), v [sk, b, g_l, d] -> [s, b, n_l*d].

        ONE attention map [g, rep, s, sk] for the whole batch, the values of all sequences laid side
        by side (:func:`megahash.ops.shared_map.parallel.shared_softmax`: no map kept for backward)."""
        s, _, n_l, d = q.shape
        b, g = v.shape[1], v.shape[2]
        qh = q[:, 0].permute(1, 0, 2).reshape(g, n_l // g, s, d)
        kh, vh = k[:, 0].permute(1, 0, 2), v.permute(1, 2, 0, 3)  # [g, sk, d], [b, g, sk, d]
        key_mask = self.key_padding(attention_mask, b)
        if self.training and self.config.attention_dropout > 0:
            with tensor_parallel.get_cuda_rng_tracker().fork():
                out = shared_softmax(
                    qh, kh, vh, self.scale, self.causal, key_mask, lambda p: F.dropout(p, self.config.attention_dropout)
                )
        else:
            out = shared_softmax(qh, kh, vh, self.scale, self.causal, key_mask)
        return out.permute(3, 0, 1, 2, 4).reshape(s, b, n_l * d)  # [b, g, rep, s, d] -> [s, b, n_l*d]
