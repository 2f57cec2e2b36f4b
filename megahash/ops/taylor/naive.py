"""Naive (quadratic) form of the Taylor kernel attention: the test oracle of the chunked form."""

from __future__ import annotations

from megahash.ops.linear.naive import naive_linear
from megahash.ops.taylor.feature_map import taylor_kernel


def naive_taylor(q, k, v, causal: bool = True):
    """o_i = sum_{j<=i} k(q_i, k_j) v_j / sum_{j<=i} k(q_i, k_j) from the full L x L kernel matrix."""
    num, den = naive_linear(q, k, v, taylor_kernel, causal)
    return num / den.unsqueeze(-1)
