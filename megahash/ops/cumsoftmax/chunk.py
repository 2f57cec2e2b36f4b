"""Chunked form of the causal softmax with ONE score per key ([Xue25] eq. 4.7-4.8, 4.18), without an
L x L map: training, prefill and decoding (the new tokens with the carried state).

o_i = sum_{j<=i} e^{s_j} v_j / sum_{j<=i} e^{s_j}: numerator and denominator are prefix sums, kept
(as online-softmax / flash kernels do, [Mil18], [Dao22]) relative to a running maximum, in linear
space: a state (m, num, den) means num = sum e^{s_j - m} v_j, den = sum e^{s_j - m}, and two states
combine exactly by rescaling to the larger maximum,

    (m1, n1, d1) + (m2, n2, d2) = (m, e^{m1-m} n1 + e^{m2-m} n2, e^{m1-m} d1 + e^{m2-m} d2),  m = max(m1, m2).

Two fixed levels (no Python loop: the operator count does not depend on L):

1. inside each chunk of C positions, position i's state over the chunk's keys j <= i from the
   C x C weights e^{s_j - M_i} (M_i: the chunk's running maximum, ``cummax``), masked before the
   exponential;
2. across the nb = L / C chunks, chunk c's state over the chunks before it from the nb x nb
   weights e^{m_c' - P_c} (m_c': a chunk's maximum, P_c: the largest of those before c);

then each position combines the two (and a carried state, the decoding cache). Every exponent is
a difference of two input scores (or maxima of them) and every weight is <= 1, so the fp32 error is
a plain masked softmax's whatever the scores' magnitude or the values' scale (the former
``logcumsumexp`` form lost |s| eps in the exponent and eps/|v| in the values). Work
O(L (C + nb) d), C = max(64, L^(1/3)). Runs with autocast disabled in the inputs' dtype (the module
passes fp32 or fp64), so its matrix products stay in that dtype."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from megahash.ops.utils.documents import carry_matrix, chunk_ids, pair_mask, same_document
from megahash.ops.utils.fp32 import no_autocast

CHUNK = 64


def _chunk_size(L: int) -> int:
    return max(1, min(L, max(CHUNK, math.ceil(L ** (1 / 3)))))


def combine(m1, n1, d1, m2, n2, d2):
    """Two (max, numerator, denominator) states of disjoint key sets -> their union's (exact rescale)."""
    m = torch.maximum(m1, m2)
    a1, a2 = torch.exp(m1 - m), torch.exp(m2 - m)
    return m, a1.unsqueeze(-1) * n1 + a2.unsqueeze(-1) * n2, a1 * d1 + a2 * d2


