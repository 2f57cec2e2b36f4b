"""The second-order Taylor kernel of Based (thesis eq. 4.6; Arora et al. 2024) and its feature map.

k(q, k) = 1 + s + s^2/2 with s = q.k/sqrt(d) equals phi(q).phi(k) for
phi(x) = [1, x/d^(1/4), x_i x_j w_ij (i <= j)] with w_ii = 1/sqrt(2d), w_ij = 1/sqrt(d) (i < j): the
upper triangle of the symmetric x x^T/(sqrt2 sqrt d), off-diagonal entries counted twice through
their weight, so D = 1 + d + d(d+1)/2 (2,145 at d = 64 instead of Based's 1 + d + d^2 = 4,161: half
the state and half the feature GEMMs, the same kernel)."""
from __future__ import annotations

import math

import torch


def feature_dim(d: int) -> int:
    """D = 1 + d + d(d+1)/2."""
    return 1 + d + d * (d + 1) // 2


def taylor_features(x: torch.Tensor) -> torch.Tensor:
    """phi(x): [..., d] -> [..., 1 + d + d(d+1)/2]."""
    d = x.shape[-1]
    i, j = torch.triu_indices(d, d, device=x.device)
    w = torch.where(i == j, x.new_tensor(1.0 / math.sqrt(2.0 * d)), x.new_tensor(1.0 / math.sqrt(d)))
    x2 = x[..., i] * x[..., j] * w
    return torch.cat([torch.ones_like(x[..., :1]), x * d ** -0.25, x2], dim=-1)


def taylor_kernel(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """1 + s + s^2/2 with s = q k^T / sqrt(d): [..., L, d] x [..., T, d] -> [..., L, T]."""
    s = q @ k.transpose(-1, -2) * (1.0 / math.sqrt(q.shape[-1]))
    return torch.addcmul(s + 1, s, s, value=0.5)
