"""``approx``: second-order Taylor approximation of softmax attention ([Xue25] sec. 4.3.3, eq. 4.6).

A ~ Taylor(Q K^T / sqrt(d_h)) following Based ([Arora24]): the kernel
k(q, k) = 1 + q.k/sqrt(d) + (q.k)^2/(2d) replaces exp(q.k/sqrt(d)), with ONE shared denominator,

    o_i = sum_{j<=i} k(q_i, k_j) v_j / sum_{j<=i} k(q_i, k_j),

and k(q, k) = phi(q).phi(k) for the feature map phi(x) = [1, x/d^(1/4), vec(x x^T)/(sqrt2 sqrt d)]
(dimension 1 + d + d^2; megahash packs the symmetric x x^T into its upper triangle, D = 1 + d + d(d+1)/2,
:mod:`megahash.ops.taylor.feature_map`), so it is linear attention with the recurrent form
S_i = S_{i-1} + phi(k_i) v_i^T, z_i = z_{i-1} + phi(k_i), o_i = phi(q_i) S_i / phi(q_i) z_i.
The kernel is always positive (1 + x + x^2/2 > 0), so the denominator is too.
Q, K, V = H W^{Q,K,V} (eq. 4.3) with RoPE on Q and K; the full head dimension d = d_h is used.

Forms (one copy each, :mod:`megahash.ops.taylor`; equal to 1e-10 in fp64):
- chunked (training, prefill): the Taylor kernel inside chunks of C tokens, the feature-map state
  between them, carried by a cumulative sum over chunks: batched GEMMs, no Python loop, no L x L
  map; ``model.attention.options.chunk_size`` (0 = auto: 128 for narrow features, 256 at full width; a
  sequence no longer than the chunk is the parallel masked-matrix form). The features are
  recomputed in backward (fused into their GEMMs). On CUDA with ``feature_dim=16`` and flash-linear-attention installed,
  fla's Based kernel runs instead;
- recurrent (decoding: the chunked form on one token with the carried state): the layer's decoding
  cache ``S`` [b, g, 1, D, d] and ``z`` [b, g, 1, D] per key/value group; naive (the masked L x L kernel
  matrix): the test oracle.
Encoders use the non-causal sums over the non-padded keys.
Packed documents (``ForwardState.document_ids``): the sums restart at each document start in every
form, without a loop over documents (docs/attention.md "Packed documents: linear and recurrent kinds"). Under autocast the kernels accumulate in
fp32 and return the input dtype (:mod:`megahash.ops.utils.fp32`; docs/attention.md "Numerics").

Note on [Xue25]: Appendix I (eq. 4.14-4.17) writes a different recurrence that normalises the
zeroth, first and second order terms separately and uses element-wise squares q^2, k^2; the
[Xue25] cost tables (Table 4.6-4.8: cache 6Bd + 4Bd^2/h bytes, i.e. three d-vectors and two
d_h x d_h matrices per head) describe that form's state. Its predictive results follow Based's
implementation, which is the shared-denominator form implemented here; ``megahash.models.costs``
gives both the [Xue25] table values and this implementation's cache sizes.
Based's projected feature dimension: ``model.attention.options.feature_dim`` d' (Based's default 16)
projects q, k to d' dims per head before the Taylor map (see :meth:`Taylor.build_grouped_qkv`).
Which form reproduces what: the [Xue25] cost tables (Tables 4.5-4.8, "Approx.") describe
``approx-thesis`` (Appendix I's recurrence); ``approx`` is the Based kernel.
Attention dropout is not applied (there is no probability matrix to drop from in the linear form).
Parameters equal ``mha`` exactly (``linear_q``, ``linear_kv``, ``linear_proj``) unless
``model.attention.options.feature_dim`` is set.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from megahash.errors import ConfigError
from megahash.models.attention.linear_base import LinearAttention
from megahash.models.attention.maps import kernel_maps
from megahash.models.cost_formulas import ApproxRow
from megahash.models.mixing import cached_state, rope, rope_prefix, store_state
from megahash.models.registry import AttentionCaps, register_attention
from megahash.ops.taylor.chunk import taylor_bidirectional, taylor_causal
from megahash.ops.taylor.feature_map import feature_dim as taylor_feature_dim
from megahash.ops.taylor.feature_map import taylor_kernel


class Taylor(LinearAttention):
    """Based's 2nd-order Taylor softmax (eq. 4.6, shared denominator) with RoPE; decoding state (S, z)."""

    def build(self, parts):
        self.chunk_size = int(self.setup.option("chunk_size", 0) or 0)
        self.build_grouped_qkv(parts, self.groups)

    def build_grouped_qkv(self, parts, groups: int) -> None:
        """``model.attention.options.feature_dim`` d' > 0 (Based's ``feature_dim``, [Arora24]): Q and
        K are projected to d' dims per head (``linear_q`` n*d' rows, ``linear_kv`` rows
        ``[g][k (d'), v (d_h)]``) and the Taylor map has D' = 1 + d' + d'(d'+1)/2 features instead of
        1 + d_h + d_h(d_h+1)/2: the state shrinks to D'(d_h + 1) per key/value head and the
        sublayer has (n + g)(d_h - d') d_m fewer parameters than ``mha`` (not parameter-matched).
        RoPE rotates the d' dims with the head's first d'/2 frequency pairs."""
        fd = int(self.setup.option("feature_dim", 0) or 0)
        self.feature_dim = fd or self.d_h
        if not fd or fd == self.d_h:
            return super().build_grouped_qkv(parts, groups)
        if fd < 0 or fd % 2:
            raise ConfigError(f"model.attention.options.feature_dim={fd} must be a positive even number (0 = head dim)")
        if groups < 1 or self.n % groups or groups % self.tp:
            raise ConfigError(
                f"approx with model.attention.options.feature_dim: {groups} key/value groups must divide "
                f"model.num_heads={self.n} and be divisible by parallel.tensor={self.tp}"
            )
        self.groups, self.kv_split, self.g_local = groups, True, groups // self.tp
        self.linear_q = parts.column(self.d_m, self.n * fd, self.qkv_bias)
        self.linear_kv = parts.column(self.d_m, groups * (fd + self.d_h), self.qkv_bias)
        if getattr(self, "q_layernorm", None) is not None:
            self.build_qk_norm(fd)

    def grouped_kv(self, x):
        if self.feature_dim == self.d_h:
            return super().grouped_kv(x)
        kv = self.linear_kv(x)
        kv = kv.view(kv.shape[0], kv.shape[1], self.g_local, self.feature_dim + self.d_h)
        return kv[..., : self.feature_dim], kv[..., self.feature_dim :]

    def qkv(self, x, rotary_pos_emb):
        q, k, v = super().qkv(x, rotary_pos_emb)
        if self.feature_dim != self.d_h:
            rotary_pos_emb = rope_prefix(rotary_pos_emb, self.feature_dim)
        return rope(q, rotary_pos_emb), rope(k, rotary_pos_emb), v

    def kernel(self, qh, kh, vh, km, cache, doc, offset):
        """Based's Taylor attention (eq. 4.6) on [b, g, rep, s, d], the decoding state (S, z) in ``cache``,
        sums restarting at the document starts of ``doc``."""
        if not self.causal:
            return taylor_bidirectional(qh, kh, vh, km, doc=doc)
        keys = ("S", "z")
        out, state = taylor_causal(qh, kh, vh, self.chunk_size, cached_state(cache, keys), cache is not None, doc=doc)
        store_state(cache, keys, state)
        return out


