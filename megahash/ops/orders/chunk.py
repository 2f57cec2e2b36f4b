"""Appendix I of [Xue25] (eq. 4.14-4.17): o_i = o_0i + o_1i + o_2i, each order normalised by its
own denominator; chunked (training, prefill, and decoding with the carried state) and
bidirectional (encoders) forms.

    o_0i = (sum_{j<=i} v_j) / i                                             (4.15)  a cumulative sum
    o_1i = q_i (sum_{j<=i} k_j^T v_j) / q_i (sum_{j<=i} k_j^T)               (4.16)
    o_2i = q2_i (sum_{j<=i} k2_j^T v_j) / q2_i (sum_{j<=i} k2_j^T),  x2 = x^2/sqrt2   (4.17)

q, k are scaled by d^(-1/4) (so q.k is the s = q.k/sqrt(d) of eq. 4.6). Orders 1 and 2 are causal
linear attention with the identity feature map on (q, k) and (q2, k2): both run as ONE call of
:func:`megahash.ops.linear.chunk.chunk_linear` on the two stacked along a leading axis. A first- or
second-order denominator with |den| < 1e-6 is replaced by +-1e-6 (keeping its sign).

Conditioning: eq. 4.16's denominator q_i . sum_{j<=i} k_j has no sign, so it crosses 0 and the first
order is unbounded (random unit-variance q, k, v at L=4096: max |o| ~ 4e4, median 1.1; rounding q, k
to bf16 alone moves the output by 1.5 relative, fp32 by 7e-4: docs/attention.md "Numerics").
``positive=True`` is the stabilised option (``model.attention.options.denominator=positive``): the
first order uses the feature map phi(x) = elu(x) + 1 of [Katharopoulos20] eq. 7 on q and k,

    o_1i = phi(q_i) (sum_{j<=i} phi(k_j)^T v_j) / phi(q_i) (sum_{j<=i} phi(k_j)^T)      (4.16, phi > 0)

so every weight phi(q_i).phi(k_j) > 0 and o_1i is a convex combination of v_1..v_i, as o_0i is and
o_2i already is (q^2 . k^2 >= 0): |o_i| <= 3 max_j |v_j|.
State (per key/value head): s0 = sum v [dv], s1 = sum k^T v [d, dv], z1 = sum k [d],
s2 = sum k2^T v, z2 = sum k2 (2 d dv + 2 d + dv numbers); the decoding position gives the count."""

from __future__ import annotations

import math

import torch

from megahash.ops.linear.chunk import chunk_linear
from megahash.ops.utils.documents import first_index, pair_mask
from megahash.ops.utils.fp32 import fp32_kernel


def thesis_sq(x):
    """x2 = x^2 / sqrt2 (eq. 4.17)."""
    return x.square() * (1.0 / math.sqrt(2.0))


def thesis_den(den):
    """den with |den| < 1e-6 replaced by +-1e-6 (sign kept)."""
    return torch.where(den >= 0, den.clamp_min(1e-6), den.clamp_max(-1e-6))


def first_order(positive: bool):
    """The first order's feature map: the identity (eq. 4.16) or elu(x) + 1 (``positive``)."""
    return positive_features if positive else _identity


def positive_features(x):
    """phi(x) = elu(x) + 1 > 0 ([Katharopoulos20] eq. 7)."""
    return torch.nn.functional.elu(x) + 1.0


def scaled(q, k):
    s = q.shape[-1] ** -0.25
    return q * s, k * s


def thesis_state(k, v, positive: bool = False):
    """(s0, s1, z1, s2, z2) of the (scaled) keys k [..., L, d] and values v [..., L, dv]."""
    k1, k2 = first_order(positive)(k), thesis_sq(k)
    return [v.sum(-2), k1.transpose(-1, -2) @ v, k1.sum(-2), k2.transpose(-1, -2) @ v, k2.sum(-2)]


def _dot(a, b):
    return a @ b.transpose(-1, -2)


def _identity(x):
    return x


