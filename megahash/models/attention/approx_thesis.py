"""``approx-thesis``: the thesis's Approximate attention in its Appendix I form (eq. 4.6, 4.14-4.17).

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

State (per key/value head, after i tokens): s0 = sum v_j [d_h], s1 = sum k_j^T v_j [d_h, d_h],
z1 = sum k_j [d_h], s2 = sum (k_j^2/sqrt2)^T v_j [d_h, d_h], z2 = sum k_j^2/sqrt2 [d_h]: 2 d_h^2 + 3 d_h
numbers per head (the count i is the decoding position), i.e. 3Bd + 2Bd^2/h numbers = the
6Bd + 4Bd^2/h bytes of Table 4.8 at 16 bit. This is the form the thesis's cost tables
(Tables 4.5-4.8, "Approx.") describe; ``approx`` is Based's kernel (one shared denominator, the
form Arora et al. 2024 train), whose state is (1 + d_h + d_h^2)(d_h + 1) per head.

Forms (equal, tested to 1e-10 in fp64 against a loop written from eq. 4.14-4.17):
- parallel: chunk = L, the causal masked matrices tril(q k^T) and tril(q^2 k^2^T / 2) (quadratic);
- chunked (training default): masked matrices inside chunks of C tokens plus the state between
  chunks, O(L C d + L d^2/h) time, linear in L; ``model.attention.chunk_size`` (0 = 128);
- recurrent (:func:`thesis_recurrent`, and decoding): the state above in ``decode_cache``
  (``s0``, ``s1``, ``z1``, ``s2``, ``z2``, each [b, g, 1, ...]).
Encoders use the non-causal sums over the non-padded keys. No attention dropout. Parameters equal
``mha`` exactly (``linear_q``, ``linear_kv``, ``linear_proj``).
"""
from __future__ import annotations

# ---- plain-torch reference (@register_reference; copied into the HF export): torch-only imports above its code
from megahash.models.registry import register_reference
from megahash.models.torch_model import LinearAttention
from megahash.models.torch_ops import orders_bidirectional, orders_causal


@register_reference("approx-thesis")
class ThesisTaylorReference(LinearAttention):
    """Appendix I (eq. 4.14-4.17): the three orders normalised separately, element-wise squares, RoPE;
    decoding state (s0, s1, z1, s2, z2)."""

    def kernel(self, qh, kh, vh, km, cache, ctx):
        if not self.causal:
            return orders_bidirectional(qh, kh, vh, km)
        keys = ("s0", "s1", "z1", "s2", "z2")
        state = tuple(cache[k_] for k_ in keys) if cache is not None and "s0" in cache else None
        out, state = orders_causal(qh, kh, vh, self.chunk_size or 128, state, ctx.get("offset", 0) if state else 0,
                                   cache is not None)
        if cache is not None:
            cache.update(zip(keys, state))
        return out


# ---- megatron-core implementation
import math

import torch
from megatron.core.transformer.spec_utils import ModuleSpec

from megahash.models.attention.approx import LinearAttentionBase
from megahash.models.attention.base import rope
from megahash.models.registry import mask_type, register_attention
# one copy of the kernels of eq. 4.14-4.17: the plain-torch reference's (causal, chunked; encoder form)
from megahash.models.torch_ops import orders_bidirectional as thesis_bidirectional
from megahash.models.torch_ops import orders_causal as thesis_causal
from megahash.models.torch_ops import thesis_den as safe_den, thesis_sq as sq, thesis_state as _new_state

STATE_KEYS = ("s0", "s1", "z1", "s2", "z2")


def scaled(q: torch.Tensor, k: torch.Tensor):
    s = q.shape[-1] ** -0.25
    return q * s, k * s


def _combine(num0, cnt, num1, den1, num2, den2):
    return num0 / cnt.unsqueeze(-1) + num1 / safe_den(den1).unsqueeze(-1) + num2 / safe_den(den2).unsqueeze(-1)


