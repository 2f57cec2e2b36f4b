"""Recurrent form of the gated delta rule, token by token (fla's ``naive_recurrent_gated_delta_rule``
written for megahash's layout): the test oracle (decoding runs
:func:`megahash.ops.gated_delta.chunk.gated_delta_causal` with the carried state)."""

from __future__ import annotations

import torch

from megahash.ops.gated_delta.chunk import l2norm


def gated_delta_recurrent(q, k, v, g, beta, state=None, doc=None, qk_l2norm: bool = False):
    """S_t = e^{g_t} (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T, o_t = S_t^T q_t / sqrt(d_k), on
    q, k [..., L, d_k], v [..., L, d_v], g, beta [..., L]: (out [..., L, d_v], S [..., d_k, d_v]).
    ``doc`` [..., L]: the state restarts at each document start (the state passed in belongs to document 0)."""
    if qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    q = q * q.shape[-1] ** -0.5
    lead = torch.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2], g.shape[:-1], beta.shape[:-1])
    h = torch.zeros(*lead, k.shape[-1], v.shape[-1], dtype=v.dtype, device=v.device)
    if state is not None:
        h = h + state
    outs = []
    for t in range(q.shape[-2]):
        if doc is not None:  # a new document (or, at t = 0, a document other than the state's) starts empty
            same = doc[..., t] == (doc[..., t - 1] if t > 0 else torch.zeros_like(doc[..., 0]))
            h = h * same.to(h.dtype)[..., None, None]
        h = h * g[..., t].exp()[..., None, None]
        k_t = k[..., t, :]
        u = beta[..., t, None] * (v[..., t, :] - (k_t.unsqueeze(-1) * h).sum(-2))
        h = h + k_t.unsqueeze(-1) * u.unsqueeze(-2)
        outs.append((q[..., t, :].unsqueeze(-1) * h).sum(-2))
    return torch.stack(outs, dim=-2), h
