"""``approx-thesis``: the [Xue25] Approximate attention in its Appendix I form (eq. 4.6, 4.14-4.17).

The second-order Taylor expansion of softmax (eq. 4.6, A ~ Taylor(Q K^T / sqrt(d_h))) written as
the recurrence of Appendix I, where the zeroth, first and second order terms are each normalised
by their OWN denominator and the second order uses element-wise squares (d_h features, not the
d_h^2 outer products of Based's shared-denominator kernel, kind ``approx``):

    o_i    = o_0i + o_1i + o_2i                                                          (4.14)
    o_0i   = (sum_{j<=i} v_j) / i                                                        (4.15)
    o_1i   = q_i (sum_{j<=i} k_j^T v_j) / q_i (sum_{j<=i} k_j^T)                          (4.16)
    o_2i   = (q_i^2/sqrt2) (sum_{j<=i} (k_j^2/sqrt2)^T v_j) / (q_i^2/sqrt2) (sum_{j<=i} (k_j^2/sqrt2)^T)   (4.17)

q, k are the RoPE-rotated heads of Q, K = H W^{Q,K} (eq. 4.3) scaled by d_h^(-1/4), so q.k is the
s = q.k/sqrt(d_h) of eq. 4.6 (each term is a ratio homogeneous in q and in k, so the scale only
matters numerically). The first-order denominator q_i . sum k_j has no sign: a denominator with
|den| < 1e-6 is replaced by +-1e-6 (keeping its sign), the only deviation from the equations.

Conditioning (docs/attention.md "Numerics"): with no sign, eq. 4.16's denominator crosses 0 and the
literal form is ill-conditioned (random unit-variance inputs at L=4096: max |o| ~4e4, median 1.1;
rounding q, k to bf16 moves the output by ~1.5 relative in exact arithmetic), and it is not a Taylor
expansion of softmax (its second order is sum_a q_a^2 k_a^2, not (q.k)^2). It stays the default
(``model.attention.options.denominator=literal``: what the thesis ran).
``denominator=positive`` is the stabilised option: the first order on the positive feature map
phi(x) = elu(x) + 1 of [Katharopoulos20] (eq. 7; the positive kernels of Based and other
linear-attention work), so each order is a convex combination of the values and |o_i| <= 3 max |v_j|.
The kernels accumulate in fp32 inside autocast (:mod:`megahash.ops.utils.fp32`).

State (per key/value head, after i tokens): s0 = sum v_j [d_h], s1 = sum k_j^T v_j [d_h, d_h],
z1 = sum k_j [d_h], s2 = sum (k_j^2/sqrt2)^T v_j [d_h, d_h], z2 = sum k_j^2/sqrt2 [d_h]: 2 d_h^2 + 3 d_h
numbers per head (the count i is the decoding position), i.e. 3Bd + 2Bd^2/h numbers = the
6Bd + 4Bd^2/h bytes of Table 4.8 at 16 bit. This is the form the [Xue25] cost tables
(Tables 4.5-4.8, "Approx.") describe; ``approx`` is Based's kernel (one shared denominator, the
form [Arora24] train), whose state is (1 + d_h + d_h^2)(d_h + 1) per head.

Forms (one copy each, :mod:`megahash.ops.orders`; equal to 1e-10 in fp64 to a loop written from
eq. 4.14-4.17):
- chunked (training, prefill): the zeroth order is a cumulative sum; the first and second orders
  are ONE chunked linear-attention call on the two feature maps stacked (masked matrices inside
  chunks of C tokens, the states between chunks carried by a cumulative sum over chunks: batched
  GEMMs, no Python loop), ``model.attention.options.chunk_size`` (0 = 128); chunk >= L is the parallel form;
- recurrent (decoding: the chunked form on one token with the carried state in the layer's decoding
  cache: ``s0``, ``s1``, ``z1``, ``s2``, ``z2``, each [b, g, 1, ...]; token-by-token loop: the oracle);
- naive: the three masked L x L maps (the indicators' maps, and a test oracle).
Encoders use the non-causal sums over the non-padded keys.
Packed documents (``ForwardState.document_ids``): the sums restart at each document start in every
form, without a loop over documents (docs/attention.md "Packed documents: linear and recurrent kinds"). No attention dropout. Parameters equal
``mha`` exactly (``linear_q``, ``linear_kv``, ``linear_proj``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from megahash.errors import ConfigError
from megahash.models.attention.linear_base import LinearAttention
from megahash.models.attention.maps import kernel_maps
from megahash.models.cost_formulas import ApproxRow
from megahash.models.mixing import cached_state, rope, store_state
from megahash.models.registry import AttentionCaps, register_attention
from megahash.ops.orders.chunk import orders_bidirectional, orders_causal
from megahash.ops.orders.naive import orders_maps

DENOMINATORS = ("literal", "positive")


class ThesisTaylor(LinearAttention):
    """Appendix I (eq. 4.14-4.17): the three orders normalised separately, element-wise squares, RoPE;
    decoding state (s0, s1, z1, s2, z2)."""

    def build(self, parts):
        super().build(parts)
        self.chunk_size = self.setup.option("chunk_size", 0)
        self.denominator = self.setup.option("denominator", "literal")
        if self.denominator not in DENOMINATORS:
            raise ConfigError(
                f"model.attention.options.denominator={self.denominator!r}: expected one of {', '.join(DENOMINATORS)}"
            )
        self.positive = self.denominator == "positive"

    def qkv(self, x, rotary_pos_emb):
        q, k, v = super().qkv(x, rotary_pos_emb)
        return rope(q, rotary_pos_emb), rope(k, rotary_pos_emb), v

    def query_scale(self, d: int) -> float:
        """No score scale to change under muP: eq. 4.15-4.17 are ratios homogeneous of degree 0 in q (the
        literal form), and the positive form's elu + 1 features take q, k at d^(-1/4) as [Katharopoulos20]'s
        take them unscaled; muP's initialisation and learning rates apply as to every kind."""
        return 1.0

    def kernel(self, qh, kh, vh, km, cache, doc, offset):
        """eq. 4.14-4.17 on [b, g, rep, s, d], the decoding state (s0, s1, z1, s2, z2) in ``cache``, sums
        restarting at the document starts of ``doc``."""
        if not self.causal:
            return orders_bidirectional(qh, kh, vh, km, positive=self.positive, doc=doc)
        keys = ("s0", "s1", "z1", "s2", "z2")
        state = cached_state(cache, keys)
        out, state = orders_causal(
            qh,
            kh,
            vh,
            self.chunk_size or 128,
            state,
            offset if state else 0,
            cache is not None,
            positive=self.positive,
            doc=doc,
        )
        store_state(cache, keys, state)
        return out


