"""Recurrent form of the one-score-per-key softmax (eq. 4.18) with a running maximum m_i:
num_i = e^{m_{i-1} - m_i} num_{i-1} + e^{s_i - m_i} v_i, den_i likewise, o_i = num_i / den_i
(the state is (m, num, den)): the test oracle (decoding runs
:func:`megahash.ops.cumsoftmax.chunk.cumsoftmax_causal` with the carried state)."""

from __future__ import annotations

import torch


def cumsoftmax_recurrent(s, v, state=None, doc=None):
    """Token by token: (out [..., L, dv], (m, num, den)); ``doc`` [..., L] document ids: the state
    restarts at each document start."""
    outs = []
    for t in range(s.shape[-1]):
        s_t, v_t = s[..., t], v[..., t, :]
        if doc is not None and t > 0:  # a document start: the previous document's state weighs 0
            new = doc[..., t] != doc[..., t - 1]
            m_prev, num_prev, den_prev = state
            state = (
                torch.where(new, s_t, m_prev),
                num_prev * (~new).to(v.dtype).unsqueeze(-1),
                den_prev * (~new).to(v.dtype),
            )
        if state is None:
            m, num, den = s_t, v_t.expand(*s_t.shape, v_t.shape[-1]), torch.ones_like(s_t)
        else:
            m_prev, num_prev, den_prev = state
            m = torch.maximum(m_prev, s_t)
            a, e = torch.exp(m_prev - m), torch.exp(s_t - m)
            num = a.unsqueeze(-1) * num_prev + e.unsqueeze(-1) * v_t
            den = a * den_prev + e
        state = (m, num, den)
        outs.append(num / den.unsqueeze(-1))
    return torch.stack(outs, dim=-2), state
