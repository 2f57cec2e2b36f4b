"""Naive form of the one-score-per-key softmax: the masked L x L softmax matrix (test oracle and
the indicators' attention map), A_ij = e^{s_j} / sum_{u<=i} e^{s_u} for j <= i."""

from __future__ import annotations

import torch


def cumsoftmax_map(s, causal: bool = True):
    """[..., L] scores -> [..., L, L] row-normalised map."""
    L = s.shape[-1]
    logits = s.unsqueeze(-2).expand(*s.shape[:-1], L, L)
    if causal:
        logits = logits.masked_fill(torch.ones(L, L, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    return torch.softmax(logits, dim=-1)


def naive_cumsoftmax(s, v, causal: bool = True):
    return cumsoftmax_map(s, causal).to(v.dtype) @ v
