"""Standard softmax attention: ``mha``, ``gqa`` and ``mqa`` (and the base of the MHA family).

softmax(Q_i K_i^T / sqrt(d_h)) V_i per head i, Q, K, V = X W^{Q,K,V} ([Xue25] eq. 3.1-3.3 and
eq. 4.1-4.3). Heads split over TP ranks; RoPE on Q and K; KV cache in the layer's decoding cache
(``ForwardState.cache``, keys after RoPE). Grouped-query attention shares one K/V head among n/g query heads.

- ``mha``: g = ``model.num_query_groups`` (0 = n heads: full MHA, Table 3.4 count 3d^2n^2; fewer
  groups give GQA, count d^2n^2 + 2d^2ng).
- ``gqa``: g = ``model.num_query_groups`` when it is set and below n, otherwise the largest
  divisor of n not above n/4 (n=8 -> 2, n=12 -> 3, n=14 -> 2, n=16 -> 4; at least 1).
- ``mqa``: g = 1 (Shazeer 2019; Table 3.4: d^2n^2 + 2d^2n).

Parameters: ``linear_q`` (ColumnParallel, n*d_h rows, head-major) and ``linear_kv`` (2*g*d_h rows,
group-major ``[g][k (d_h), v (d_h)]``). When TP does not divide g (e.g. MQA at TP=2) the K/V
projection is a :class:`~megahash.models.attention.base.ReplicatedLinear` instead (every rank
holds it whole; same master draw, so the weights do not depend on the TP size). The output
projection is ``linear_proj`` (RowParallel).

Option ``gated`` (``model.attention.options.gated``, or ``mha+gated`` for one layer of a schedule): a sigmoid
output gate per head and channel before ``linear_proj`` (Qwen3-Next's gated attention, [Qiu25];
``linear_output_gate``, d_m x n d_h more parameters, split by head over TP).
"""

from __future__ import annotations

from megahash.models.attention.maps import softmax_core_maps
from megahash.models.attention.softmax_base import GatedOptions, GroupedSoftmax, default_gqa_groups
from megahash.models.cost_formulas import SoftmaxRow
from megahash.models.registry import AttentionCaps, register_attention


class GroupedQuery(GroupedSoftmax):
    """softmax(Q_i K_g(i)^T / sqrt(d_h)) V_g(i) (eq. 3.1-3.3): ``linear_q`` (n heads) and ``linear_kv``
    (g groups, rows ``[g][k (d_h), v (d_h)]``); g = n (mha), g < n (gqa), g = 1 (mqa)."""


# ----------------------------------------------------------------------------- self-description
# (megahash.models.registry / megahash.catalog: costs and capabilities; nothing else in the library names the kind)


class MHACosts(SoftmaxRow):
    """The "Standard" row: Table 3.4 Q/K/V 3d^2n^2 (GQA-sized d^2n^2 + 2d^2ng with
    model.num_query_groups g), Tables 4.5-4.8 (prefill 4BL^2d + 6BLd^2, decode 6Bd^2 + 4BLd,
    activations (8BLd + 2BL^2h)/t, cache 4BLd bytes); decode cache K and V: 2BLgd_h numbers; the output gate's
    terms when ``gated`` (:class:`SoftmaxRow`, not in [Xue25])."""


class GQACosts(MHACosts):
    """GQA (not in Table 3.4): d^2n^2 + 2d^2ng, the Standard row generalised by its K/V size."""

    @staticmethod
    def groups(n, g):
        """model.num_query_groups, else the spec's default: the largest divisor of n at most n/4."""
        return g or max(x for x in range(1, max(1, n // 4) + 1) if n % x == 0)


class MQACosts(MHACosts):
    """MQA (Table 3.4): d^2n^2 + 2d^2n; one key/value head (cache 2BLd_h numbers)."""

    @staticmethod
    def groups(n, g):
        return 1


register_attention(
    "mha",
    GroupedQuery,
    costs=MHACosts,
    options=GatedOptions,
    caps=AttentionCaps(standard=True, qwen2=True, thesis_name="Standard", chapters=(3, 4), value_embeds=True),
    maps=softmax_core_maps,
    groups=lambda n, g: g or n,
)
register_attention(
    "gqa",
    GroupedQuery,
    costs=GQACosts,
    options=GatedOptions,
    caps=AttentionCaps(qwen2=True, thesis_name="GQA", value_embeds=True),
    maps=softmax_core_maps,
    groups=lambda n, g: g if 0 < g < n else default_gqa_groups(n),
)
register_attention(
    "mqa",
    GroupedQuery,
    costs=MQACosts,
    options=GatedOptions,
    caps=AttentionCaps(qwen2=True, thesis_name="MQA", chapters=(3,), value_embeds=True),
    maps=softmax_core_maps,
    groups=lambda n, g: 1,
)