def _causal_states(s, v):
    """s [..., L], v [..., L, dv] -> per position i the state (m, num, den) of the keys j <= i:
    m [..., L] (detached), num [..., L, dv], den [..., L]."""
    L = s.shape[-1]
    C = _chunk_size(L)
    nb = -(-L // C)
    pad = nb * C - L  # padded keys come after every real one: they reach no real position
    s = F.pad(s, (0, pad)).unflatten(-1, (nb, C))  # [..., nb, C]
    v = F.pad(v, (0, 0, 0, pad)).unflatten(-2, (nb, C))  # [..., nb, C, dv]
    sd = s.detach()  # the maxima are shifts that cancel in num/den: constants for autograd
    run = sd.cummax(-1).values  # [..., nb, C] running maximum inside the chunk
    later = torch.ones(C, C, dtype=torch.bool, device=s.device).triu(1)
    w = torch.exp((s.unsqueeze(-2) - run.unsqueeze(-1)).masked_fill(later, float("-inf")))  # [.., nb, C, C], <= 1
    num_in, den_in = w @ v, w.sum(-1)  # [..., nb, C, dv], [..., nb, C]
    mc = run[..., -1]  # [..., nb] each chunk's maximum
    # the largest maximum of the chunks before c; chunk 0 has none: its first score (<= its running max)
    prev = torch.cat([run[..., :1, 0], mc.cummax(-1).values[..., :-1]], -1)
    before = torch.ones(nb, nb, dtype=torch.bool, device=s.device).triu(0)
    w2 = torch.exp((mc.unsqueeze(-2) - prev.unsqueeze(-1)).masked_fill(before, float("-inf")))  # [..., nb, nb]
    num_pre = w2 @ num_in[..., -1, :]  # [..., nb, dv]: the chunks before c, relative to e^prev
    den_pre = (w2 * den_in[..., -1].unsqueeze(-2)).sum(-1)  # [..., nb]
    m, num, den = combine(prev.unsqueeze(-1), num_pre.unsqueeze(-2), den_pre.unsqueeze(-1), run, num_in, den_in)
    return m.flatten(-2)[..., :L], num.flatten(-3, -2)[..., :L, :], den.flatten(-2)[..., :L]


def _document_states(s, v, doc):
    """:func:`_causal_states` restarted at each document start (``doc`` [..., L] nondecreasing ids,
    :mod:`megahash.ops.utils.documents`): inside a chunk the C x C weights are masked to the same
    document before the exponential, relative to the maximum over the same keys (masked max, no
    underflow from another document); chunk c' passes its last position's state (its tail document)
    to the positions of chunk c > c' with doc == doc_end(c') == doc_start(c) (0/1 matrix W)."""
    L = s.shape[-1]
    C = _chunk_size(L)
    nb = -(-L // C)
    pad = nb * C - L
    s = F.pad(s, (0, pad)).unflatten(-1, (nb, C))  # [..., nb, C]
    v = F.pad(v, (0, 0, 0, pad)).unflatten(-2, (nb, C))
    docc = chunk_ids(doc, C)  # [..., nb, C]
    allowed = same_document(docc) & torch.ones(C, C, dtype=torch.bool, device=s.device).tril()
    logits = s.unsqueeze(-2).masked_fill(~allowed, float("-inf"))  # [..., nb, C, C]
    run = logits.detach().amax(-1)  # [..., nb, C]: each position's maximum over its keys (finite: j = i)
    w = torch.exp(logits - run.unsqueeze(-1))
    num_in, den_in = w @ v, w.sum(-1)
    mc = run[..., -1]  # [..., nb] each chunk's tail maximum
    carry = carry_matrix(docc)[..., :-1, :]  # [..., nb, nb]
    lg = mc.unsqueeze(-2).masked_fill(~carry, float("-inf"))  # [..., nb, nb]
    prev = lg.amax(-1)  # [..., nb]; -inf where nothing is carried
    safe = torch.where(torch.isinf(prev), torch.zeros_like(prev), prev)
    w2 = torch.exp(lg - safe.unsqueeze(-1))
    num_pre = w2 @ num_in[..., -1, :]
    den_pre = (w2 * den_in[..., -1].unsqueeze(-2)).sum(-1)
    gate = (docc == docc[..., :1]) & ~torch.isinf(prev).unsqueeze(-1)  # [..., nb, C]
    m_pre = torch.where(gate, safe.unsqueeze(-1), torch.full_like(run, float("-inf")))
    m, num, den = combine(m_pre, num_pre.unsqueeze(-2), den_pre.unsqueeze(-1), run, num_in, den_in)
    return m.flatten(-2)[..., :L], num.flatten(-3, -2)[..., :L, :], den.flatten(-2)[..., :L]


def cumsoftmax_causal(s: torch.Tensor, v: torch.Tensor, state=None, need_state: bool = False, doc=None):
    """s [..., L] scores, v [..., L, dv] (leading dims broadcast: s [b, g, rep, L], v [b, g, 1, L, dv]);
    ``state`` = (m [...], num [..., dv], den [...]) of the keys before (num, den relative to e^m);
    ``doc`` [..., L] document ids: the sums restart at each document start (``state`` joins document 0).
    Returns (out [..., L, dv], state of all keys or None). Eq. 4.18 with a running maximum."""
    with no_autocast(s):
        v = v.to(s.dtype)
        m, num, den = _causal_states(s, v) if doc is None else _document_states(s, v, doc)
        if state is not None:
            m0, num0, den0 = (t.to(s.dtype) for t in state)
            if doc is not None:  # the carried state reaches document 0 only
                m0 = torch.where(doc == 0, m0.unsqueeze(-1), torch.full_like(m, float("-inf")))
                m, num, den = combine(m0, num0.unsqueeze(-2), den0.unsqueeze(-1), m, num, den)
                return _finish(m, num, den, need_state)
            m, num, den = combine(m0.unsqueeze(-1), num0.unsqueeze(-2), den0.unsqueeze(-1), m, num, den)
        return _finish(m, num, den, need_state)


def _finish(m, num, den, need_state):
    out = num / den.unsqueeze(-1)
    if not need_state:
        return out, None
    return out, (m[..., -1], num[..., -1, :], den[..., -1])


def cumsoftmax_bidirectional(s, v, key_mask=None, doc=None):
    """Encoders: o = sum_j softmax(s)_j v_j over the non-padded keys (masked before the
    exponential), the same vector for every query; autocast disabled, the inputs' dtype. ``doc``
    [..., L]: over the keys of the query's document (an [L, L] masked softmax)."""
    with no_autocast(s):
        if doc is not None:
            logits = s.unsqueeze(-2).masked_fill(~pair_mask(doc, key_mask), float("-inf"))
            return torch.softmax(logits, dim=-1) @ v.to(s.dtype)
        if key_mask is not None:
            s = s.masked_fill(~key_mask, float("-inf"))
        w = torch.softmax(s, dim=-1)
        o = (w.unsqueeze(-2) @ v.to(w.dtype)).squeeze(-2)
        return o.unsqueeze(-2).expand(*o.shape[:-1], s.shape[-1], o.shape[-1])
