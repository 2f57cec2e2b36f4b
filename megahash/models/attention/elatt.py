"""EL-attention ``el-att``: no key/value projections, K_i = V_i = the input itself, per head.

After [Yan21] as used in [Xue25] sec. 3.4.1 ("completely eliminates the projection
matrices for all keys and values"): Q_i = X W_i^Q, and head i uses the i-th d-wide slice of the
(normed) input X as both its keys and its values, K_i = V_i = X[:, i*d:(i+1)*d]; softmax
attention otherwise (eq. 3.3). Table 3.4 count d^2 n^2 (only W^Q, d_m x d_m). Each TP rank
takes the columns of its own heads from the gathered input (their gradients are summed over
TP by the gather). RoPE rotates the keys, so the KV cache holds rotated keys and raw values.
"""

from __future__ import annotations

from megahash.models.attention.maps import softmax_core_maps
from megahash.models.attention.softmax_base import SoftmaxAttention
from megahash.models.cost_formulas import AllHeadsRow
from megahash.models.mixing import heads
from megahash.models.registry import AttentionCaps, register_attention


class ELAttention(SoftmaxAttention):
    """EL-ATT: K = V = X (split into heads; each TP rank takes its heads' columns of the gathered input),
    Q = X W^Q."""

    def build(self, parts):
        self.linear_q = parts.column(self.d_m, self.n * self.d_h, self.qkv_bias)

    def project(self, x):
        q = heads(self.linear_q(x), self.n_local)
        full = self.parts.gather(x)
        width = self.n_local * self.d_h
        kv = heads(full[..., self.tp_rank * width : (self.tp_rank + 1) * width], self.n_local)
        return q, kv, kv


# ----------------------------------------------------------------------------- self-description
# (megahash.models.registry / megahash.catalog: costs and capabilities; nothing else in the library names the kind)


class ELAttCosts(AllHeadsRow):
    """Table 3.4 EL-ATT: d^2n^2 (generalised Standard row); cache 2BLnd_h numbers."""

    @staticmethod
    def qkv_params(n, d, g):
        return d * d * n * n


register_attention(
    "el-att",
    ELAttention,
    costs=ELAttCosts,
    caps=AttentionCaps(thesis_name="EL-ATT", chapters=(3,)),
    maps=softmax_core_maps,
)
