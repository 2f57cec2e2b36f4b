"""Recurrent form of causal linear attention, the test oracle of the chunked form (decoding runs the
chunked form with the carried state): S_i = S_{i-1} + phi(k_i)^T v_i, z_i = z_{i-1} + phi(k_i),
num_i = phi(q_i) S_i, den_i = phi(q_i) z_i."""

from __future__ import annotations

from collections.abc import Callable

import torch


def recurrent_linear(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    features: Callable,
    state: tuple | None = None,
    doc: torch.Tensor | None = None,
):
    """Token by token: (num [..., L, dv], den [..., L], state (S [..., D, dv], z [..., D])).
    ``doc`` [..., L] document ids: the state restarts (is zeroed) at each document start."""
    nums, dens = [], []
    for t in range(q.shape[-2]):
        if doc is not None and t > 0 and state is not None:
            keep = (doc[..., t] == doc[..., t - 1]).to(q.dtype)
            state = (state[0] * keep[..., None, None], state[1] * keep[..., None])
        fk = features(k[..., t, :])
        s_t = fk.unsqueeze(-1) * v[..., t, :].unsqueeze(-2)
        state = (s_t, fk) if state is None else (state[0] + s_t, state[1] + fk)
        fq = features(q[..., t, :])
        nums.append((fq.unsqueeze(-2) @ state[0]).squeeze(-2))
        dens.append((fq * state[1]).sum(-1))
    return torch.stack(nums, dim=-2), torch.stack(dens, dim=-1), state
