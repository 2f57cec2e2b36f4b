"""Recurrent form of the Taylor kernel attention, state (S [..., D, dv], z [..., D]): the test oracle
(decoding runs :func:`megahash.ops.taylor.chunk.taylor_causal` with the carried state)."""

from __future__ import annotations

from megahash.ops.linear.recurrent import recurrent_linear
from megahash.ops.taylor.feature_map import taylor_features


def taylor_recurrent(q, k, v, state=None, doc=None):
    """Token by token: (out [..., L, dv], (S, z)); ``doc``: the state restarts at each document start."""
    num, den, state = recurrent_linear(q, k, v, taylor_features, state, doc)
    return num / den.unsqueeze(-1), state
