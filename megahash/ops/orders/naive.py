"""Naive (quadratic) form of Appendix I (eq. 4.14-4.17): masked matrices over the whole sequence
(the test oracle; also the attention maps of the indicators)."""
from __future__ import annotations

import torch

from megahash.ops.orders.chunk import scaled, thesis_den, thesis_sq


def orders_maps(q, k, causal: bool = True):
    """(a0, a1 / den1, a2 / den2): the three normalised [..., L, T] maps of eq. 4.15-4.17."""
    q, k = scaled(q, k)
    L, T = q.shape[-2], k.shape[-2]
    valid = torch.ones(L, T, dtype=torch.bool, device=q.device)
    valid = valid.tril(T - L) if causal else valid
    a1 = (q @ k.transpose(-1, -2)) * valid
    a2 = (thesis_sq(q) @ thesis_sq(k).transpose(-1, -2)) * valid
    a0 = valid / valid.sum(-1, keepdim=True)
    return a0, a1 / thesis_den(a1.sum(-1, keepdim=True)), a2 / thesis_den(a2.sum(-1, keepdim=True))


def naive_orders(q, k, v, causal: bool = True):
    a0, a1, a2 = orders_maps(q, k, causal)
    return (a0.to(v.dtype) + a1 + a2) @ v
