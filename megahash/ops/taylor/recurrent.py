"""Recurrent form of the Taylor kernel attention: state (S [..., D, dv], z [..., D]) (decoding, oracle)."""
from __future__ import annotations

from megahash.ops.linear.recurrent import recurrent_linear
from megahash.ops.taylor.kernel import taylor_features


def taylor_recurrent(q, k, v, state=None):
    """Token by token: (out [..., L, dv], (S, z))."""
    num, den, state = recurrent_linear(q, k, v, taylor_features, state)
    return num / den.unsqueeze(-1), state
