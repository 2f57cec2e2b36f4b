"""Shared key-value attention ``skv``: keys and values share one projection per head.

K_i = V_i = X W_i^{KV} ([Xue25] sec. 3.4.1, "SKV ... enforces keys and values to share the same
projection matrix", after [Kitaev20]), Q_i = X W_i^Q; softmax attention otherwise
(eq. 3.3). Table 3.4 count 2 d^2 n^2. ``linear_q`` and ``linear_kv`` are ColumnParallel (n*d rows
each, head-major); RoPE rotates the keys only, so the KV cache stores the rotated keys and the
values (which are the unrotated shared projection).
"""

from __future__ import annotations

import torch.nn as nn
from megatron.core.transformer.spec_utils import ModuleSpec

from megahash.models.attention.base import column, heads
from megahash.models.attention.softmax_base import SoftmaxAttentionBase
from megahash.models.cost_formulas import GeneralisedRow
from megahash.models.reference_layers import SoftmaxAttention
from megahash.models.reference_ops import split_heads
from megahash.models.registry import AttentionCaps, mask_type, register_attention, register_reference


@register_reference("skv")
class SharedKVReference(SoftmaxAttention):
    """K = V = X W^{KV} (n heads): ``linear_q`` and ``linear_kv`` of n*d rows each."""

    def __init__(self, config, spec):
        super().__init__(config, spec)
        self.linear_q = nn.Linear(self.d_m, self.n * self.d, bias=self.qkv_bias)
        self.linear_kv = nn.Linear(self.d_m, self.n * self.d, bias=self.qkv_bias)

    def project(self, x):
        kv = split_heads(self.linear_kv(x), self.n)
        return split_heads(self.linear_q(x), self.n), kv, kv


class SharedKVAttention(SoftmaxAttentionBase):
    kind = "skv"

    def __init__(self, config, layer_number, attn_mask_type, cfg=None, **kw):
        super().__init__(config, layer_number, attn_mask_type, cfg, **kw)
        self.linear_q = column(self.d_m, self.n * self.d_h, config, self.qkv_bias)
        self.linear_kv = column(self.d_m, self.n * self.d_h, config, self.qkv_bias)
        self.build_proj(self.n * self.d_h)

    def project(self, x):
        q = heads(self.linear_q(x)[0], self.n_local)
        kv = heads(self.linear_kv(x)[0], self.n_local)
        return q, kv, kv


# ----------------------------------------------------------------------------- self-description
# (megahash.models.registry / megahash.catalog: costs and capabilities; nothing else in the library names the kind)


class SKVCosts(GeneralisedRow):
    """Table 3.4 SKV: 2d^2n^2 (generalised Standard row); cache keys = values: 2BLnd_h numbers."""

    @staticmethod
    def qkv_params(n, d, g):
        return 2 * d * d * n * n

    @staticmethod
    def kv_width(d, h, g):
        return d

    @staticmethod
    def cache_elements(B, L, n, d_h, g, **_):
        return 2 * B * L * n * d_h


@register_attention("skv", costs=SKVCosts, caps=AttentionCaps(thesis_name="SKV", chapters=(3,)))
def skv_spec(cfg) -> ModuleSpec:
    return ModuleSpec(module=SharedKVAttention, params={"attn_mask_type": mask_type(cfg), "cfg": cfg})
