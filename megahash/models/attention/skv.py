"""Shared key-value attention ``skv``: keys and values share one projection per head.

K_i = V_i = X W_i^{KV} ([Xue25] sec. 3.4.1, "SKV ... enforces keys and values to share the same
projection matrix", after [Kitaev20]), Q_i = X W_i^Q; softmax attention otherwise
(eq. 3.3). Table 3.4 count 2 d^2 n^2. ``linear_q`` and ``linear_kv`` are ColumnParallel (n*d rows
each, head-major); RoPE rotates the keys only, so the KV cache stores the rotated keys and the
values (which are the unrotated shared projection).
"""

from __future__ import annotations

from megahash.models.attention.maps import softmax_core_maps
from megahash.models.attention.softmax_base import SoftmaxAttention
from megahash.models.cost_formulas import AllHeadsRow
from megahash.models.mixing import heads
from megahash.models.registry import AttentionCaps, register_attention


class SharedKV(SoftmaxAttention):
    """K = V = X W^{KV} (n heads): ``linear_q`` and ``linear_kv`` of n*d rows each."""

    def build(self, parts):
        self.linear_q = parts.column(self.d_m, self.n * self.d_h, self.qkv_bias)
        self.linear_kv = parts.column(self.d_m, self.n * self.d_h, self.qkv_bias)

    def project(self, x):
        q = heads(self.linear_q(x), self.n_local)
        kv = heads(self.linear_kv(x), self.n_local)
        return q, kv, kv


# ----------------------------------------------------------------------------- self-description
# (megahash.models.registry / megahash.catalog: costs and capabilities; nothing else in the library names the kind)


class SKVCosts(AllHeadsRow):
    """Table 3.4 SKV: 2d^2n^2 (generalised Standard row); cache keys = values: 2BLnd_h numbers."""

    @staticmethod
    def qkv_params(n, d, g):
        return 2 * d * d * n * n


register_attention(
    "skv", SharedKV, costs=SKVCosts, caps=AttentionCaps(thesis_name="SKV", chapters=(3,)), maps=softmax_core_maps
)
