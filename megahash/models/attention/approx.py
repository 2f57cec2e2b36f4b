"""``approx``: second-order Taylor approximation of softmax attention (thesis sec. 4.3.3, eq. 4.6).

A ~ Taylor(Q K^T / sqrt(d_h)) following Based (Arora et al. 2024): the kernel
k(q, k) = 1 + q.k/sqrt(d) + (q.k)^2/(2d) replaces exp(q.k/sqrt(d)), with ONE shared denominator,

    o_i = sum_{j<=i} k(q_i, k_j) v_j / sum_{j<=i} k(q_i, k_j),

and k(q, k) = phi(q).phi(k) for the feature map phi(x) = [1, x/d^(1/4), vec(x x^T)/(sqrt2 sqrt d)]
(dimension 1 + d + d^2; megahash packs the symmetric x x^T into its upper triangle, D = 1 + d + d(d+1)/2,
:mod:`megahash.ops.taylor.kernel`), so it is linear attention with the recurrent form
S_i = S_{i-1} + phi(k_i) v_i^T, z_i = z_{i-1} + phi(k_i), o_i = phi(q_i) S_i / phi(q_i) z_i.
The kernel is always positive (1 + x + x^2/2 > 0), so the denominator is too.
Q, K, V = H W^{Q,K,V} (eq. 4.3) with RoPE on Q and K; the full head dimension d = d_h is used.

Forms (one copy each, :mod:`megahash.ops.taylor`; equal to 1e-10 in fp64):
- chunked (training, prefill): the Taylor kernel inside chunks of C tokens, the feature-map state
  between them, carried by a cumulative sum over chunks: batched GEMMs, no Python loop, no L x L
  map; ``model.attention.chunk_size`` (0 = auto: 128 for narrow features, 256 at full width; a
  sequence no longer than the chunk is the parallel masked-matrix form). The features are
  recomputed in backward (fused into their GEMMs). On CUDA with ``feature_dim=16`` and flash-linear-attention installed,
  fla's Based kernel runs instead;
- recurrent (decoding: the chunked form on one token with the carried state): ``decode_cache``
  ``S`` [b, g, 1, D, d] and ``z`` [b, g, 1, D] per key/value group; naive (the masked L x L kernel
  matrix): the test oracle.
Encoders use the non-causal sums over the non-padded keys.

Note on the thesis: Appendix I (eq. 4.14-4.17) writes a different recurrence that normalises the
zeroth, first and second order terms separately and uses element-wise squares q^2, k^2; the
thesis's cost tables (Table 4.6-4.8: cache 6Bd + 4Bd^2/h bytes, i.e. three d-vectors and two
d_h x d_h matrices per head) describe that form's state. Its predictive results follow Based's
implementation, which is the shared-denominator form implemented here; ``megahash.models.costs``
gives both the thesis's table values and this implementation's cache sizes.
Based's projected feature dimension: ``model.attention.feature_dim`` d' (Based's default 16)
projects q, k to d' dims per head before the Taylor map (see :meth:`ApproxAttention.build_grouped_qkv`).
Which form reproduces what: the thesis's cost tables (Tables 4.5-4.8, "Approx.") describe
``approx-thesis`` (Appendix I's recurrence); ``approx`` is the Based kernel.
Attention dropout is not applied (there is no probability matrix to drop from in the linear form).
Parameters equal ``mha`` exactly (``linear_q``, ``linear_kv``, ``linear_proj``) unless
``model.attention.feature_dim`` is set.
"""
from __future__ import annotations

# ---- plain-torch reference (@register_reference; copied into the HF export): torch-only imports above its code
from megahash.models.registry import register_reference
from megahash.models.torch_model import LinearAttention
from megahash.models.torch_ops import cached_state, store_state
from megahash.ops.taylor.chunk import taylor_bidirectional, taylor_causal


@register_reference("approx")
class TaylorReference(LinearAttention):
    """Based's 2nd-order Taylor softmax (eq. 4.6, shared denominator) with RoPE; decoding state (S, z)."""

    projected_features = True

    def kernel(self, qh, kh, vh, km, cache, ctx):
        if not self.causal:
            return taylor_bidirectional(qh, kh, vh, km)
        keys = ("S", "z")
        out, state = taylor_causal(qh, kh, vh, self.chunk_size, cached_state(cache, keys), cache is not None)
        store_state(cache, keys, state)
        return out


