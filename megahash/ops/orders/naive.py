"""Naive (quadratic) form of Appendix I (eq. 4.14-4.17): masked matrices over the whole sequence
(the test oracle; also the attention maps of the indicators)."""

from __future__ import annotations

import torch

from megahash.ops.orders.chunk import first_order, scaled, thesis_den, thesis_sq


def orders_maps(q, k, causal: bool = True, positive: bool = False):
    """(a0, a1 / den1, a2 / den2): the three normalised [..., L, T] maps of eq. 4.15-4.17
    (``positive``: the first order on elu(x) + 1 features, :mod:`megahash.ops.orders.chunk`)."""
    q, k = scaled(q, k)
    phi = first_order(positive)
    L, T = q.shape[-2], k.shape[-2]
    valid = torch.ones(L, T, dtype=torch.bool, device=q.device)
    valid = valid.tril(T - L) if causal else valid
    a1 = (phi(q) @ phi(k).transpose(-1, -2)) * valid
    a2 = (thesis_sq(q) @ thesis_sq(k).transpose(-1, -2)) * valid
    a0 = valid.to(q.dtype) / valid.sum(-1, keepdim=True)  # in q's dtype (bool / int would be fp32)
    return a0, a1 / thesis_den(a1.sum(-1, keepdim=True)), a2 / thesis_den(a2.sum(-1, keepdim=True))


def naive_orders(q, k, v, causal: bool = True, positive: bool = False):
    a0, a1, a2 = orders_maps(q, k, causal, positive)
    return (a0.to(v.dtype) + a1 + a2) @ v
