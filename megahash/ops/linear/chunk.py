"""Chunked causal linear attention: batched GEMMs over all chunks at once, the state carried by a
cumulative sum over chunks (Katharopoulos et al. 2020, eq. 4-6; the chunk form of Yang et al. 2024).

For a kernel K(q, k) = phi(q).phi(k) the causal sums are, for a query i in chunk c,

    num_i = sum_{j<=i, j in c} K(q_i, k_j) v_j + phi(q_i) S_{<c},   S_{<c} = sum_{c'<c} phi(K_c')^T V_c'
    den_i = sum_{j<=i, j in c} K(q_i, k_j)     + phi(q_i) z_{<c},   z_{<c} = sum_{c'<c} phi(K_c')^T 1

The sequence is cut into n chunks of C tokens (zero-padded at the end) and viewed as [..., n, C, f]:
the intra-chunk maps tril(K(Q_c, K_c)) are one batched GEMM ([..., n, C, C], L*C entries, never
L x L), the per-chunk states phi(K_c)^T V_c another, and S_{<c} is their exclusive cumulative sum
over the chunk axis. The number of operator calls does not depend on L.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F


def to_chunks(x: torch.Tensor, chunk: int) -> torch.Tensor:
    """[..., L, f] -> [..., n, C, f], zero-padded at the end to n*C >= L."""
    pad = (-x.shape[-2]) % chunk
    if pad:
        x = F.pad(x, (0, 0, 0, pad))
    return x.reshape(*x.shape[:-2], x.shape[-2] // chunk, chunk, x.shape[-1])


def exclusive_cumsum(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Sums of the entries before each one along ``dim`` (the first is 0), without cancellation."""
    c = torch.cumsum(x, dim)
    return torch.cat([torch.zeros_like(c.narrow(dim, 0, 1)), c.narrow(dim, 0, c.shape[dim] - 1)], dim)


def chunk_linear(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, features: Callable, kernel: Callable,
                 chunk: int, state: Optional[tuple] = None, need_state: bool = False):
    """(num [..., L, dv], den [..., L], state) of causal linear attention, chunked (module docstring).

    q [..., L, f], k [..., L, f], v [..., L, dv] (leading dims broadcast, e.g. q [b, g, rep, L, f]
    with k, v [b, g, 1, L, .]); ``kernel(qc, kc)`` = features(qc) @ features(kc)^T on [..., C, f]
    chunks; ``state`` = (S [..., D, dv], z [..., D]) of the keys before this call; the returned state
    (with ``need_state``) includes this call's keys. chunk >= L is the parallel (masked matrix) form."""
    L = q.shape[-2]
    C = max(1, min(chunk, L))
    qc, kc, vc = to_chunks(q, C), to_chunks(k, C), to_chunks(v, C)
    n = qc.shape[-3]
    a = kernel(qc, kc).tril()
    num, den = a @ vc, a.sum(-1)
    new_state = None
    if n > 1 or state is not None or need_state:
        fk = features(kc)  # [..., n, C, D]
        if n * C > L:  # padded keys carry phi(0), which need not be 0 (Taylor's constant feature)
            keep = torch.arange(n * C, device=q.device) < L
            fk = fk * keep.view(n, C, 1).to(fk.dtype)
        s_c, z_c = fk.transpose(-1, -2) @ vc, fk.sum(-2)  # per-chunk states [..., n, D, dv], [..., n, D]
        if n > 1 or state is not None:
            s_prev, z_prev = exclusive_cumsum(s_c, -3), exclusive_cumsum(z_c, -2)
            if state is not None:
                s_prev, z_prev = s_prev + state[0].unsqueeze(-3), z_prev + state[1].unsqueeze(-2)
            fq = features(qc)
            num = num + fq @ s_prev
            den = den + (fq @ z_prev.unsqueeze(-1)).squeeze(-1)
        if need_state:
            new_state = (s_c.sum(-3), z_c.sum(-2))
            if state is not None:
                new_state = (new_state[0] + state[0], new_state[1] + state[1])
    num = num.flatten(-3, -2)[..., :L, :]
    den = den.flatten(-2)[..., :L]
    return num, den, new_state