# ----------------------------------------------------------------------------- self-description
# (megahash.models.registry / megahash.catalog: costs and capabilities; nothing else in the library names the kind)


class ApproxThesisCosts(ApproxRow):
    """The [Xue25] Approx. rows of Tables 4.5-4.8 (this is the form they describe); decode state
    numbers per layer: g key/value heads x (2 d_h^2 + 3 d_h) per sequence."""

    @staticmethod
    def cache_elements(B, L, n, d_h, g, **_):
        return B * g * (2 * d_h * d_h + 3 * d_h)


def approx_thesis_maps(m, q, k, v, attention_mask) -> dict:
    """Indicators: (1/i + first-order/its sum + second-order/its sum)/3 of eq. 4.14-4.17 (rows sum
    to 1; the first-order term can be negative); checked against the kind's own function in fp64
    (its first-order denominator q.sum(k) can be near 0, which amplifies the fp32 round-off)."""
    a0, a1, a2 = orders_maps(q.double(), k.double(), m.causal, m.positive)  # eq. 4.14-4.17: o_i = sum_j 3 A_ij v_j
    L = a0.shape[-1]
    probs = (a0 + a1 + a2) / 3
    valid = a0 > 0
    s = (q.double() @ k.double().transpose(-1, -2)) / math.sqrt(q.shape[-1])
    b = probs.shape[0]

    def check(out):
        qd, kd, vd = q.double(), k.double(), v.double()
        ref = (
            orders_causal(qd, kd, vd, L, positive=m.positive)[0]
            if m.causal
            else orders_bidirectional(qd, kd, vd, positive=m.positive)
        )
        return ((3 * probs @ vd) - ref).abs().max().cpu()

    return {
        "source": "(1/i + first-order/its sum + second-order/its sum)/3 of eq. 4.14-4.17 "
        "(rows sum to 1; the first-order term can be negative)",
        "probs": probs.reshape(b, -1, L, L),
        "logits": s.expand_as(probs).reshape(b, -1, L, L),
        "valid": valid,
        "check": check,
    }


@dataclass(frozen=True)
class ApproxThesisOptions:
    """``model.attention.options`` of approx-thesis: the chunked form's chunk length; the first-order
    denominator: ``literal`` (eq. 4.16 as the thesis ran it, no sign) or ``positive`` (elu + 1 features,
    [Katharopoulos20]; bounded)."""

    chunk_size: int = 0  # chunk length of the chunked form (0 = auto)
    denominator: str = "literal"  # literal (eq. 4.16) | positive (elu(x) + 1 first-order features)
    RANGES = {"chunk_size": (0, None, False, False, "chunk length; 0 = auto")}


register_attention(
    "approx-thesis",
    ThesisTaylor,
    costs=ApproxThesisCosts,
    options=ApproxThesisOptions,
    caps=AttentionCaps(thesis_name="Approx."),
    maps=kernel_maps(approx_thesis_maps),
    export_spec=lambda att: {"chunk_size": int(att.chunk_size or 0), "denominator": att.denominator},
)
