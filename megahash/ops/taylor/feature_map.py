"""The second-order Taylor kernel of Based ([Xue25] eq. 4.6; [Arora24]) and its feature map.

k(q, k) = 1 + s + s^2/2 with s = q.k/sqrt(d) equals phi(q).phi(k) for
phi(x) = [1, x/d^(1/4), x_i x_j w_ij (each unordered pair {i, j} once)] with w_ii = 1/sqrt(2d),
w_ij = 1/sqrt(d) (i != j): the upper triangle of the symmetric x x^T/(sqrt2 sqrt d), off-diagonal
entries counted twice through their weight, so D = 1 + d + d(d+1)/2 (2,145 at d = 64 instead of Based's 1 + d + d^2 = 4,161: half
the state and half the feature GEMMs, the same kernel)."""

from __future__ import annotations

import torch


def feature_dim(d: int) -> int:
    """D = 1 + d + d(d+1)/2."""
    return 1 + d + d * (d + 1) // 2


def taylor_features(x: torch.Tensor) -> torch.Tensor:
    """phi(x): [..., d] -> [..., 1 + d + d(d+1)/2], without a gather: the products x_i x_{i+o mod d}
    for offsets o = 0..(d-1)//2 are rows of ``x * window`` over a strided view of [x, x[:d//2]]
    (each unordered pair once), plus, for even d, the half row x_i x_{i+d/2} (i < d/2)."""
    d = x.shape[-1]
    h, rows = d // 2, (d + 1) // 2
    xs = x * d**-0.5
    parts = [torch.ones_like(x[..., :1]), x * d**-0.25, x * xs * 2**-0.5]
    if rows > 1:  # win[o, i] = x[(i + 1 + o) % d], o = 0..rows-2 (offsets 1..rows-1)
        win = torch.cat([x[..., 1:], x[..., : rows - 1]], dim=-1).unfold(-1, d, 1)
        parts.append((xs.unsqueeze(-2) * win).flatten(-2))
    if d % 2 == 0 and d > 1:
        parts.append(xs[..., :h] * x[..., h:])
    return torch.cat(parts, dim=-1)


def taylor_kernel(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """1 + s + s^2/2 with s = q k^T / sqrt(d): [..., L, d] x [..., T, d] -> [..., L, T]."""
    t = (q * q.shape[-1] ** -0.5) @ k.transpose(-1, -2)
    t = t.add_(1.0)  # t = 1 + s: k = (t^2 + 1)/2, two passes over the map
    return torch.addcmul(t.new_tensor(0.5), t, t, value=0.5)
