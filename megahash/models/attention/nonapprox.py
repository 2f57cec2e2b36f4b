"""``nonapprox``: element-wise self-gating instead of pairwise similarity ([Xue25] sec. 4.3.3).

Eq. 4.7-4.8: Q = SiLU(H W^Q); K, V = H W^{K,V}; A = Softmax((Q (.) K) 1^T / sqrt(d_h)) normalised
across time steps. Each key position j gets ONE score per head from its own query and key,

    s_j = (q_j (.) k_j) . 1 / sqrt(d_h) = q_j . k_j / sqrt(d_h),

and, causally, o_i = sum_{j<=i} e^{s_j} v_j / sum_{j<=i} e^{s_j} (recurrent form eq. 4.18: the
numerator and the denominator are running sums, so the denominator grows with i). Computed
stably with a running maximum m_i = max_{j<=i} s_j:
num_i = e^{m_{i-1} - m_i} num_{i-1} + e^{s_i - m_i} v_i, den_i likewise, o_i = num_i / den_i.
RoPE is not applied: it would not change q_j . k_j (same position). With grouped-query attention
(model.num_query_groups) each query head uses its group's key.

Forms (one copy each, :mod:`megahash.ops.cumsoftmax`; equal to 1e-10 in fp64):
- scan (training, prefill, decoding): prefix sums relative to a running maximum in linear space
  (online softmax in two fixed levels, :mod:`megahash.ops.cumsoftmax.chunk`), no L x L map and no
  loop over chunks (``model.attention.options.chunk_size`` does not apply); fp32 (fp64 kept) with
  autocast disabled, error at a masked softmax's (docs/attention.md, Numerics); the carried state is the layer's
  decoding cache: ``m`` [b, g, rep], ``num`` [b, g, rep, d_h], ``den`` [b, g, rep] per head
  (numerator and denominator relative to e^m): Bd + 2Bh numbers, [Xue25] Table 4.8 cache of
  2Bd + 4Bh bytes at 16 bit;
- recurrent (token by token with the running maximum) and naive (the masked L x L softmax): oracles.
Encoders: o_i = sum_j softmax(s)_j v_j over all non-padded keys (the same vector for every i).
Packed documents (``ForwardState.document_ids``): the sums restart at each document start in every
form, without a loop over documents (docs/attention.md "Packed documents: linear and recurrent kinds").
Attention dropout is not applied. Parameters equal ``mha`` exactly.
"""

from __future__ import annotations

import math

import torch.nn.functional as F

from megahash.models.attention.linear_base import LinearAttention
from megahash.models.attention.maps import kernel_maps
from megahash.models.cost_formulas import StandardQKV
from megahash.models.mixing import cached_state, store_state
from megahash.models.registry import AttentionCaps, register_attention
from megahash.ops.cumsoftmax.chunk import cumsoftmax_bidirectional, cumsoftmax_causal
from megahash.ops.cumsoftmax.naive import cumsoftmax_map


class NonApprox(LinearAttention):
    """Q = SiLU(H W^Q), s_j = (q_j * k_j) . 1 / sqrt(d_h), o_i = sum_{j<=i} e^{s_j} v_j / sum_{j<=i} e^{s_j}
    (eq. 4.7-4.8, 4.18); decoding state (running max, numerator, denominator)."""

    def qkv(self, x, rotary_pos_emb):
        q, k, v = super().qkv(x, rotary_pos_emb)
        return F.silu(q), k, v  # eq. 4.8; no RoPE (q_j . k_j is position-invariant)

    def kernel(self, qh, kh, vh, km, cache, doc, offset):
        """eq. 4.7-4.8 on [b, g, rep, s, d], the decoding state (m, num, den) in ``cache``, sums restarting
        at the document starts of ``doc``."""
        sc = (qh * kh).sum(-1) / math.sqrt(qh.shape[-1])
        if not self.causal:
            return cumsoftmax_bidirectional(sc, vh, km, doc=doc)
        keys = ("m", "num", "den")
        out, state = cumsoftmax_causal(sc, vh, cached_state(cache, keys), cache is not None, doc=doc)
        store_state(cache, keys, state)
        return out


# ----------------------------------------------------------------------------- self-description
# (megahash.models.registry / megahash.catalog: costs and capabilities; nothing else in the library names the kind)


class NonApproxCosts(StandardQKV):
    """[Xue25] Tables 4.5-4.8, Non-apx. row: O(BLd^2); FLOPs 6BLd^2 / 6Bd^2; activations
    (8BLd + 4BLh)/t; cache 2Bd + 4Bh bytes. Implementation: running sums, Bn(d_h + 2) numbers."""

    @staticmethod
    def time_complexity(B, L, d):
        return B * L * d * d

    @staticmethod
    def flops(phase, B, L, d, h=None, g=None, precomputed=False):
        return 6 * B * L * d * d if phase == "prefill" else 6 * B * d * d

    @staticmethod
    def activation_bytes(B, L, d, h, t=1):
        return (8 * B * L * d + 4 * B * L * h) / t

    @staticmethod
    def cache_bytes(B, L, d, h, g=None):
        return 2 * B * d + 4 * B * h

    @staticmethod
    def cache_elements(B, L, n, d_h, g, **_):
        return B * n * (d_h + 2)


def nonapprox_maps(m, q, k, v, attention_mask) -> dict:
    """Indicators: A_ij = e^{s_j} / sum_{u<=i} e^{s_u} (j <= i), s_j = q_j.k_j / sqrt(d_h)
    (eq. 4.7-4.8, 4.18); logits = s_j, one per key."""
    s = (q.double() * k.double()).sum(-1) / math.sqrt(q.shape[-1])  # [b, g, rep, L]
    L = s.shape[-1]
    probs = cumsoftmax_map(s, m.causal)
    b = probs.shape[0]
    return {
        "source": "running softmax over keys e^{s_j}/sum_{u<=i} e^{s_u}, s_j = q_j.k_j/sqrt(d_h)",
        "probs": probs.reshape(b, -1, L, L),
        "logit_values": s,
        "check": lambda out: ((probs @ v.double()) - out.double()).abs().max().cpu(),
    }


register_attention(
    "nonapprox",
    NonApprox,
    costs=NonApproxCosts,
    maps=kernel_maps(nonapprox_maps),
    caps=AttentionCaps(thesis_name="Non-apx.", chapters=(4,)),
)
