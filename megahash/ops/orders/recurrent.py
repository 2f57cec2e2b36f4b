"""Recurrent form of Appendix I (eq. 4.14-4.17): token by token over the state (s0, s1, z1, s2, z2),
the test oracle of the chunked form (decoding runs :func:`megahash.ops.orders.chunk.orders_causal`
with the carried state)."""

from __future__ import annotations

import torch

from megahash.ops.orders.chunk import first_order, scaled, thesis_den, thesis_sq, thesis_state


def orders_recurrent(q, k, v, state=None, offset: int = 0, positive: bool = False, doc=None):
    """Eq. 4.14-4.17 token by token: returns (out [..., L, dv], state); ``doc`` [..., L] document ids:
    the state and the count restart at each document start."""
    q, k = scaled(q, k)
    outs = []
    count = torch.full(() if doc is None else doc.shape[:-1], float(offset), dtype=q.dtype)
    for t in range(q.shape[-2]):
        new = thesis_state(k[..., t : t + 1, :], v[..., t : t + 1, :], positive)
        if doc is not None and t > 0:
            keep = (doc[..., t] == doc[..., t - 1]).to(q.dtype)
            count = count * keep
            state = [a * keep.reshape(keep.shape + (1,) * (a.dim() - keep.dim())) for a in state]
        count = count + 1
        state = new if state is None else [a + b for a, b in zip(state, new)]
        s0, s1, z1, s2, z2 = state
        qt = first_order(positive)(q[..., t : t + 1, :])
        q2 = thesis_sq(q[..., t : t + 1, :])
        outs.append(
            s0.unsqueeze(-2) / count.reshape(count.shape + (1, 1))
            + (qt @ s1) / thesis_den((qt @ z1.unsqueeze(-1)).squeeze(-1)).unsqueeze(-1)
            + (q2 @ s2) / thesis_den((q2 @ z2.unsqueeze(-1)).squeeze(-1)).unsqueeze(-1)
        )
    return torch.cat(outs, dim=-2), tuple(state)