def thesis_recurrent(q, k, v, state=None, offset: int = 0):
    """Eq. 4.14-4.17 token by token (reference / decoding): returns (out, state)."""
    q, k = scaled(q, k)
    outs = []
    for t in range(q.shape[-2]):
        new = _new_state(k[..., t:t + 1, :], v[..., t:t + 1, :])
        state = new if state is None else [a + b for a, b in zip(state, new)]
        s0, s1, z1, s2, z2 = state
        qt = q[..., t:t + 1, :]
        q2 = sq(qt)
        cnt = torch.full((1,), float(offset + t + 1), dtype=q.dtype, device=q.device)
        out = _combine(s0.unsqueeze(-2), cnt, qt @ s1, (qt @ z1.unsqueeze(-1)).squeeze(-1),
                       q2 @ s2, (q2 @ z2.unsqueeze(-1)).squeeze(-1))
        outs.append(out)
    return torch.cat(outs, dim=-2), tuple(state)


class ApproxThesisAttention(LinearAttentionBase):
    kind = "approx-thesis"

    def qkv(self, x, rotary_pos_emb):
        q, k, v = super().qkv(x, rotary_pos_emb)
        return rope(q, rotary_pos_emb, self.config), rope(k, rotary_pos_emb, self.config), v

    def attend(self, q, k, v, attention_mask):
        if not self.causal:
            key_mask = self.key_padding(attention_mask, q.shape[0])
            key_mask = None if key_mask is None else key_mask[:, None, None, :]
            return thesis_bidirectional(q, k, v, key_mask)
        cache = self.cache()
        state, offset = None, 0
        if cache is not None and "s0" in cache:
            state = tuple(cache[key] for key in STATE_KEYS)
            offset = int(self.context().get("offset", 0))
        out, state = thesis_causal(q, k, v, self.chunk_size or 128, state, offset, need_state=cache is not None)
        if cache is not None:
            cache.update(zip(STATE_KEYS, state))
        return out


# ----------------------------------------------------------------------------- self-description
# (megahash.models.registry / catalog: costs and capabilities; nothing else in the library names the kind)

from megahash.models.attention.approx import ApproxCosts  # noqa: E402
from megahash.models.registry import AttentionCaps  # noqa: E402


class ApproxThesisCosts(ApproxCosts):
    """The thesis's Approx. rows of Tables 4.5-4.8 (this is the form they describe); decode state
    numbers per layer: g key/value heads x (2 d_h^2 + 3 d_h) per sequence."""

    @staticmethod
    def cache_elements(B, L, n, d_h, g, **_):
        return B * g * (2 * d_h * d_h + 3 * d_h)


def approx_thesis_maps(m, q, k, v, attention_mask) -> dict:
    """Indicators: (1/i + first-order/its sum + second-order/its sum)/3 of eq. 4.14-4.17 (rows sum
    to 1; the first-order term can be negative); checked against the kind's own function in fp64
    (its first-order denominator q.sum(k) can be near 0, which amplifies the fp32 round-off)."""
    qs, ks = scaled(q.double(), k.double())  # eq. 4.14-4.17: o_i = sum_j 3 A_ij v_j
    L = qs.shape[-2]
    valid = torch.ones(L, L, dtype=torch.bool, device=qs.device)
    valid = valid.tril() if m.causal else valid
    a1 = (qs @ ks.transpose(-1, -2)) * valid
    a2 = (sq(qs) @ sq(ks).transpose(-1, -2)) * valid
    a0 = valid / valid.sum(-1, keepdim=True)
    probs = (a0 + a1 / safe_den(a1.sum(-1, keepdim=True)) + a2 / safe_den(a2.sum(-1, keepdim=True))) / 3
    s = (q.double() @ k.double().transpose(-1, -2)) / math.sqrt(q.shape[-1])
    b = probs.shape[0]

    def check(out):
        qd, kd, vd = q.double(), k.double(), v.double()
        ref = thesis_causal(qd, kd, vd, L)[0] if m.causal else thesis_bidirectional(qd, kd, vd)
        return ((3 * probs @ vd) - ref).abs().max().cpu()

    return {"source": "(1/i + first-order/its sum + second-order/its sum)/3 of eq. 4.14-4.17 "
                      "(rows sum to 1; the first-order term can be negative)",
            "probs": probs.reshape(b, -1, L, L), "logits": s.expand_as(probs).reshape(b, -1, L, L), "valid": valid,
            "check": check}


@register_attention("approx-thesis", costs=ApproxThesisCosts, caps=AttentionCaps(thesis_name="Approx."),
                    maps=approx_thesis_maps)
def approx_thesis_spec(cfg) -> ModuleSpec:
    return ModuleSpec(module=ApproxThesisAttention, params={"attn_mask_type": mask_type(cfg), "cfg": cfg})
