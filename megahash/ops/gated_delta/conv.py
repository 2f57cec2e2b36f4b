"""The short causal convolution of gated DeltaNet's q, k and v ([Yang25b]; fla's
``ShortConvolution``, Mamba's ``conv1d``): depthwise over the sequence, K taps, written as K shifted
products (a constant number of operator calls), with the K - 1 inputs before the call carried for
decoding and the taps cut at document starts."""

from __future__ import annotations

import torch


def causal_conv(x, weight, state=None, doc=None, need_state: bool = False):
    """y_t = sum_j weight[:, j] x_{t - (K-1) + j} on x [s, b, c] (sequence-first, as the layers), weight [c, K]
    (tap K - 1 on the current token), in x's dtype; ``state`` [b, K - 1, c]: the inputs before x (zeros when
    None); ``doc`` [b, s] document ids: a tap reaching an earlier document reads zero (the state belongs to
    document 0). Returns (y [s, b, c], the last K - 1 inputs [b, K - 1, c] with ``need_state``, else None)."""
    s, b, c = x.shape
    K = weight.shape[-1]
    w = weight.to(x.dtype)
    prev = x.new_zeros(K - 1, b, c) if state is None else state.transpose(0, 1).to(x.dtype)
    xp = torch.cat([prev, x], dim=0)  # [K - 1 + s, b, c]
    if doc is not None:
        ids = doc.t().unsqueeze(-1)  # [s, b, 1]
        idp = torch.cat([torch.zeros_like(ids[:1]).expand(K - 1, -1, -1), ids], dim=0)
    y = x * w[:, K - 1]
    for j in range(K - 1):  # tap j reads x_{t - (K - 1 - j)}
        tap = xp[j : j + s] * w[:, j]
        if doc is not None:
            tap = tap * (idp[j : j + s] == ids).to(x.dtype)
        y = y + tap
    return y, (xp[xp.shape[0] - (K - 1) :].transpose(0, 1) if need_state else None)
