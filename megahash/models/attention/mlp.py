"""``mlp``: attention replaced by a parameter-matched gated SiLU MLP ([Xue25] sec. 4.3.2, eq. 4.4-4.5).

O = FC_Dn(SiLU(FC_Gt(H)) * FC_Up(H)): no token mixing, every token is processed on its own (the
"Relaxing Token Mixing" variant). ``linear_gate`` and ``linear_up`` (d_m -> f, ColumnParallel) and
``linear_proj`` (FC_Dn, f -> d_m, RowParallel, the sublayer's output projection).

Parameter matching: f is chosen so the sublayer has as many parameters as the standard
attention sublayer of the same config (``mha`` with ``model.num_query_groups``): the target is
d_m*(n + 2g)*d_h + d_m*n*d_h (+ the q/k/v biases (n + 2g)*d_h if model.qkv_bias; the output bias
d_m, if any, is common to both), the MLP has 3*d_m*f (+ 2f gate/up biases if model.qkv_bias).
f is rounded to a multiple of n so every valid TP size divides it, which leaves a residual of
``mlp_param_residual`` parameters, |residual| <= (3*d_m + 2)*n/2 (for the 500M config,
d_m=896, n=14, qkv_bias: f = 1190, residual -12,852 of 3,213,952 per sublayer, -0.40%; -308,448
or about -0.07% of the whole ~436M model over 24 layers). With d_m divisible by 3n the match is exact.
No decoding cache: tokens are independent.
"""

from __future__ import annotations

import torch.nn.functional as F

from megahash.models.attention.maps import no_mixing_maps
from megahash.models.mixing import Mixing
from megahash.models.registry import AttentionCaps, register_attention


def standard_attention_params(d_m: int, n: int, g: int, d_h: int, qkv_bias: bool) -> int:
    """Parameters of the standard attention sublayer without the output bias."""
    return d_m * (n + 2 * g) * d_h + (n + 2 * g) * d_h * int(qkv_bias) + d_m * n * d_h


def matched_mlp_width(d_m: int, n: int, g: int, d_h: int, qkv_bias: bool) -> int:
    """Width f of the gated MLP closest to the standard sublayer's size, a multiple of n."""
    per_unit = 3 * d_m + 2 * int(qkv_bias)
    f = standard_attention_params(d_m, n, g, d_h, qkv_bias) / per_unit
    return max(n, int(round(f / n)) * n)


def mlp_param_residual(d_m: int, n: int, g: int, d_h: int, qkv_bias: bool) -> int:
    """(mlp sublayer params) - (standard attention sublayer params); output bias cancels."""
    f = matched_mlp_width(d_m, n, g, d_h, qkv_bias)
    return (3 * d_m + 2 * int(qkv_bias)) * f - standard_attention_params(d_m, n, g, d_h, qkv_bias)


class GatedMLPMixer(Mixing):
    """``linear_proj(SiLU(linear_gate(x)) * linear_up(x))``, width matched to the standard sublayer (the
    layer's key/value groups: model.num_query_groups); no token mixing, no cache."""

    def build(self, parts):
        self.width = matched_mlp_width(self.d_m, self.n, self.groups, self.d_h, self.qkv_bias)
        self.linear_gate = parts.column(self.d_m, self.width, self.qkv_bias)
        self.linear_up = parts.column(self.d_m, self.width, self.qkv_bias)
        self.linear_proj = parts.row(self.width, self.d_m)

    def mix(self, x, attention_mask, rotary_pos_emb, state):
        return F.silu(self.linear_gate(x)) * self.linear_up(x)


# ----------------------------------------------------------------------------- self-description
# (megahash.models.registry / megahash.catalog: costs and capabilities; nothing else in the library names the kind)


class MLPCosts:
    """[Xue25] Tables 4.5-4.8, MLP row: O(BLd^2); FLOPs 6BLd^2 (prefill), 6Bd^2 (decode);
    activations 8BLd/t; no cache. No Table 3.4 row (parameter-matched gated MLP)."""

    @staticmethod
    def time_complexity(B, L, d):
        return B * L * d * d

    @staticmethod
    def flops(phase, B, L, d, h=None, g=None, precomputed=False):
        return 6 * B * L * d * d if phase == "prefill" else 6 * B * d * d

    @staticmethod
    def activation_bytes(B, L, d, h, t=1):
        return 8 * B * L * d / t

    @staticmethod
    def cache_bytes(B, L, d, h, g=None):
        return 0

    @staticmethod
    def cache_elements(B, L, n, d_h, g, **_):
        return 0


register_attention(
    "mlp",
    GatedMLPMixer,
    costs=MLPCosts,
    caps=AttentionCaps(mixes_tokens=False, thesis_name="MLP", chapters=(4,)),
    maps=no_mixing_maps,
)
