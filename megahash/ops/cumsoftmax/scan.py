"""A causal softmax with ONE score per key ([Xue25] eq. 4.7-4.8, 4.18) as a scan: O(L d) work.

o_i = sum_{j<=i} e^{s_j} v_j / sum_{j<=i} e^{s_j} needs no L x L map: numerator and denominator
are prefix sums. Computed stably in log space with ``torch.logcumsumexp`` (a running log-sum-exp,
i.e. cumulative sums with a running maximum); signed values through v = sinh(asinh v) =
(e^{asinh v} - e^{-asinh v})/2, two positive parts whose logs are +-asinh v:

    o_i = ( exp(P_i - Z_i) - exp(N_i - Z_i) ) / 2,   P = lcse(s + asinh v), N = lcse(s - asinh v), Z = lcse(s)

(lcse: ``logcumsumexp`` along the sequence); each term is at most |v| + 1, so nothing overflows
and a position never depends on later ones. No Python loop:
the operator count does not depend on L. A carried state (m, num, den) (numerator and denominator
relative to e^m, the decoding cache) enters as one virtual key of score m + log den and value
num/den placed before the sequence."""
from __future__ import annotations

import torch


def cumsoftmax_causal(s: torch.Tensor, v: torch.Tensor, state=None, need_state: bool = False):
    """s [..., L] scores, v [..., L, dv] (leading dims broadcast: s [b, g, rep, L], v [b, g, 1, L, dv]);
    ``state`` = (m [...], num [..., dv], den [...]) of the keys before. Returns (out [..., L, dv], state or None)."""
    m = s.detach().amax(-1)
    if state is not None:
        m0, num0, den0 = state
        m = torch.maximum(m, m0)
        lead = torch.broadcast_shapes(s.shape[:-1], v.shape[:-2])
        s = torch.cat([(m0 + torch.log(den0)).unsqueeze(-1).expand(*lead, 1), s.expand(*lead, s.shape[-1])], -1)
        v = torch.cat([(num0 / den0.unsqueeze(-1)).unsqueeze(-2).expand(*lead, 1, v.shape[-1]),
                       v.expand(*lead, *v.shape[-2:])], -2)
    a = torch.asinh(v)
    z = torch.logcumsumexp(s, -1).unsqueeze(-1)
    pn = torch.logcumsumexp(torch.cat([s.unsqueeze(-1) + a, s.unsqueeze(-1) - a], -1), -2)
    e = torch.exp(pn - z)
    dv = v.shape[-1]
    out = (e[..., :dv] - e[..., dv:]) * 0.5
    if state is not None:
        out = out[..., 1:, :]
    if not need_state:
        return out, None
    den = torch.exp(z[..., -1, 0] - m)
    return out, (m, out[..., -1, :] * den.unsqueeze(-1), den)


def cumsoftmax_bidirectional(s, v, key_mask=None):
    """Encoders: o = sum_j softmax(s)_j v_j over the non-padded keys, the same vector for every query."""
    if key_mask is not None:
        s = s.masked_fill(~key_mask, float("-inf"))
    w = torch.softmax(s, dim=-1)
    o = (w.unsqueeze(-2) @ v).squeeze(-2)
    return o.unsqueeze(-2).expand(*o.shape[:-1], s.shape[-1], o.shape[-1])
