"""Shared part of the linear-attention kinds (``approx``, ``approx-thesis``, ``nonapprox``; not a kind): Q, K, V
as ``mha`` (grouped), and the kind's ``kernel`` on [b, g, rep, s, d] (:mod:`megahash.ops`), with the layer's
decoding cache, the packed documents and the position offset of the forward state. Torch-only, written once
(:mod:`megahash.models.mixing`): the HF export copies it."""

from __future__ import annotations

import math

import torch

from megahash.models.attention.softmax_base import GroupedKV
from megahash.models.mixing import Mixing
from megahash.ops.utils.documents import document_rows


def compute_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


class LinearAttention(GroupedKV, Mixing):
    """Q, K, V as ``mha`` (grouped); :meth:`attend` on [b, g, rep, s, d] runs the kind's :meth:`kernel`."""

    def build(self, parts) -> None:
        self.build_grouped_qkv(parts, self.groups)

    def qkv(self, x, rotary_pos_emb):
        q = self.grouped_q(x)
        k, v = self.local_kv(*self.grouped_kv(x))
        q, k = self.norm_qk(q, k)
        return q, k, v

    def kernel(self, q, k, v, key_mask, cache, doc, offset: int):  # pragma: no cover - abstract
        """q [b, g, rep, s, f], k [b, g, 1, s, f], v [b, g, 1, s, d], key_mask [b, 1, 1, s] or None, the
        layer's decoding cache or None, document ids [b, 1, 1, s] or None -> [b, g, rep, s, d]."""
        raise NotImplementedError

    def attend(self, q, k, v, attention_mask, state):
        key_mask = None if self.causal else self.key_padding(attention_mask, q.shape[0])
        key_mask = None if key_mask is None else key_mask[:, None, None, :]
        doc = document_rows(state.document_ids, q)
        return self.kernel(q, k, v, key_mask, state.cache(self.layer_number), doc, state.offset)

    def query_scale(self, d: int) -> float:
        """The factor on q that turns the kernel's scores q.k/sqrt(d) into the layer's ``score_scale(d)`` q.k: 1,
        or sqrt(d_0/d) under muP (scores sqrt(d_0) q.k/d); a kind whose kernel has no score scale returns 1."""
        return self.score_scale(d) * math.sqrt(d)

    def kernel_inputs(self, x, rotary_pos_emb):
        """x [s, b, h] -> the kernel's q [b, g, rep, s, d] (times :meth:`query_scale`), k, v [b, g, 1, s, d], in its
        compute dtype."""
        q, k, v = self.qkv(x, rotary_pos_emb)
        s, b, n_l, d = q.shape
        g = k.shape[2]
        dt = compute_dtype(q)
        qh = q.permute(1, 2, 0, 3).reshape(b, g, n_l // g, s, d).to(dt)
        gain = self.query_scale(d)
        if gain != 1.0:
            qh = qh * gain
        kh = k.permute(1, 2, 0, 3).unsqueeze(2).to(dt)
        vh = v.permute(1, 2, 0, 3).unsqueeze(2).to(dt)
        return qh, kh, vh

    def mix(self, x, attention_mask, rotary_pos_emb, state):
        qh, kh, vh = self.kernel_inputs(x, rotary_pos_emb)
        out = self.attend(qh, kh, vh, attention_mask, state)  # [b, g, rep, s, d_v]
        b, g, rep, s, d_v = out.shape
        return out.reshape(b, g * rep, s, d_v).permute(2, 0, 1, 3).reshape(s, b, g * rep * d_v).to(x.dtype)
