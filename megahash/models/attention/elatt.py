"""EL-attention ``el-att``: no key/value projections, K_i = V_i = the input itself, per head.

After [Yan21] as used in [Xue25] sec. 3.4.1 ("completely eliminates the projection
matrices for all keys and values"): Q_i = X W_i^Q, and head i uses the i-th d-wide slice of the
(normed) input X as both its keys and its values, K_i = V_i = X[:, i*d:(i+1)*d]; softmax
attention otherwise (eq. 3.3). Table 3.4 count d^2 n^2 (only W^Q, d_m x d_m). Each TP rank
takes the columns of its own heads from the gathered input (their gradients are summed over
TP by the gather). RoPE rotates the keys, so the KV cache holds rotated keys and raw values.
"""

from __future__ import annotations

import torch.nn as nn
from megatron.core.transformer.spec_utils import ModuleSpec

from megahash.models.attention.base import column, gather_input, heads, tp_rank
from megahash.models.attention.softmax_base import SoftmaxAttentionBase
from megahash.models.cost_formulas import GeneralisedRow
from megahash.models.reference_layers import SoftmaxAttention
from megahash.models.reference_ops import split_heads
from megahash.models.registry import AttentionCaps, mask_type, register_attention, register_reference


@register_reference("el-att")
class ELAttentionReference(SoftmaxAttention):
    """EL-ATT: K = V = X (split into heads), Q = X W^Q."""

    def __init__(self, config, spec):
        super().__init__(config, spec)
        self.linear_q = nn.Linear(self.d_m, self.n * self.d, bias=self.qkv_bias)

    def project(self, x):
        kv = split_heads(x, self.n)
        return split_heads(self.linear_q(x), self.n), kv, kv


class ELAttention(SoftmaxAttentionBase):
    kind = "el-att"

    def __init__(self, config, layer_number, attn_mask_type, cfg=None, **kw):
        super().__init__(config, layer_number, attn_mask_type, cfg, **kw)
        self.linear_q = column(self.d_m, self.n * self.d_h, config, self.qkv_bias)
        self.build_proj(self.n * self.d_h)

    def project(self, x):
        q = heads(self.linear_q(x)[0], self.n_local)
        full = gather_input(x, self.config)
        width = self.n_local * self.d_h
        r = tp_rank()
        kv = heads(full[..., r * width : (r + 1) * width], self.n_local)
        return q, kv, kv


# ----------------------------------------------------------------------------- self-description
# (megahash.models.registry / megahash.catalog: costs and capabilities; nothing else in the library names the kind)


class ELAttCosts(GeneralisedRow):
    """Table 3.4 EL-ATT: d^2n^2 (generalised Standard row); cache 2BLnd_h numbers."""

    @staticmethod
    def qkv_params(n, d, g):
        return d * d * n * n

    @staticmethod
    def kv_width(d, h, g):
        return d

    @staticmethod
    def cache_elements(B, L, n, d_h, g, **_):
        return 2 * B * L * n * d_h


@register_attention("el-att", costs=ELAttCosts, caps=AttentionCaps(thesis_name="EL-ATT", chapters=(3,)))
def elatt_spec(cfg) -> ModuleSpec:
    return ModuleSpec(module=ELAttention, params={"attn_mask_type": mask_type(cfg), "cfg": cfg})
