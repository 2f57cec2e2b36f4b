"""Single-head attention ``sha``: one head of the head dimension d = d_m / n ([Xue25] sec. 3.4.1).

Q, K, V = X W^{Q,K,V} with W^{Q,K,V} in R^{d_m x d} (eq. 3.1-3.3 with one head); Table 3.4 count
3 d^2 n (output projection d -> d_m excluded). The one head cannot be split over TP, so its
projection ``linear_qkv`` (rows ``[q (d), k (d), v (d)]``) is replicated on every TP rank (same
master draw as megatron's CPU init; gradients summed over TP) and each rank feeds its slice
d/tp of the head output to the RowParallel ``linear_proj`` (d -> d_m): together the ranks compute
the full projection. KV cache: one head of keys and values.
"""

from __future__ import annotations

from megahash.errors import ConfigError
from megahash.models.attention.maps import softmax_core_maps
from megahash.models.attention.softmax_base import SoftmaxAttention
from megahash.models.cost_formulas import GeneralisedRow
from megahash.models.registry import AttentionCaps, register_attention


class SingleHead(SoftmaxAttention):
    """One head of d = d_m / n: ``linear_qkv`` rows ``[q (d), k (d), v (d)]`` (replicated over TP), each TP rank
    projecting its slice d/tp of the head output with ``linear_proj`` (d -> d_m)."""

    replicated_heads = True

    def build(self, parts):
        if self.d_h % self.tp:
            raise ConfigError(f"sha: parallel.tensor={self.tp} must divide the head dimension {self.d_h}")
        self.linear_qkv = parts.replicated(self.d_m, 3 * self.d_h, self.qkv_bias)
        self.linear_proj = parts.row(self.d_h, self.d_m)

    def project(self, x):
        qkv = self.linear_qkv(x)
        s, b = qkv.shape[:2]
        qkv = qkv.view(s, b, 3, 1, self.d_h)
        return qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]

    def select_output(self, out):
        part = self.d_h // self.tp
        return out[..., self.tp_rank * part : (self.tp_rank + 1) * part]


# ----------------------------------------------------------------------------- self-description
# (megahash.models.registry / megahash.catalog: costs and capabilities; nothing else in the library names the kind)


class SHACosts(GeneralisedRow):
    """Table 3.4 SHA: 3d^2n; one attention map of width d_h (generalised Standard row); cache 2BLd_h."""

    @staticmethod
    def qkv_params(n, d, g):
        return 3 * d * d * n

    @staticmethod
    def width(d, h):
        return d // h

    @staticmethod
    def maps(h):
        return 1

    @staticmethod
    def kv_width(d, h, g):
        return d // h

    @staticmethod
    def cache_elements(B, L, n, d_h, g, **_):
        return 2 * B * L * d_h


register_attention(
    "sha", SingleHead, costs=SHACosts, caps=AttentionCaps(thesis_name="SHA", chapters=(3,)), maps=softmax_core_maps
)
