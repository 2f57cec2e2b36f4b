"""The formula bases a kind's cost class builds on ([Xue25] Table 3.4, Tables 4.5-4.8), and Megatron's
padded vocabulary, torch-free and importing nothing of megahash: kind files import them, and
:mod:`megahash.catalog` executes a kind's cost class from its source with them
(:mod:`megahash.models.costs` asks the kinds); the model and the closed-form count share the padding.
"""

from __future__ import annotations


def padded_vocab_size(vocab: int, divisible_by: int, tp: int = 1) -> int:
    """Megatron's padding: round the vocabulary up to a multiple of divisible_by x TP."""
    mult = max(1, divisible_by * tp)
    return ((vocab + mult - 1) // mult) * mult


# A kind's cost class (registered with ``register_attention(name, costs=...)`` in the kind's own
# file) holds its formulas as static/class methods, each optional ("n/a" where absent):
#   qkv_params(n, d, g)                      Table 3.4 (d = head dim, g = key/value heads)
#   time_complexity(B, L, d)                 Table 4.5
#   flops(phase, B, L, d, h, g, precomputed) Table 4.6 (phase prefill | decode)
#   activation_bytes(B, L, d, h, t)          Table 4.7
#   cache_bytes(B, L, d, h, g)               Table 4.8
#   cache_elements(B, L, n, d_h, g, **opts)  this implementation's decode cache (numbers)
#   groups(n, g)                             key/value heads of the kind under model.num_query_groups=g
# The bases below are the generic machinery the kinds build on.


class StandardQKV:
    """Q/K/V of the standard sublayer (Table 3.4's MHA row, GQA-sized with g key/value heads):
    d^2 n^2 + 2 d^2 n g (= 3 d^2 n^2 at g = n). Chapter-4 kinds are parameter-matched to it."""

    @staticmethod
    def qkv_params(n, d, g):
        return d * d * n * n + 2 * d * d * n * g

    @staticmethod
    def groups(n, g):
        return g or n


class GeneralisedRow(StandardQKV):
    """Table 4.5-4.8's Standard row generalised by a kind's projection sizes (chapter-3 kinds; NOT in
    [Xue25]): prefill FLOPs 2*B*L*p + 4*B*L^2*w, decode 2*B*p + 4*B*L*w (p = Q/K/V parameters,
    w = attention width ``width``), activations (8BLd + 2BL^2 * maps)/t, cache 4*B*L*kv_width bytes.
    With the standard projections it is exactly the Standard row."""

    @staticmethod
    def width(d, h):
        return d

    @staticmethod
    def maps(h):
        return h

    @staticmethod
    def kv_width(d, h, g):
        return g * (d // h)

    @staticmethod
    def time_complexity(B, L, d):
        return B * L * L * d + B * L * d * d

    @classmethod
    def flops(cls, phase, B, L, d, h=None, g=None, precomputed=False):
        if h is None:
            raise ValueError("the generalised Standard row needs the number of heads h")
        p, w = cls.qkv_params(h, d // h, g or h), cls.width(d, h)
        return 2 * B * L * p + 4 * B * L * L * w if phase == "prefill" else 2 * B * p + 4 * B * L * w

    @classmethod
    def activation_bytes(cls, B, L, d, h, t=1):
        return (8 * B * L * d + 2 * B * L * L * cls.maps(h)) / t

    @classmethod
    def cache_bytes(cls, B, L, d, h, g=None):
        return 4 * B * L * cls.kv_width(d, h, g or h)


class AllHeadsRow(GeneralisedRow):
    """The generalised Standard row of a kind that keeps keys and values for all n heads: kv width d, decode cache
    2BLnd_h numbers."""

    @staticmethod
    def kv_width(d, h, g):
        return d

    @staticmethod
    def cache_elements(B, L, n, d_h, g, **_):
        return 2 * B * L * n * d_h


class SoftmaxRow(GeneralisedRow):
    """The Standard row (full heads: ``h`` None) or generalised by the key/value groups, plus the sigmoid output
    gate when ``gated`` (not in [Xue25]): d^2n^2 more parameters (W_g, d_m x n d), their GEMM (2BLd_m^2 prefill,
    2Bd_m^2 decode) and its saved pre-activation and ungated output (4BLd_m bytes); decode cache K and V
    (2BLgd_h numbers). The base of the mha family's costs."""

    @staticmethod
    def qkv_params(n, d, g, gated=False):
        return d * d * n * n + 2 * d * d * n * g + (d * d * n * n if gated else 0)

    @classmethod
    def flops(cls, phase, B, L, d, h=None, g=None, precomputed=False, gated=False):
        gate = (2 * B * L * d * d if phase == "prefill" else 2 * B * d * d) if gated else 0
        if h is None:  # the Standard row itself (full heads)
            return gate + (
                4 * B * L * L * d + 6 * B * L * d * d if phase == "prefill" else 6 * B * d * d + 4 * B * L * d
            )
        return gate + super().flops(phase, B, L, d, h, g, precomputed)

    @classmethod
    def activation_bytes(cls, B, L, d, h, t=1, gated=False):
        return super().activation_bytes(B, L, d, h, t) + (4 * B * L * d / t if gated else 0)

    @staticmethod
    def cache_elements(B, L, n, d_h, g, **_):
        return 2 * B * L * g * d_h


class ApproxRow(StandardQKV):
    """[Xue25] Tables 4.5-4.8, Approx. row (Appendix I's form, the ``approx-thesis`` kind; ``approx``, the
    Based kernel, shares it): O(BLd^2); FLOPs 14BLd^2 (prefill), 10Bd^2 (decode); activations
    11BLd/t + 3Bd^2/(ht); cache 6Bd + 4Bd^2/h bytes."""

    @staticmethod
    def time_complexity(B, L, d):
        return B * L * d * d

    @staticmethod
    def flops(phase, B, L, d, h=None, g=None, precomputed=False):
        return 14 * B * L * d * d if phase == "prefill" else 10 * B * d * d

    @staticmethod
    def activation_bytes(B, L, d, h, t=1):
        return 11 * B * L * d / t + 3 * B * d * d / (h * t)

    @staticmethod
    def cache_bytes(B, L, d, h, g=None):
        return 6 * B * d + 4 * B * d * d / h