# ----------------------------------------------------------------------------- self-description
# (megahash.models.registry / megahash.catalog: costs and capabilities; nothing else in the library names the kind)


class ApproxCosts(ApproxRow):
    """The [Xue25] Approx. row (cost_formulas.ApproxRow); this kernel (Based's shared denominator)
    keeps the decode state S [D, d_h] and z [D] per key/value head, D = 1 + d' + d'(d'+1)/2 (d' = d_h
    by default)."""

    @staticmethod
    def cache_elements(B, L, n, d_h, g, feature_dim=0, **_):
        f = feature_dim or d_h
        return B * g * taylor_feature_dim(f) * (d_h + 1)


def approx_maps(m, q, k, v, attention_mask) -> dict:
    """Indicators (``maps=kernel_maps(approx_maps)``: megahash.models.attention.maps): the normalised
    equivalent attention matrix A_ij = k(q_i, k_j) / sum_{u<=i} k(q_i, k_u), Taylor kernel k = 1 + s + s^2/2,
    s = q.k/sqrt(d_h) (exactly what multiplies V); logits = s."""
    s = (q.double() @ k.double().transpose(-1, -2)) / math.sqrt(q.shape[-1])  # [b, g, rep, L, L]
    ker = taylor_kernel(q.double(), k.double())
    L = s.shape[-1]
    valid = torch.ones(L, L, dtype=torch.bool, device=s.device)
    valid = valid.tril() if m.causal else valid
    ker = ker * valid
    probs = ker / ker.sum(-1, keepdim=True)
    b = probs.shape[0]
    return {
        "source": "normalised Taylor kernel (1 + s + s^2/2), s = q.k/sqrt(d_h)",
        "probs": probs.reshape(b, -1, L, L),
        "logits": s.reshape(b, -1, L, L),
        "valid": valid,
        "check": lambda out: ((probs @ v.double()) - out.double()).abs().max().cpu(),
    }


@dataclass(frozen=True)
class ApproxOptions:
    """``model.attention.options`` of approx: the chunked form's chunk length, Based's feature dim d'."""

    chunk_size: int = 0  # chunk length of the chunked form (0 = auto)
    feature_dim: int = 0  # Based's projected feature dim d' of q, k before the Taylor map (0 = d_h)
    RANGES = {
        "chunk_size": (0, None, False, False, "chunk length; 0 = auto"),
        "feature_dim": (0, None, False, False, "approx's projected feature dim d'; 0 = d_h"),
    }


register_attention(
    "approx",
    Taylor,
    costs=ApproxCosts,
    options=ApproxOptions,
    maps=kernel_maps(approx_maps),
    caps=AttentionCaps(thesis_name="Approx.", chapters=(4,)),
    export_spec=lambda att: {
        "chunk_size": int(getattr(att, "chunk_size", 0) or 0),
        "feature_dim": int(att.feature_dim if att.feature_dim != att.d_h else 0),
    },
)
