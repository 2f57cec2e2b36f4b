"""``gated-deltanet``: gated DeltaNet ([Yang25b]), the layer of fla's ``GatedDeltaNet`` and megatron-core's
``ssm/gated_delta_net.py`` (Qwen3-Next's linear-attention layers), written once.

Per head (n heads, key head dim d_k = d_h, value head dim d_v = ``expand_v`` d_h), from x [s, b, d_m]:

    [q, k, v] = SiLU(conv_K([x W_q, x W_k, x W_v]))          short causal depthwise convolution, K taps
    q, k <- q / |q|, k / |k|                                   L2 norm (fla's l2norm, eps 1e-6)
    g_t = -exp(A_log) softplus(x_t w_a + dt_bias)              log decay (Mamba2's parametrisation, [Dao24])
    beta_t = sigmoid(x_t w_b)
    S_t = e^{g_t} (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T,   o_t = c S_t^T q_t   ([Yang25b])
    y_t = RMSNorm(o_t) * SiLU(x_t W_z)                          output gate and gated RMSNorm (over d_v, shared by heads)

and ``linear_proj`` (n d_v -> d_m). The readout scale c is the layer's score scale: 1/sqrt(d_k) ([Yang25b]), under
muP sqrt(d_k,0)/d_k (:func:`megahash.models.mixing.score_scale`); with L2-normalised q, k and the RMSNorm after it,
o's scale cancels but for the norm's eps, so muP changes little here, but the kind follows the model's rule.
One input projection ``linear_in`` (split by head over TP, rows per head
``[q d_k, k d_k, v d_v, z d_v, a 1, b 1]``, biases with ``model.qkv_bias``), the convolution weights ``conv``
(per head [2 d_k + d_v, K], a flat 1-D parameter), ``A_log`` and ``dt_bias`` (one per head, 1-D: no weight
decay, no Muon) and ``o_norm``. Initialisation as fla's: A ~ U(1, 16) (Mamba2's range; fla draws U(0, 16)),
dt = exp(U(log 1e-3, log 0.1)) floored at 1e-4 with dt_bias = softplus^{-1}(dt), the convolution
U(-1/sqrt(K), 1/sqrt(K)) (torch's Conv1d); each drawn whole, so the weights do not depend on the TP size.

Options (``model.attention.options``): ``expand_v`` (d_v / d_k, default 1: the sublayer has 5 d_m^2 + O(n d_h)
parameters against mha's 4 d_m^2; fla's and Qwen3-Next's value heads are twice as wide), ``conv_size`` (K,
default 4; 0: no convolution, q, k, v = SiLU of the projections), ``chunk_size`` (the chunked form's chunk,
0 = 64). ``model.num_query_groups`` does not apply (q, k and v have n heads each); RoPE is not applied (the
convolution and the decay carry positions); ``model.qk_norm`` normalises q and k per head before the L2 norm.
Causal only (no bidirectional form: an encoder config is a one-line error).

The kernel (:mod:`megahash.ops.gated_delta`): the chunked WY/UT form (one triangular solve and batched GEMMs
for all chunks, the state carried over chunks; fla's ``chunk_gated_delta_rule`` on CUDA when installed) in
fp32 with autocast off, the recurrent form its oracle. Decoding keeps the state ``S`` [b, n, d_k, d_v] and the
convolution's last K - 1 inputs ``conv`` [b, K - 1, n (2 d_k + d_v)] in the layer's cache: n (d_k d_v + (K - 1)
(2 d_k + d_v)) numbers per sequence, whatever the context, and O(n d_k d_v) FLOPs per token. Packed documents
restart the state and the convolution window at each document start. Attention dropout is not applied.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from megahash.errors import ConfigError
from megahash.models.attention.linear_base import compute_dtype
from megahash.models.mixing import Mixing, cached_state, store_state
from megahash.models.registry import AttentionCaps, register_attention
from megahash.ops.gated_delta.chunk import gated_delta_causal
from megahash.ops.gated_delta.conv import causal_conv
from megahash.ops.utils.documents import document_rows

DT_MIN, DT_MAX, DT_FLOOR = 1e-3, 0.1, 1e-4  # fla's (and Mamba2's) dt initialisation
A_RANGE = (1.0, 16.0)  # Mamba2's A_init_range (fla draws U(0, 16))


def init_decay(w: torch.Tensor) -> None:
    """A_log = log A, A ~ U(1, 16)."""
    w.uniform_(*A_RANGE).log_()


def init_dt_bias(w: torch.Tensor) -> None:
    """dt_bias = softplus^{-1}(dt), dt log-uniform in [1e-3, 0.1] and at least 1e-4 (fla, Mamba2)."""
    dt = torch.exp(torch.rand_like(w) * (math.log(DT_MAX) - math.log(DT_MIN)) + math.log(DT_MIN)).clamp_(min=DT_FLOOR)
    w.copy_(dt + torch.log(-torch.expm1(-dt)))


def init_conv(taps: int):
    """U(-1/sqrt(K), 1/sqrt(K)): torch's Conv1d default for a depthwise convolution of K taps."""
    bound = taps**-0.5
    return lambda w: w.uniform_(-bound, bound)


