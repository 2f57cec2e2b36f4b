"""Naive form of the batch-shared softmax map (autograd keeps the map): the oracle of
:class:`megahash.ops.shared_map.parallel.SharedMapAttention`, and the path with attention dropout.
Same precision: autocast disabled, scores and softmax in float32 (float64 kept), P V in v's dtype."""

from __future__ import annotations

import torch

from megahash.ops.utils.fp32 import no_autocast


def scores(q, k, scale: float, causal: bool, key_mask=None):
    """S = Q K^T * scale in float32 at least (inputs upcast: bf16 products are exact), masked with
    -inf before any exponential: causal (key t visible to query i iff t <= i + T - L) and, with
    ``key_mask`` [b, T] (True = valid), per sequence -> [b, g, rep, L, T]. Call with autocast disabled."""
    dt = torch.promote_types(q.dtype, torch.float32)
    s = (q.to(dt) @ k.to(dt).transpose(-1, -2)).mul_(scale)
    if causal:
        L, T = s.shape[-2], s.shape[-1]
        s = s.masked_fill_(torch.ones(L, T, dtype=torch.bool, device=s.device).triu(T - L + 1), float("-inf"))
    if key_mask is not None:
        s = s.unsqueeze(0).masked_fill(~key_mask[:, None, None, None, :], float("-inf"))
    return s


def naive_shared_softmax(q, k, v, scale: float, causal: bool = True, dropout=None, key_mask=None):
    """q [g, rep, L, d], k [g, 1, T, d], v [g, 1, T, e] -> [g, rep, L, e]; with ``key_mask`` [b, T]:
    v [b, g, 1, T, e] -> [b, g, rep, L, e] (a row with no valid key gives 0)."""
    with no_autocast(q):
        p = torch.softmax(scores(q, k, scale, causal, key_mask), dim=-1)
        if key_mask is not None:
            p = p.nan_to_num(0.0)
        p = p.to(v.dtype)
        if dropout is not None:
            p = dropout(p)
        return p @ v
