"""The second-order Taylor kernel of Based (thesis eq. 4.6; Arora et al. 2024) and its feature map.

k(q, k) = 1 + s + s^2/2 with s = q.k/sqrt(d) equals phi(q).phi(k) for
phi(x) = [1, x/d^(1/4), vec(x x^T)/(sqrt2 sqrt d)] of dimension D = 1 + d + d^2."""
from __future__ import annotations

import math

import torch


def feature_dim(d: int) -> int:
    """D = 1 + d + d^2."""
    return 1 + d + d * d


def taylor_features(x: torch.Tensor) -> torch.Tensor:
    """phi(x): [..., d] -> [..., 1 + d + d^2]."""
    d = x.shape[-1]
    x2 = (x.unsqueeze(-1) * x.unsqueeze(-2)).flatten(-2) * (1.0 / (math.sqrt(2.0) * math.sqrt(d)))
    return torch.cat([torch.ones_like(x[..., :1]), x * d ** -0.25, x2], dim=-1)


def taylor_kernel(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """1 + s + s^2/2 with s = q k^T / sqrt(d): [..., L, d] x [..., T, d] -> [..., L, T]."""
    s = q @ k.transpose(-1, -2) * (1.0 / math.sqrt(q.shape[-1]))
    return torch.addcmul(s + 1, s, s, value=0.5)
