"""Recurrent form of Appendix I (eq. 4.14-4.17): token by token over the state (s0, s1, z1, s2, z2)
(decoding, and the oracle of the chunked form)."""
from __future__ import annotations

import torch

from megahash.ops.orders.chunk import first_order, scaled, thesis_den, thesis_sq, thesis_state


def orders_recurrent(q, k, v, state=None, offset: int = 0, positive: bool = False):
    """Eq. 4.14-4.17 token by token: returns (out [..., L, dv], state)."""
    q, k = scaled(q, k)
    outs = []
    for t in range(q.shape[-2]):
        new = thesis_state(k[..., t:t + 1, :], v[..., t:t + 1, :], positive)
        state = new if state is None else [a + b for a, b in zip(state, new)]
        s0, s1, z1, s2, z2 = state
        qt = first_order(positive)(q[..., t:t + 1, :])
        q2 = thesis_sq(q[..., t:t + 1, :])
        outs.append(s0.unsqueeze(-2) / float(offset + t + 1)
                    + (qt @ s1) / thesis_den((qt @ z1.unsqueeze(-1)).squeeze(-1)).unsqueeze(-1)
                    + (q2 @ s2) / thesis_den((q2 @ z2.unsqueeze(-1)).squeeze(-1)).unsqueeze(-1))
    return torch.cat(outs, dim=-2), tuple(state)