@fp32_kernel
def orders_causal(
    q, k, v, chunk: int = 128, state=None, offset: int = 0, need_state: bool = False, positive: bool = False, doc=None
):
    """Causal eq. 4.14-4.17: q [..., L, d], k/v [..., L, .] (leading dims broadcast); ``state`` the
    (s0, s1, z1, s2, z2) of the ``offset`` tokens before; ``positive``: the stabilised first order;
    ``doc`` [..., L] document ids: every order restarts at each document start (the zeroth order's
    sum and count i run from the document's first token; ``state`` and ``offset`` belong to document 0).
    Returns (out [..., L, dv] in q's dtype, fp32 inside autocast, state or None)."""
    q, k = scaled(q, k)
    L = q.shape[-2]
    phi = first_order(positive)
    qq, kk = torch.stack([phi(q), thesis_sq(q)]), torch.stack([phi(k), thesis_sq(k)])
    lin_state = None
    if state is not None:
        s0, s1, z1, s2, z2 = state
        lin_state = (torch.stack([s1, s2]), torch.stack([z1, z2]))
    num, den, lin_state = chunk_linear(
        qq, kk, v.unsqueeze(0), _identity, _dot, chunk or 128, lin_state, need_state, doc
    )
    if doc is None:
        num0 = torch.cumsum(v, -2)
        if state is not None:
            num0 = num0 + s0.unsqueeze(-2)
        cnt = torch.arange(offset + 1, offset + L + 1, dtype=q.dtype, device=q.device)
    else:
        num0, cnt = _zeroth_documents(v, doc, s0 if state is not None else None, offset)
    out = num0 / cnt.unsqueeze(-1) + (num / thesis_den(den).unsqueeze(-1)).sum(0)
    if not need_state:
        return out, None
    s0_new = num0[..., -1, :]
    (s1, s2), (z1, z2) = lin_state[0].unbind(0), lin_state[1].unbind(0)
    return out, (s0_new, s1, z1, s2, z2)


def _zeroth_documents(v, doc, s0, offset):
    """Eq. 4.15 per document: (sum of v_j over the document's tokens j <= i [..., L, dv], their count
    [..., L]) from the row's cumulative sum minus its value before the document's first token
    (gathered: no loop over documents); ``s0``/``offset`` (a carried state) join document 0."""
    first = first_index(doc)  # [..., L]
    ex = torch.cat([torch.zeros_like(v[..., :1, :]), torch.cumsum(v, -2)], -2)  # [..., L + 1, dv]
    lead = torch.broadcast_shapes(ex.shape[:-2], first.shape[:-1])
    ex = ex.expand(*lead, *ex.shape[-2:])
    idx = torch.arange(1, v.shape[-2] + 1, device=v.device)
    num0 = ex[..., 1:, :] - torch.gather(
        ex, -2, first.expand(*lead, first.shape[-1]).unsqueeze(-1).expand(*lead, first.shape[-1], ex.shape[-1])
    )
    cnt = (idx - first).to(v.dtype)
    if s0 is not None:
        in0 = (doc == 0).to(v.dtype)
        num0 = num0 + in0.unsqueeze(-1) * s0.unsqueeze(-2)
        cnt = cnt + offset * in0
    return num0, cnt


@fp32_kernel
def orders_bidirectional(q, k, v, key_mask=None, positive: bool = False, doc=None):
    """Encoders: the sums over every (non-padded) key, the same state for every query; ``doc``
    [..., L]: over the keys of the query's document (the three maps masked block-diagonally)."""
    q, k = scaled(q, k)
    if doc is not None:
        valid = pair_mask(doc, key_mask).to(q.dtype)
        phi = first_order(positive)
        a1 = (phi(q) @ phi(k).transpose(-1, -2)) * valid
        a2 = (thesis_sq(q) @ thesis_sq(k).transpose(-1, -2)) * valid
        return (
            (valid / valid.sum(-1, keepdim=True)) @ v
            + (a1 @ v) / thesis_den(a1.sum(-1, keepdim=True))
            + (a2 @ v) / thesis_den(a2.sum(-1, keepdim=True))
        )
    if key_mask is not None:
        w = key_mask.unsqueeze(-1).to(k.dtype)
        k, v, cnt = k * w, v * w, w.sum(-2)
    else:
        cnt = torch.full((1,), float(k.shape[-2]), dtype=k.dtype, device=k.device)
    s0, s1, z1, s2, z2 = thesis_state(k, v, positive)
    if key_mask is not None and positive:  # phi(0) = 1: drop the padded keys from z1 (s1 has v = 0 there)
        z1 = (positive_features(k) * w).sum(-2)
    q1, q2 = first_order(positive)(q), thesis_sq(q)
    return (
        (s0 / cnt).unsqueeze(-2)
        + (q1 @ s1) / thesis_den((q1 @ z1.unsqueeze(-1)).squeeze(-1)).unsqueeze(-1)
        + (q2 @ s2) / thesis_den((q2 @ z2.unsqueeze(-1)).squeeze(-1)).unsqueeze(-1)
    )
