"""Sliding-window softmax attention: which keys a query sees (Mistral's and Gemma's local attention;
Megatron-core's ``window_size``, flash-attention's ``window_size=(W - 1, 0)``).

A window of ``W`` keys: query i sees key j iff i - W < j <= i in a decoder (itself and the W - 1 keys before
it), |i - j| < W in an encoder. With a decoding cache the ``sq`` queries are the last ``sq`` of the ``sk``
positions (queries at sk - sq + a, keys at b), so one rule serves training, prefill and decoding:
0 <= (sk - sq + a) - b < W. A window of at least the sequence length is full causal attention."""

from __future__ import annotations

import torch


def band_mask(sq: int, sk: int, window: int, causal: bool, device=None) -> torch.Tensor:
    """[sq, sk] boolean (True = attend): the window of the ``sq`` last positions of ``sk`` (module docstring)."""
    lag = (torch.arange(sq, device=device) + (sk - sq))[:, None] - torch.arange(sk, device=device)[None, :]
    if causal:
        return (lag >= 0) & (lag < window)
    return lag.abs() < window


def in_window(q_idx, kv_idx, window: int, causal: bool):
    """The same rule on index tensors (a FlexAttention ``mask_mod`` body)."""
    lag = q_idx - kv_idx
    if causal:
        return (lag >= 0) & (lag < window)
    return (lag < window) & (lag > -window)