class GatedDeltaNet(Mixing):
    """Gated DeltaNet (module docstring): short convolutions, L2-normalised q, k, the gated delta rule, output
    gate and gated RMSNorm; decoding state (S, conv)."""

    def build(self, parts):
        if not self.causal:
            raise ConfigError(f"{self.kind} is causal only; use model.arch=decoder or another model.schedule")
        expand = float(self.setup.option("expand_v", 1.0))
        if expand <= 0 or abs(self.d_h * expand - round(self.d_h * expand)) > 1e-6:
            raise ConfigError(
                f"model.attention.options.expand_v={expand} times the head dim {self.d_h} is not a positive "
                f"integer; choose expand_v so that it is"
            )
        self.d_k, self.d_v = self.d_h, int(round(self.d_h * expand))
        self.conv_size = int(self.setup.option("conv_size", 4))
        self.chunk_size = int(self.setup.option("chunk_size", 0) or 0)
        n, self.qkv_width = self.n, 2 * self.d_k + self.d_v
        self.linear_in = parts.column(self.d_m, n * (self.qkv_width + self.d_v + 2), self.qkv_bias)
        if self.conv_size:
            self.conv = parts.per_head(n, self.qkv_width * self.conv_size, init=init_conv(self.conv_size), flat=True)
        self.A_log = parts.per_head(n, 1, init=init_decay, flat=True)
        self.dt_bias = parts.per_head(n, 1, init=init_dt_bias, flat=True)
        self.o_norm = parts.norm(self.d_v)
        self.linear_proj = parts.row(n * self.d_v, self.d_m)

    def mix(self, x, attention_mask, rotary_pos_emb, state):
        n, d_k, d_v, K = self.n_local, self.d_k, self.d_v, self.conv_size
        proj = self.linear_in(x)  # the whole sequence under SP (the column projection gathers it)
        s, b = proj.shape[:2]
        proj = proj.view(s, b, n, self.qkv_width + d_v + 2)
        qkv, z, a, beta = proj.split([self.qkv_width, d_v, 1, 1], dim=-1)
        cache = state.cache(self.layer_number)
        keys = ("S", "conv") if K else ("S",)
        S, conv = (tuple(cached_state(cache, keys) or ()) + (None, None))[:2]
        dt = compute_dtype(x)  # the convolution, the gates and the kernel in fp32 (fp64 kept), autocast or not
        qkv = qkv.reshape(s, b, n * self.qkv_width).to(dt)
        if K:
            weight = self.conv.weight.view(n * self.qkv_width, K)
            qkv, conv = causal_conv(qkv, weight, conv, state.document_ids, need_state=cache is not None)
        q, k, v = F.silu(qkv).view(s, b, n, self.qkv_width).split([d_k, d_k, d_v], dim=-1)
        q, k = self.norm_qk(q, k)
        g = -self.A_log.weight.to(dt).exp() * F.softplus(a.squeeze(-1).to(dt) + self.dt_bias.weight.to(dt))
        heads_first = lambda t: t.permute(1, 2, 0, *range(3, t.dim()))  # noqa: E731 - [s, b, n, ...] -> [b, n, s, ...]
        q, k, v, g, beta = (heads_first(t) for t in (q, k, v, g, torch.sigmoid(beta.squeeze(-1).to(dt))))
        doc = document_rows(state.document_ids, q)
        out, S = gated_delta_causal(
            q, k, v, g, beta, self.chunk_size, S, cache is not None, doc, qk_l2norm=True, scale=self.score_scale(d_k)
        )
        store_state(cache, keys, (S, conv))
        out = self.o_norm(out.permute(2, 0, 1, 3)) * F.silu(z.to(dt))  # [s, b, n, d_v]
        return out.reshape(s, b, n * d_v).to(x.dtype)  # back to the layer's dtype (bf16 weights: linear_proj's)


