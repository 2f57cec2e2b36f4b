"""Shared part of the kinds whose Q, K come from another input than V (``rndembqk``/``fixedseqqk``, from
a fixed input; ``staticembqk``, from the layer-0 embeddings; not a kind): separate ``linear_q``/``linear_k``/
``linear_v`` and ONE attention map shared by the batch (:func:`megahash.ops.shared_map.parallel.shared_softmax`).
Torch-only, written once (:mod:`megahash.models.mixing`): the HF export copies it."""

from __future__ import annotations

import torch.nn.functional as F

from megahash.errors import ConfigError
from megahash.models.mixing import Mixing, heads, rope
from megahash.ops.shared_map.parallel import shared_softmax


class SeparateQKV(Mixing):
    """``linear_q``, ``linear_k`` (Q, K from one input) and ``linear_v`` (V from the hidden states)."""

    def build(self, parts) -> None:
        g = self.groups
        if self.n % g or g % self.tp:
            raise ConfigError(
                f"{self.kind}: num_query_groups={g} must divide num_heads={self.n} and be divisible "
                f"by parallel.tensor={self.tp}"
            )
        self.g_local = g // self.tp
        self.linear_q = parts.column(self.d_m, self.n * self.d_h, self.qkv_bias)
        self.linear_k = parts.column(self.d_m, g * self.d_h, self.qkv_bias)
        self.linear_v = parts.column(self.d_m, g * self.d_h, self.qkv_bias)
        self.scale = self.score_scale()  # 1/sqrt(d_h); 1/d_h under muP

    def qk(self, x, rotary_pos_emb):
        q, k = self.norm_qk(heads(self.linear_q(x), self.n_local), heads(self.linear_k(x), self.g_local))
        return rope(q, rotary_pos_emb), rope(k, rotary_pos_emb)

    def attend(self, q, k, v, attention_mask):
        """q [s, 1, n_l, d], k [sk, 1, g_l, d] (the fixed sequence), v [sk, b, g_l, d] -> [s, b, n_l*d].

        ONE attention map [g, rep, s, sk] for the whole batch, the values of all sequences laid side
        by side (:func:`megahash.ops.shared_map.parallel.shared_softmax`: no map kept for backward)."""
        s, _, n_l, d = q.shape
        b, g = v.shape[1], v.shape[2]
        qh = q[:, 0].permute(1, 0, 2).reshape(g, n_l // g, s, d)
        kh, vh = k[:, 0].permute(1, 0, 2), v.permute(1, 2, 0, 3)  # [g, sk, d], [b, g, sk, d]
        key_mask = self.key_padding(attention_mask, b)
        if self.training and self.attention_dropout > 0:
            with self.dropout_rng():
                out = shared_softmax(
                    qh, kh, vh, self.scale, self.causal, key_mask, lambda p: F.dropout(p, self.attention_dropout)
                )
        else:
            out = shared_softmax(qh, kh, vh, self.scale, self.causal, key_mask)
        return out.permute(3, 0, 1, 2, 4).reshape(s, b, n_l * d)  # [b, g, rep, s, d] -> [s, b, n_l*d]
