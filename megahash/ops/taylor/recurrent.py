"""Recurrent form of the Taylor kernel attention: state (S [..., D, dv], z [..., D]) (decoding, oracle)."""
from __future__ import annotations

from megahash.ops.linear.recurrent import recurrent_linear
from megahash.ops.taylor.kernel import taylor_features


def taylor_recurrent(q, k, v, state=None, doc=None):
    """Token by token: (out [..., L, dv], (S, z)); ``doc``: the state restarts at each document start."""
    num, den, state = recurrent_linear(q, k, v, taylor_features, state, doc)
    return num / den.unsqueeze(-1), state
