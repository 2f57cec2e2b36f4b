"""Naive form of the batch-shared softmax map (autograd keeps the map): the oracle of
:class:`megahash.ops.shared_map.attend.SharedMapAttention`, and the path with attention dropout."""
from __future__ import annotations

import torch


def naive_shared_softmax(q, k, v, scale: float, causal: bool = True, dropout=None):
    """q [g, rep, L, d], k [g, 1, T, d], v [g, 1, T, e] -> [g, rep, L, e]."""
    s = (q @ k.transpose(-1, -2)) * scale
    if causal:
        L, T = s.shape[-2], s.shape[-1]
        s = s.masked_fill(torch.ones(L, T, dtype=torch.bool, device=s.device).triu(T - L + 1), float("-inf"))
    p = torch.softmax(s.to(torch.promote_types(s.dtype, torch.float32)), dim=-1).to(v.dtype)
    if dropout is not None:
        p = dropout(p)
    return p @ v