# ----------------------------------------------------------------------------- self-description
# (megahash.models.registry / megahash.catalog: costs and capabilities; nothing else in the library names the kind)


class GatedDeltaNetCosts:
    """Not in [Xue25]. At the default options (d_k = d_v = d_h, K = 4, chunk 64), per layer: Q/K/V part
    (everything but ``linear_proj``) d_m n (4 d_h + 2) + 12 n d_h + 2n + d_h; GEMM FLOPs of the
    implementation (the triangular solve and the convolution are not GEMMs); decode cache
    n (d_h^2 + 3 (3 d_h)) numbers per sequence, constant in L."""

    @staticmethod
    def groups(n, g):
        return n

    @staticmethod
    def qkv_params(n, d, g):
        return n * d * n * (4 * d + 2) + n * 3 * d * 4 + 2 * n + d

    @staticmethod
    def time_complexity(B, L, d):
        return B * L * d * d

    @staticmethod
    def flops(phase, B, L, d, h=None, g=None, precomputed=False):
        """The input projection 2 d_m n (4 d_h + 2) per token, and per head: prefill, C = min(64, L), n_c
        chunks, P = n_c C padded tokens: k k^T, q k^T and scores u (2 P C (2 d_h + d_h)), with n_c > 1 the
        carried states (q S 2 P d_h^2, and per later chunk W S and K~^T u, 4 C d_h^2); decode (one token
        with the state): 4 d_h + 2 d_h + 6 d_h^2."""
        if h is None:
            raise ValueError("gated-deltanet's FLOPs need the number of heads h")
        dh = d // h
        proj = 2 * d * h * (4 * dh + 2)
        if phase == "decode":
            return B * (proj + h * (6 * dh + 6 * dh * dh))
        C = min(64, L)
        n = -(-L // C)
        P = n * C
        per_head = 6 * P * C * dh
        if n > 1:
            per_head += 2 * P * dh * dh + (n - 1) * 4 * C * dh * dh
        return B * (L * proj + h * per_head)

    @staticmethod
    def cache_elements(B, L, n, d_h, g, expand_v=1.0, conv_size=4, **_):
        d_v = round(d_h * expand_v)
        return B * n * (d_h * d_v + max(conv_size - 1, 0) * (2 * d_h + d_v))

    @classmethod
    def cache_bytes(cls, B, L, d, h, g=None):
        return 2 * cls.cache_elements(B, L, h, d // h, h)


@dataclass(frozen=True)
class GatedDeltaNetOptions:
    """``model.attention.options`` of gated-deltanet: value head width, convolution taps, the chunk."""

    chunk_size: int = 0  # chunk length of the chunked form (0 = auto: 64)
    expand_v: float = 1.0  # value head dim / key head dim (fla's expand_v)
    conv_size: int = 4  # taps of the short convolution of q, k, v (0 = none)
    RANGES = {
        "chunk_size": (0, None, False, False, "chunk length; 0 = auto"),
        "expand_v": (0, None, True, False, "gated-deltanet value head dim / key head dim"),
        "conv_size": (0, None, False, False, "gated-deltanet short convolution taps; 0 = none"),
    }


register_attention(
    "gated-deltanet",
    GatedDeltaNet,
    costs=GatedDeltaNetCosts,
    options=GatedDeltaNetOptions,
    caps=AttentionCaps(encoder=False, chunk_loop=True),
    maps=None,  # "unavailable" in megahash indicators: its output is linear in V but through a signed, unnormalised
    # matrix (the delta rule's I - beta k k^T products), not a row-stochastic map the indicators' formulas read
    groups=lambda n, g: n,
)
