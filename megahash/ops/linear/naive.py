"""Naive (parallel, quadratic) form of causal linear attention: the test oracle.
A = tril(K(Q, K)) over the whole sequence, num = A V, den = A 1."""

from __future__ import annotations

from collections.abc import Callable

import torch


def naive_linear(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kernel: Callable, causal: bool = True):
    """(num [..., L, dv], den [..., L]) from the full L x L kernel matrix (tril when causal)."""
    a = kernel(q, k)
    if causal:
        a = a.tril(a.shape[-1] - a.shape[-2])
    return a @ v, a.sum(-1)