# ---- megatron-core implementation
import math

import torch
from megatron.core.transformer.spec_utils import ModuleSpec

from megahash.errors import ConfigError
from megahash.models.attention.base import AttentionBase, column, rope
from megahash.models.attention.mha import GroupedKV
from megahash.models.registry import mask_type, register_attention
from megahash.ops.taylor.kernel import taylor_kernel


def compute_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


class LinearAttentionBase(GroupedKV, AttentionBase):
    """Q, K, V as ``mha`` (grouped); :meth:`attend` on [b, g, rep, s, d] runs the kind's plain-torch
    reference ``kernel`` (``reference``: its class), so the kernel and its cache handling exist once."""

    reference = None

    def __init__(self, config, layer_number, attn_mask_type, cfg=None, groups: int | None = None, **kw):
        super().__init__(config, layer_number, attn_mask_type, cfg, **kw)
        self.build_grouped_qkv(groups or config.num_query_groups or self.n)
        self.build_proj(self.n * self.d_h)
        self.chunk_size = cfg.model.attention.chunk_size if cfg is not None else 0

    def qkv(self, x, rotary_pos_emb):
        q = self.grouped_q(x)
        k, v = self.local_kv(*self.grouped_kv(x))
        q, k = self.norm_qk(q, k)
        return q, k, v

    def attend(self, q, k, v, attention_mask):
        key_mask = None if self.causal else self.key_padding(attention_mask, q.shape[0])
        key_mask = None if key_mask is None else key_mask[:, None, None, :]
        return self.reference.kernel(self, q, k, v, key_mask, self.cache(), self.context())

    def mix(self, x, attention_mask, rotary_pos_emb):
        q, k, v = self.qkv(x, rotary_pos_emb)
        s, b, n_l, d = q.shape
        g = k.shape[2]
        dt = compute_dtype(q)
        qh = q.permute(1, 2, 0, 3).reshape(b, g, n_l // g, s, d).to(dt)
        kh = k.permute(1, 2, 0, 3).unsqueeze(2).to(dt)
        vh = v.permute(1, 2, 0, 3).unsqueeze(2).to(dt)
        out = self.attend(qh, kh, vh, attention_mask)  # [b, g, rep, s, d_v]
        d_v = out.shape[-1]
        return out.reshape(b, n_l, s, d_v).permute(2, 0, 1, 3).reshape(s, b, n_l * d_v).to(x.dtype)


def rope_prefix(freqs, dim: int):
    """RoPE frequencies of a d_h-dim head restricted to ``dim`` < d_h dims: megatron's layout is
    [f_0..f_{d/2-1}, f_0..f_{d/2-1}] (pairs (i, i + d/2)); keep the first dim/2 pairs."""
    if freqs is None:
        return None
    freqs = freqs[0] if isinstance(freqs, tuple) else freqs
    half = freqs.shape[-1] // 2
    return torch.cat([freqs[..., :dim // 2], freqs[..., half:half + dim // 2]], dim=-1)


class ApproxAttention(LinearAttentionBase):
    kind = "approx"
    reference = TaylorReference

    def build_grouped_qkv(self, groups: int) -> None:
        """``model.attention.feature_dim`` d' > 0 (Based's ``feature_dim``, Arora et al. 2024): Q and
        K are projected to d' dims per head (``linear_q`` n*d' rows, ``linear_kv`` rows
        ``[g][k (d'), v (d_h)]``) and the Taylor map has D' = 1 + d' + d'(d'+1)/2 features instead of
        1 + d_h + d_h(d_h+1)/2: the state shrinks to D'(d_h + 1) per key/value head and the
        sublayer has (n + g)(d_h - d') d_m fewer parameters than ``mha`` (not parameter-matched).
        RoPE rotates the d' dims with the head's first d'/2 frequency pairs."""
        fd = self.cfg.model.attention.feature_dim if self.cfg is not None else 0
        self.feature_dim = fd or self.d_h
        if not fd or fd == self.d_h:
            return super().build_grouped_qkv(groups)
        if fd < 0 or fd % 2:
            raise ConfigError(f"model.attention.feature_dim={fd} must be a positive even number (0 = head dim)")
        if groups < 1 or self.n % groups or groups % self.tp:
            raise ConfigError(f"approx with model.attention.feature_dim: {groups} key/value groups must divide "
                              f"model.num_heads={self.n} and be divisible by parallel.tensor={self.tp}")
        self.groups, self.kv_split, self.g_local = groups, True, groups // self.tp
        self.linear_q = column(self.d_m, self.n * fd, self.config, self.qkv_bias)
        self.linear_kv = column(self.d_m, groups * (fd + self.d_h), self.config, self.qkv_bias)
        if getattr(self, "q_layernorm", None) is not None:
            self.build_qk_norm(fd)

    def grouped_kv(self, x):
        if self.feature_dim == self.d_h:
            return super().grouped_kv(x)
        kv = self.linear_kv(x)[0]
        kv = kv.view(kv.shape[0], kv.shape[1], self.g_local, self.feature_dim + self.d_h)
        return kv[..., :self.feature_dim], kv[..., self.feature_dim:]

    def qkv(self, x, rotary_pos_emb):
        q, k, v = super().qkv(x, rotary_pos_emb)
        if self.feature_dim != self.d_h:
            rotary_pos_emb = rope_prefix(rotary_pos_emb, self.feature_dim)
        return rope(q, rotary_pos_emb, self.config), rope(k, rotary_pos_emb, self.config), v


# ----------------------------------------------------------------------------- self-description
# (megahash.models.registry / catalog: costs and capabilities; nothing else in the library names the kind)

from megahash.models.costs import StandardQKV, taylor_feature_dim  # noqa: E402
from megahash.models.registry import AttentionCaps  # noqa: E402


class ApproxCosts(StandardQKV):
    """Thesis Tables 4.5-4.8, Approx. row: O(BLd^2); FLOPs 14BLd^2 (prefill), 10Bd^2 (decode);
    activations 11BLd/t + 3Bd^2/(ht); cache 6Bd + 4Bd^2/h bytes. The row describes Appendix I's
    form (the ``approx-thesis`` kind); this kernel (Based's shared denominator) keeps the decode
    state S [D, d_h] and z [D] per key/value head, D = 1 + d' + d'(d'+1)/2 (d' = d_h by default)."""

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

    @staticmethod
    def cache_elements(B, L, n, d_h, g, feature_dim=0, **_):
        f = feature_dim or d_h
        return B * g * taylor_feature_dim(f) * (d_h + 1)


def approx_maps(m, q, k, v, attention_mask) -> dict:
    """Indicators (megahash.eval.indicators): the normalised equivalent attention matrix
    A_ij = k(q_i, k_j) / sum_{u<=i} k(q_i, k_u), Taylor kernel k = 1 + s + s^2/2, s = q.k/sqrt(d_h)
    (exactly what multiplies V); logits = s."""
    s = (q.double() @ k.double().transpose(-1, -2)) / math.sqrt(q.shape[-1])  # [b, g, rep, L, L]
    ker = taylor_kernel(q.double(), k.double())
    L = s.shape[-1]
    valid = torch.ones(L, L, dtype=torch.bool, device=s.device)
    valid = valid.tril() if m.causal else valid
    ker = ker * valid
    probs = ker / ker.sum(-1, keepdim=True)
    b = probs.shape[0]
    return {"source": "normalised Taylor kernel (1 + s + s^2/2), s = q.k/sqrt(d_h)",
            "probs": probs.reshape(b, -1, L, L), "logits": s.reshape(b, -1, L, L), "valid": valid,
            "check": lambda out: ((probs @ v.double()) - out.double()).abs().max().cpu()}


@register_attention("approx", costs=ApproxCosts, maps=approx_maps, caps=AttentionCaps(thesis_name="Approx.", chapters=(4,)),
                    export_spec=lambda att: {"chunk_size": int(getattr(att, "chunk_size", 0) or 0)})
def approx_spec(cfg) -> ModuleSpec:
    return ModuleSpec(module=ApproxAttention, params={"attn_mask_type": mask_type(cfg), "cfg": cfg})
