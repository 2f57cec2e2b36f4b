"""Sliding-window softmax attention ``swa`` (local attention: Longformer's causal window [Beltagy20], Mistral's
and Gemma's local layers [Jiang23], [GemmaTeam25]; megatron-core's ``window_size``).

softmax(Q_i K_i^T / sqrt(d_h) + M_W) V_i per head i, with M_W = 0 for the ``window`` keys i - W < j <= i (the
query itself and the W - 1 before it; |i - j| < W in an encoder) and -inf elsewhere
(:mod:`megahash.ops.utils.window`); otherwise ``mha`` exactly: Q, K, V projections, key/value groups under
``model.num_query_groups``, RoPE, QK-norm, packed documents (the document mask and the window joined), the
output gate (``gated``). A window of at least the sequence length is ``mha``, bit for bit.

Kernels (megahash/models/attention/document_mask.py): on CUDA FlexAttention with the sliding-window
``BlockMask`` (``and_masks`` with the document mask when documents are packed), so blocks outside the band are
skipped; elsewhere SDPA with the banded mask, built once per forward and shared by the layers.

Decoding: a rolling KV cache (``append_cache(keep=W - 1)``): the cache holds the last W - 1 keys and values,
the new token's own make the W it attends to; memory and a step's work stay flat in the generated length.

Options (``model.attention.options``, or per layer in a schedule: ``swa+window=128``, ``swa+gated``):
``window`` (W >= 1 keys), ``gated``.

Costs (not in [Xue25]; the Standard row with L keys per query replaced by min(L, W)): prefill
4BL min(L, W) d + 6BLd^2 FLOPs, decode 6Bd^2 + 4B min(L, W) d, activations (8BLd + 2BL min(L, W) h)/t,
decode cache 4B min(L, W - 1) g d_h bytes (2B min(L, W - 1) g d_h numbers).
"""

from __future__ import annotations

from dataclasses import dataclass

from megahash.errors import ConfigError
from megahash.models.attention.maps import softmax_core_maps
from megahash.models.attention.softmax_base import GatedOptions, GroupedSoftmax
from megahash.models.cost_formulas import SoftmaxRow
from megahash.models.registry import AttentionCaps, register_attention

DEFAULT_WINDOW = 64  # keys a query sees by default (itself included)


class SlidingWindow(GroupedSoftmax):
    """``mha`` over a sliding window of ``window`` keys (module docstring)."""

    def build(self, parts):
        self.window = int(self.setup.option("window", DEFAULT_WINDOW))
        if self.window < 1:
            raise ConfigError(
                f"swa: model.attention.options.window={self.window} must be at least 1 (keys a query sees)"
            )
        super().build(parts)


# ----------------------------------------------------------------------------- self-description
# (megahash.models.registry / megahash.catalog: costs and capabilities; nothing else in the library names the kind)


class SWACosts(SoftmaxRow):
    """The Standard row with the keys of a query bounded by the window: L -> min(L, W) in the map terms
    (module docstring); the cache holds min(L, W - 1) positions."""

    @staticmethod
    def time_complexity(B, L, d, window=DEFAULT_WINDOW):
        return B * L * min(L, window) * d + B * L * d * d

    @classmethod
    def flops(cls, phase, B, L, d, h=None, g=None, precomputed=False, gated=False, window=DEFAULT_WINDOW):
        keys = min(L, window)
        if phase == "decode":  # one query over min(L, W) keys: the map terms of a context of that length
            return super().flops(phase, B, keys, d, h, g, precomputed, gated)
        full = super().flops(phase, B, L, d, h, g, precomputed, gated)
        width = d if h is None else cls.width(d, h)
        return full - 4 * B * L * (L - keys) * width  # the map terms 4BL^2 w with L keys -> min(L, W)

    @classmethod
    def activation_bytes(cls, B, L, d, h, t=1, gated=False, window=DEFAULT_WINDOW):
        full = super().activation_bytes(B, L, d, h, t, gated)
        return full - 2 * B * L * (L - min(L, window)) * cls.maps(h) / t

    @classmethod
    def cache_bytes(cls, B, L, d, h, g=None, window=DEFAULT_WINDOW):
        return super().cache_bytes(B, min(L, window - 1), d, h, g)

    @staticmethod
    def cache_elements(B, L, n, d_h, g, window=DEFAULT_WINDOW, **_):
        return 2 * B * min(L, window - 1) * g * d_h


@dataclass(frozen=True)
class SWAOptions(GatedOptions):
    """``model.attention.options`` of swa: the window W (keys a query sees, itself included) and the output
    gate. ``EXAMPLES``: what the registry-derived tests run it with (windows shorter than their sequences)."""

    window: int = DEFAULT_WINDOW
    RANGES = {"window": (1, None, False, False, "keys a query of swa sees, itself included")}
    EXAMPLES = ("window=4", "window=3+gated")


register_attention(
    "swa",
    SlidingWindow,
    costs=SWACosts,
    options=SWAOptions,
    caps=AttentionCaps(),
    maps=softmax_core_maps,
    groups=lambda n, g: g or n,
)
