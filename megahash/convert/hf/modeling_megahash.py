"""Megahash language models in transformers (remote code written by ``megahash export-hf``).

Self-contained: torch + transformers (+ numpy through ``hashing_megahash`` for raw text), no
megatron-core, DeepSpeed or megahash import. Parameter names are megahash's TP=1 names
(``model.embedding.*``, ``model.decoder.layers.N.self_attention.linear_q.weight``, ...,
``output_layer.weight``, ``head.linear.*``), so the export is a plain copy of the weights and the
import its inverse.

Architecture (``MegahashLM`` of megahash/models/model.py): embedding (vocab / hash-emb / pool / add /
proj / bert-hash / rolling, special-token table) -> pre-norm layers (RMSNorm + SwiGLU for decoders,
LayerNorm + GELU with biases for encoders), one attention kind per layer from the schedule, layers of
`skip` mode are identities -> final norm -> head (vocab logits, tied or not; hash-bits; hash-bucket;
Shuffle+Random). RoPE is megatron's non-interleaved rotary (rotate_half), base ``rope_theta``.

Attention kinds and their ``generate()`` caches (:class:`MegahashCache`, one dict per layer, batch
first): softmax kinds ``mha gqa mqa sha skv el-att mhe-add mhe-mul staticembqk`` keep keys/values;
``approx`` the Taylor feature-map state (S, z); ``nonapprox`` the running (max, numerator,
denominator); ``rndembqk``/``fixedseqqk`` the values only: their Q, K come from the fixed input
(random ``epsilon`` or fixed ``tokens``, stored as buffers) run once through the stack and kept as
cached maps (recomputed in training mode or after :meth:`MegahashPreTrainedModel.reset_fixed_maps`);
``mlp`` needs nothing.

Hash embeddings read ``hash_codes`` [b, s, width] (the data stage's side-shard codes); the model's
``encode_text(text)`` computes ids and codes with ``hashing_megahash.TextCoder`` (files of the
exported folder), and ``generate()`` computes the codes of generated tokens the same way.
"""
from __future__ import annotations

import math
import os
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import PreTrainedModel
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast, MaskedLMOutput

try:
    from transformers import GenerationMixin
except ImportError:  # pragma: no cover - very old transformers
    GenerationMixin = object
try:
    from transformers.cache_utils import Cache as _CacheBase
except ImportError:  # pragma: no cover
    _CacheBase = object

from .configuration_megahash import MegahashConfig

NUM_SPECIAL = 5
EOS_ID = 2


# =============================================================================== cache

class MegahashCache(_CacheBase):
    """Decoding state of every layer (dicts of batch-first tensors) and the number of tokens seen."""

    is_compileable = False

    def __init__(self, num_layers: int):
        try:
            super().__init__(layers=[])
        except TypeError:  # pragma: no cover - other Cache signatures
            pass
        self.states = [dict() for _ in range(num_layers)]
        self.offset = 0

    def __len__(self):
        return len(self.states)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.offset

    def get_max_length(self, layer_idx=None) -> int:
        return -1

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        return -1

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return self.offset

    @property
    def is_croppable(self) -> bool:
        return False

    @property
    def is_initialized(self) -> bool:
        return self.offset > 0

    @property
    def batch_size(self) -> int:
        for st in self.states:
            for v in st.values():
                return v.shape[0]
        return -1

    def reset(self):
        self.states = [dict() for _ in self.states]
        self.offset = 0

    def _map(self, fn):
        for st in self.states:
            for k in list(st):
                st[k] = fn(st[k])

    def reorder_cache(self, beam_idx):
        self._map(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_select_indices(self, indices):
        self._map(lambda t: t[indices])

    def batch_repeat_interleave(self, repeats: int):
        self._map(lambda t: t.repeat_interleave(repeats, dim=0))

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove:
            raise NotImplementedError("MegahashCache cannot be cropped (recurrent states of linear attention kinds)")


def _append(cache: Optional[dict], key: str, t: torch.Tensor, dim: int = 2) -> torch.Tensor:
    if cache is None:
        return t
    if key in cache:
        t = torch.cat([cache[key], t], dim=dim)
    cache[key] = t
    return t


# =============================================================================== helpers

def megahash_option(config, section: str, key: str, default=None):
    """A field of the resolved megahash config tree carried by the export (``config.megahash_config``)."""
    tree = getattr(config, "megahash_config", None) or {}
    node = tree.get(section) or {}
    if "." in key:
        outer, key = key.split(".", 1)
        node = node.get(outer) or {}
    return node.get(key, default)


def is_roberta(config) -> bool:
    """``model.layout=roberta``: post-LN layers, learned positions, token types, embedding LayerNorm."""
    return megahash_option(config, "model", "layout", "prenorm") == "roberta"


def thesis_sq(x):
    return x.square() * (1.0 / math.sqrt(2.0))


def thesis_den(den):
    return torch.where(den >= 0, den.clamp_min(1e-6), den.clamp_max(-1e-6))


def thesis_state(k, v):
    k2 = thesis_sq(k)
    return [v.sum(-2), k.transpose(-1, -2) @ v, k.sum(-2), k2.transpose(-1, -2) @ v, k2.sum(-2)]


def thesis_causal(q, k, v, chunk: int, state=None, offset: int = 0, need_state: bool = False):
    """``approx-thesis``: eq. 4.14-4.17 (separately normalised orders, element-wise squares), chunked."""
    s = q.shape[-1] ** -0.25
    q, k = q * s, k * s
    L, outs = q.shape[-2], []
    state = list(state) if state is not None else None
    for start in range(0, L, chunk):
        qc, kc, vc = q[..., start:start + chunk, :], k[..., start:start + chunk, :], v[..., start:start + chunk, :]
        c = qc.shape[-2]
        mask = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
        q2, k2 = thesis_sq(qc), thesis_sq(kc)
        a1 = (qc @ kc.transpose(-1, -2)).masked_fill(~mask, 0)
        a2 = (q2 @ k2.transpose(-1, -2)).masked_fill(~mask, 0)
        num0, num1, den1, num2, den2 = vc.cumsum(-2), a1 @ vc, a1.sum(-1), a2 @ vc, a2.sum(-1)
        if state is not None:
            s0, s1, z1, s2, z2 = state
            num0 = num0 + s0.unsqueeze(-2)
            num1, den1 = num1 + qc @ s1, den1 + (qc @ z1.unsqueeze(-1)).squeeze(-1)
            num2, den2 = num2 + q2 @ s2, den2 + (q2 @ z2.unsqueeze(-1)).squeeze(-1)
        cnt = torch.arange(offset + start + 1, offset + start + c + 1, dtype=q.dtype, device=q.device)
        outs.append(num0 / cnt.unsqueeze(-1) + num1 / thesis_den(den1).unsqueeze(-1) + num2 / thesis_den(den2).unsqueeze(-1))
        if start + chunk < L or need_state:
            new = thesis_state(kc, vc)
            state = new if state is None else [a + b for a, b in zip(state, new)]
    return torch.cat(outs, dim=-2), (tuple(state) if need_state else None)


def thesis_bidirectional(q, k, v, key_mask=None):
    s = q.shape[-1] ** -0.25
    q, k = q * s, k * s
    if key_mask is not None:
        w = key_mask.unsqueeze(-1).to(k.dtype)
        k, v, cnt = k * w, v * w, w.sum(-2)
    else:
        cnt = torch.full((1,), float(k.shape[-2]), dtype=k.dtype, device=k.device)
    s0, s1, z1, s2, z2 = thesis_state(k, v)
    q2 = thesis_sq(q)
    return ((s0 / cnt).unsqueeze(-2) + (q @ s1) / thesis_den((q @ z1.unsqueeze(-1)).squeeze(-1)).unsqueeze(-1)
            + (q2 @ s2) / thesis_den((q2 @ z2.unsqueeze(-1)).squeeze(-1)).unsqueeze(-1))

def rope_cos_sin(offset: int, length: int, dim: int, base: float, device) -> tuple:
    """cos/sin [length, dim] of megatron's RotaryEmbedding (non-interleaved) at positions offset.."""
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim))
    seq = torch.arange(length, device=device, dtype=torch.float32) + offset
    freqs = torch.outer(seq, inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return torch.cos(emb), torch.sin(emb)


def apply_rope(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """t [b, heads, s, d] (or [heads, s, d]); t cos + rotate_half(t) sin."""
    x1, x2 = torch.chunk(t, 2, dim=-1)
    rot = torch.cat((-x2, x1), dim=-1)
    return t * cos.to(t.dtype) + rot * sin.to(t.dtype)


def softmax_attention(q, k, v, causal: bool, key_mask=None, scale: Optional[float] = None):
    """q [b, n, sq, d], k/v [b, g, sk, d] (query head i uses group i // (n/g)) -> [b, sq, n*d]."""
    b, n, sq, d = q.shape
    if k.shape[1] != n:
        rep = n // k.shape[1]
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
    sk = k.shape[2]
    mask, is_causal = None, False
    if key_mask is not None:
        mask = key_mask[:, None, None, :].bool()
    elif causal:
        if sq == sk:
            is_causal = True
        else:
            mask = torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril(sk - sq)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal,
                                         scale=scale if scale is not None else 1.0 / math.sqrt(d))
    return out.transpose(1, 2).reshape(b, sq, n * d)


def _heads(t: torch.Tensor, n: int) -> torch.Tensor:
    """[b, s, n*d] -> [b, n, s, d]."""
    b, s, _ = t.shape
    return t.view(b, s, n, -1).transpose(1, 2)


# ----------------------------------------------------------------- approx (Taylor softmax, eq. 4.6)

def feature_dim(d: int) -> int:
    return 1 + d + d * d


def taylor_features(x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1]
    x2 = (x.unsqueeze(-1) * x.unsqueeze(-2)).flatten(-2) / (math.sqrt(2.0) * math.sqrt(d))
    return torch.cat([torch.ones_like(x[..., :1]), x / d ** 0.25, x2], dim=-1)


def taylor_kernel(q, k):
    s = q @ k.transpose(-1, -2) * (1.0 / math.sqrt(q.shape[-1]))
    return 1 + s + 0.5 * s.square()


def auto_chunk(length: int, d: int, chunk_size: int = 0) -> int:
    if chunk_size > 0:
        return chunk_size
    return length if length <= 2 * feature_dim(d) else 1024


def approx_causal(q, k, v, chunk: int, state=None, need_state: bool = False):
    L = q.shape[-2]
    outs = []
    for start in range(0, L, chunk):
        qc, kc, vc = q[..., start:start + chunk, :], k[..., start:start + chunk, :], v[..., start:start + chunk, :]
        c = qc.shape[-2]
        a = taylor_kernel(qc, kc)
        a = a * torch.ones(c, c, dtype=torch.bool, device=a.device).tril()
        num = a @ vc
        den = a.sum(-1)
        if state is not None:
            fq = taylor_features(qc)
            num = num + fq @ state[0]
            den = den + (fq @ state[1].unsqueeze(-1)).squeeze(-1)
        outs.append(num / den.unsqueeze(-1))
        if start + chunk < L or need_state:
            fk = taylor_features(kc)
            s_new, z_new = fk.transpose(-1, -2) @ vc, fk.sum(-2)
            state = (s_new, z_new) if state is None else (state[0] + s_new, state[1] + z_new)
    return torch.cat(outs, dim=-2), (state if need_state else None)


def approx_bidirectional(q, k, v, key_mask=None):
    d, T = q.shape[-1], k.shape[-2]
    if T <= 2 * feature_dim(d):
        a = taylor_kernel(q, k)
        if key_mask is not None:
            a = a * key_mask.unsqueeze(-2).to(a.dtype)
        return (a @ v) / a.sum(-1, keepdim=True)
    fk = taylor_features(k)
    if key_mask is not None:
        fk = fk * key_mask.unsqueeze(-1).to(fk.dtype)
    fq = taylor_features(q)
    return (fq @ (fk.transpose(-1, -2) @ v)) / (fq @ fk.sum(-2).unsqueeze(-1))


# ----------------------------------------------------------------- nonapprox (eq. 4.7-4.8, 4.18)

def nonapprox_causal(s, v, chunk: int, state=None, need_state: bool = False):
    L = s.shape[-1]
    outs = []
    for start in range(0, L, chunk):
        sc, vc = s[..., start:start + chunk], v[..., start:start + chunk, :]
        c = sc.shape[-1]
        run_max = torch.cummax(sc.detach(), dim=-1).values
        if state is not None:
            run_max = torch.maximum(run_max, state[0].unsqueeze(-1))
        logits = sc.unsqueeze(-2) - run_max.unsqueeze(-1)
        causal = torch.ones(c, c, dtype=torch.bool, device=s.device).tril()
        w = torch.exp(logits.masked_fill(~causal, float("-inf")))
        num = w @ vc
        den = w.sum(-1)
        if state is not None:
            carry = torch.exp(state[0].unsqueeze(-1) - run_max)
            num = num + carry.unsqueeze(-1) * state[1].unsqueeze(-2)
            den = den + carry * state[2].unsqueeze(-1)
        outs.append(num / den.unsqueeze(-1))
        if start + chunk < L or need_state:
            state = (run_max[..., -1], num[..., -1, :], den[..., -1])
    return torch.cat(outs, dim=-2), (state if need_state else None)


def nonapprox_bidirectional(s, v, key_mask=None):
    if key_mask is not None:
        s = s.masked_fill(~key_mask, float("-inf"))
    w = torch.softmax(s, dim=-1)
    o = (w.unsqueeze(-2) @ v).squeeze(-2)
    return o.unsqueeze(-2).expand(*o.shape[:-1], s.shape[-1], o.shape[-1])


# =============================================================================== attention kinds

class _Weight(nn.Module):
    """A bare [rows, cols] parameter named ``weight`` (megahash's PerHeadParameter)."""

    def __init__(self, rows: int, cols: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(rows, cols))


class AttentionBase(nn.Module):
    def __init__(self, config: MegahashConfig, spec: dict, proj_in: Optional[int] = None):
        super().__init__()
        self.kind = spec["kind"]
        self.n = config.num_attention_heads
        self.d = config.hidden_size // config.num_attention_heads
        self.d_m = config.hidden_size
        self.groups = int(spec.get("groups") or self.n)
        self.causal = config.arch == "decoder"
        self.qkv_bias = bool(config.qkv_bias)
        self.chunk_size = int(spec.get("chunk_size", 0) or 0)
        self.linear_proj = nn.Linear(proj_in or self.n * self.d, self.d_m, bias=config.arch != "decoder")
        if megahash_option(config, "model", "qk_norm", False) and self.kind != "mlp":  # Qwen3 QK-norm
            self.q_layernorm, self.k_layernorm = make_norm(config, self.d), make_norm(config, self.d)

    def norm_qk(self, q, k):
        if getattr(self, "q_layernorm", None) is None:
            return q, k
        return self.q_layernorm(q), self.k_layernorm(k)

    def forward(self, x, ctx, cache):
        return self.linear_proj(self.mix(x, ctx, cache))


class SoftmaxAttention(AttentionBase):
    """project -> RoPE on q, k -> KV cache -> softmax -> linear_proj (mha/gqa/mqa/sha/skv/el-att/mhe)."""

    def __init__(self, config, spec):
        kind = spec["kind"]
        d = config.hidden_size // config.num_attention_heads
        super().__init__(config, spec, proj_in=d if kind == "sha" else None)
        n, d_m, bias = self.n, self.d_m, self.qkv_bias
        if kind in ("mha", "gqa", "mqa"):
            self.linear_q = nn.Linear(d_m, n * d, bias=bias)
            self.linear_kv = nn.Linear(d_m, 2 * self.groups * d, bias=bias)
        elif kind == "skv":
            self.linear_q = nn.Linear(d_m, n * d, bias=bias)
            self.linear_kv = nn.Linear(d_m, n * d, bias=bias)
        elif kind == "el-att":
            self.linear_q = nn.Linear(d_m, n * d, bias=bias)
        elif kind == "sha":
            self.linear_qkv = nn.Linear(d_m, 3 * d, bias=bias)
        elif kind in ("mhe-add", "mhe-mul"):
            self.linear_qkv = nn.Linear(d_m, 3 * d, bias=bias)
            self.emb_q, self.emb_k, self.emb_v = _Weight(n, d), _Weight(n, d), _Weight(n, d)
        else:  # pragma: no cover
            raise ValueError(kind)

    def project(self, x):
        b, s, _ = x.shape
        kind, n, d = self.kind, self.n, self.d
        if kind in ("mha", "gqa", "mqa"):
            q = _heads(self.linear_q(x), n)
            kv = self.linear_kv(x).view(b, s, self.groups, 2, d)
            return q, kv[:, :, :, 0].transpose(1, 2), kv[:, :, :, 1].transpose(1, 2)
        if kind == "skv":
            kv = _heads(self.linear_kv(x), n)
            return _heads(self.linear_q(x), n), kv, kv
        if kind == "el-att":
            kv = _heads(x, n)
            return _heads(self.linear_q(x), n), kv, kv
        qkv = self.linear_qkv(x)
        if kind == "sha":
            qkv = qkv.view(b, s, 3, 1, d)
            return tuple(qkv[:, :, i].transpose(1, 2) for i in range(3))
        q, k, v = qkv.chunk(3, dim=-1)

        def psi(a, e):  # [b, s, d] x [n, d] -> [b, n, s, d]
            a = a.unsqueeze(2)
            out = a + e if kind == "mhe-add" else a * (e + 1)
            return out.transpose(1, 2)

        return psi(q, self.emb_q.weight), psi(k, self.emb_k.weight), psi(v, self.emb_v.weight)

    def mix(self, x, ctx, cache):
        q, k, v = self.project(x)
        q, k = self.norm_qk(q, k)
        q = apply_rope(q, ctx["cos"], ctx["sin"])
        k = apply_rope(k, ctx["cos"], ctx["sin"])
        k = _append(cache, "k", k)
        v = _append(cache, "v", v)
        return softmax_attention(q, k, v, self.causal, ctx.get("key_mask"))


class GatedMLPMixer(AttentionBase):
    """``mlp``: linear_proj(SiLU(linear_gate(x)) * linear_up(x)); no token mixing, no cache."""

    def __init__(self, config, spec):
        width = int(spec["width"])
        super().__init__(config, spec, proj_in=width)
        self.linear_gate = nn.Linear(self.d_m, width, bias=self.qkv_bias)
        self.linear_up = nn.Linear(self.d_m, width, bias=self.qkv_bias)

    def mix(self, x, ctx, cache):
        return F.silu(self.linear_gate(x)) * self.linear_up(x)


class LinearAttention(AttentionBase):
    """``approx`` (Taylor softmax, RoPE) and ``nonapprox`` (SiLU queries, running softmax over time)."""

    def __init__(self, config, spec):
        super().__init__(config, spec)
        fd = int(megahash_option(config, "model", "attention.feature_dim", 0) or 0) if self.kind == "approx" else 0
        self.fd = fd if fd and fd != self.d else 0  # Based's projected feature dim d' of q, k
        self.linear_q = nn.Linear(self.d_m, self.n * (self.fd or self.d), bias=self.qkv_bias)
        if self.fd:  # rows [g][k (d'), v (d_h)]
            self.linear_kv = nn.Linear(self.d_m, self.groups * (self.fd + self.d), bias=self.qkv_bias)
            if getattr(self, "q_layernorm", None) is not None:
                self.q_layernorm, self.k_layernorm = make_norm(config, self.fd), make_norm(config, self.fd)
        else:
            self.linear_kv = nn.Linear(self.d_m, 2 * self.groups * self.d, bias=self.qkv_bias)

    def mix(self, x, ctx, cache):
        b, s, _ = x.shape
        n, g, d = self.n, self.groups, self.d
        q = _heads(self.linear_q(x), n)
        cos, sin = ctx["cos"], ctx["sin"]
        if self.fd:
            kv = self.linear_kv(x).view(b, s, g, self.fd + d)
            k, v = kv[..., :self.fd].transpose(1, 2), kv[..., self.fd:].transpose(1, 2)
            h, f2 = d // 2, self.fd // 2  # RoPE with the head's first d'/2 frequency pairs
            cos = torch.cat([cos[..., :f2], cos[..., h:h + f2]], -1)
            sin = torch.cat([sin[..., :f2], sin[..., h:h + f2]], -1)
        else:
            kv = self.linear_kv(x).view(b, s, g, 2, d)
            k, v = kv[:, :, :, 0].transpose(1, 2), kv[:, :, :, 1].transpose(1, 2)
        q, k = self.norm_qk(q, k)
        if self.kind in ("approx", "approx-thesis"):
            q = apply_rope(q, cos, sin)
            k = apply_rope(k, cos, sin)
        else:
            q = F.silu(q)
        dt = torch.float64 if q.dtype == torch.float64 else torch.float32
        qh = q.reshape(b, g, n // g, s, q.shape[-1]).to(dt)
        kh, vh = k.unsqueeze(2).to(dt), v.unsqueeze(2).to(dt)
        key_mask = ctx.get("key_mask")
        km = None if key_mask is None else key_mask[:, None, None, :].bool()
        if self.kind == "approx-thesis":
            if not self.causal:
                out = thesis_bidirectional(qh, kh, vh, km)
            else:
                keys = ("s0", "s1", "z1", "s2", "z2")
                state = tuple(cache[k_] for k_ in keys) if cache is not None and "s0" in cache else None
                out, state = thesis_causal(qh, kh, vh, self.chunk_size or 128, state, ctx.get("offset", 0) if state else 0,
                                           cache is not None)
                if cache is not None:
                    cache.update(zip(keys, state))
        elif self.kind == "approx":
            if not self.causal:
                out = approx_bidirectional(qh, kh, vh, km)
            else:
                state = (cache["S"], cache["z"]) if cache is not None and "S" in cache else None
                out, state = approx_causal(qh, kh, vh, auto_chunk(s, qh.shape[-1], self.chunk_size), state, cache is not None)
                if cache is not None:
                    cache["S"], cache["z"] = state
        else:
            sc = (qh * kh).sum(-1) / math.sqrt(d)
            if not self.causal:
                out = nonapprox_bidirectional(sc, vh, km)
            else:
                state = (cache["m"], cache["num"], cache["den"]) if cache is not None and "m" in cache else None
                out, state = nonapprox_causal(sc, vh, self.chunk_size or 128, state, cache is not None)
                if cache is not None:
                    cache["m"], cache["num"], cache["den"] = state
        return out.reshape(b, n, s, d).transpose(1, 2).reshape(b, s, n * d).to(x.dtype)


class SeparateQKV(AttentionBase):
    def __init__(self, config, spec):
        super().__init__(config, spec)
        g = self.groups
        self.linear_q = nn.Linear(self.d_m, self.n * self.d, bias=self.qkv_bias)
        self.linear_k = nn.Linear(self.d_m, g * self.d, bias=self.qkv_bias)
        self.linear_v = nn.Linear(self.d_m, g * self.d, bias=self.qkv_bias)

    def qk(self, x, cos, sin):
        q, k = self.norm_qk(_heads(self.linear_q(x), self.n), _heads(self.linear_k(x), self.groups))
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin)


class StaticEmbQK(SeparateQKV):
    """``staticembqk``: Q, K from the layer-0 embeddings (RoPE), V from the hidden states; KV cache."""

    def mix(self, x, ctx, cache):
        q, k = self.qk(ctx["embeddings"], ctx["cos"], ctx["sin"])
        v = _heads(self.linear_v(x), self.groups)
        k = _append(cache, "k", k)
        v = _append(cache, "v", v)
        return softmax_attention(q, k, v, self.causal, ctx.get("key_mask"))


class FixedQK(SeparateQKV):
    """``rndembqk``/``fixedseqqk``: ONE attention map from the fixed input's Q, K (cached maps), values
    of every sequence; the decoding cache holds the values only."""

    def shared_attend(self, q, k, v, key_mask=None):
        """q [n, s, d], k [g, sk, d] (batch-shared), v [b, g, sk, d] -> [b, s, n*d]."""
        n, s, d = q.shape
        g, sk = k.shape[0], k.shape[1]
        b = v.shape[0]
        rep = n // g
        qh = q.reshape(g, rep, s, d)
        scores = (qh @ k.unsqueeze(1).transpose(-1, -2)) * (1.0 / math.sqrt(d))  # [g, rep, s, sk]
        if self.causal:
            keep = torch.ones(s, sk, dtype=torch.bool, device=q.device).tril(sk - s)
            scores = scores.masked_fill(~keep, float("-inf"))
        probs = torch.softmax(scores.to(torch.promote_types(scores.dtype, torch.float32)), dim=-1).to(v.dtype)
        if key_mask is None:
            out = torch.einsum("grst,bgtd->bgrsd", probs, v)
        else:
            m = key_mask.to(v.dtype)  # [b, sk]
            out = torch.einsum("grst,bgtd->bgrsd", probs, v * m[:, None, :, None])
            out = out / torch.einsum("grst,bt->bgrs", probs, m).unsqueeze(-1)
        return out.reshape(b, n, s, d).transpose(1, 2).reshape(b, s, n * d)

    def mix(self, x, ctx, cache):
        capture = ctx.get("capture")
        v = _heads(self.linear_v(x), self.groups)
        if capture is not None:  # the fixed input's own pass: standard attention, Q and K recorded
            q, k = self.qk(x, ctx["cos"], ctx["sin"])
            capture[ctx["layer"]] = (q[0], k[0])
            return self.shared_attend(q[0], k[0], v)
        q_all, k_all = ctx["fixed"][ctx["layer"]]
        off, s = ctx["offset"], x.shape[1]
        if off + s > q_all.shape[1]:
            raise ValueError(f"{self.kind}: positions up to {off + s} exceed the fixed input ({q_all.shape[1]} positions)")
        v = _append(cache, "v", v)
        return self.shared_attend(q_all[:, off:off + s], k_all[:, :off + s], v, ctx.get("key_mask"))


def build_attention(config, spec):
    kind = spec["kind"]
    if kind in ("mha", "gqa", "mqa", "sha", "skv", "el-att", "mhe-add", "mhe-mul"):
        return SoftmaxAttention(config, spec)
    if kind == "mlp":
        return GatedMLPMixer(config, spec)
    if kind in ("approx", "nonapprox", "approx-thesis"):
        return LinearAttention(config, spec)
    if kind == "staticembqk":
        return StaticEmbQK(config, spec)
    if kind in ("rndembqk", "fixedseqqk"):
        return FixedQK(config, spec)
    raise ValueError(f"unsupported attention kind {kind!r}")


# =============================================================================== layers

class MLP(nn.Module):
    """SwiGLU (decoder: fc1 rows [gate; up], no biases) or GELU with biases (encoder)."""

    def __init__(self, config):
        super().__init__()
        self.gated = config.arch == "decoder"
        f, h = config.intermediate_size, config.hidden_size
        self.linear_fc1 = nn.Linear(h, 2 * f if self.gated else f, bias=not self.gated)
        self.linear_fc2 = nn.Linear(f, h, bias=not self.gated)

    def forward(self, x):
        y = self.linear_fc1(x)
        if self.gated:
            a, b = torch.chunk(y, 2, dim=-1)
            y = F.silu(a) * b
        else:
            y = F.gelu(y)
        return self.linear_fc2(y)


def make_norm(config, size: Optional[int] = None):
    if config.arch == "decoder":
        return nn.RMSNorm(size or config.hidden_size, eps=config.norm_eps)
    return nn.LayerNorm(size or config.hidden_size, eps=config.norm_eps)


class Layer(nn.Module):
    def __init__(self, config, spec):
        super().__init__()
        self.kind = spec["kind"]
        self.skip = bool(spec.get("skip", False))
        self.input_layernorm = make_norm(config)
        self.self_attention = build_attention(config, spec)
        self.pre_mlp_layernorm = make_norm(config)
        self.mlp = MLP(config)
        self.post_norm = is_roberta(config)

    def forward(self, x, ctx, cache):
        if self.skip:  # `skip` mode: the whole layer is an identity
            return x
        if self.post_norm:  # model.layout=roberta: post-LN (input_layernorm after attention, pre_mlp_layernorm after MLP)
            x = self.input_layernorm(x + self.self_attention(x, ctx, cache))
            return self.pre_mlp_layernorm(x + self.mlp(x))
        x = x + self.self_attention(self.input_layernorm(x), ctx, cache)
        return x + self.mlp(self.pre_mlp_layernorm(x))


class Decoder(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.layers = nn.ModuleList([Layer(config, spec) for spec in config.layer_specs])
        self.final_layernorm = None if is_roberta(config) else make_norm(config)


class RobertaEmbeddingExtras(nn.Module):
    """``model.layout=roberta``: LayerNorm(emb + P[pos] + T[0]), positions 2.. for real tokens, 1 for padding."""

    def __init__(self, config):
        super().__init__()
        h = config.hidden_size
        self.position_embeddings = nn.Embedding(config.max_position_embeddings + 2, h)
        self.token_type_embeddings = nn.Embedding(max(1, int(megahash_option(config, "model", "type_vocab_size", 1))), h)
        self.layernorm = nn.LayerNorm(h, eps=config.norm_eps)

    def forward(self, emb, key_mask=None):
        b, s = emb.shape[:2]
        idx = torch.arange(s, device=emb.device).unsqueeze(0).expand(b, s) + 2
        if key_mask is not None:
            idx = torch.where(key_mask.bool(), idx, torch.ones_like(idx))
        extra = self.position_embeddings(idx) + self.token_type_embeddings(torch.zeros_like(idx))
        return self.layernorm(emb + extra.to(emb.dtype))


# =============================================================================== embeddings

def unpack_bits(codes: torch.Tensor) -> torch.Tensor:
    """uint8 [..., T/8] packed MSB first -> uint8 [..., T]."""
    shifts = torch.arange(7, -1, -1, dtype=torch.uint8, device=codes.device)
    bits = (codes.to(torch.uint8).unsqueeze(-1) >> shifts) & 1
    return bits.reshape(*codes.shape[:-1], codes.shape[-1] * 8)


def md5_mod(codes: torch.Tensor, n: int) -> torch.Tensor:
    c = codes.long()
    r = torch.zeros(codes.shape[:-1], dtype=torch.long, device=codes.device)
    for j in range(codes.shape[-1]):
        r = (r * 256 + c[..., j]) % n
    return r


def rsqrt_or_zero(x):
    return torch.where(x > 0, torch.rsqrt(x.clamp_min(1e-30)), torch.zeros_like(x))


class VocabEmbedding(nn.Module):
    tieable = True

    def __init__(self, config):
        super().__init__()
        self.word_embeddings = nn.Embedding(config.padded_vocab_size, config.hidden_size)

    @property
    def weight(self):
        return self.word_embeddings.weight

    def forward(self, tokens, codes=None):
        return self.word_embeddings(tokens)


class HashEmbeddingBase(nn.Module):
    """Special table (ids 0-4) + the word embedding of subclasses (``embed_words``)."""

    tieable = False
    needs_codes = True

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.special = nn.Parameter(torch.zeros(NUM_SPECIAL, config.hidden_size))

    def check(self, codes, width):
        if codes is None:
            raise ValueError(f"embedding {self.config.embedding!r} reads word-hash codes: pass hash_codes "
                             f"[batch, seq, {width}] (model.encode_text(text) computes them)")
        if codes.shape[-1] != width:
            raise ValueError(f"hash_codes width {codes.shape[-1]} != {width} ({self.config.hash_spec})")

    def special_rows(self, tokens):
        """Row of ``special`` of each token, by role (bos pad eos unk mask = rows 0-4; the ids are
        the tokenizer's, ``megahash_config.data.special_ids``; default the word ids 0-4); -1 else."""
        return special_rows(tokens, self.config)

    def forward(self, tokens, codes=None):
        rows = self.special_rows(tokens)
        word = rows < 0
        emb = self.embed_words(tokens, codes, word)
        special = self.special[rows.clamp(0, NUM_SPECIAL - 1)].to(emb.dtype)
        return torch.where(word.unsqueeze(-1), emb, special)


SPECIAL_ROLES = ("bos", "pad", "eos", "unk", "mask")


def special_ids(config) -> list:
    """The tokenizer's id of each special role (-1 if absent) from the exported megahash config."""
    ids = ((getattr(config, "megahash_config", None) or {}).get("data") or {}).get("special_ids") or {}
    if not ids:
        return list(range(NUM_SPECIAL))
    return [-1 if ids.get(r) is None else int(ids[r]) for r in SPECIAL_ROLES]


def special_rows(tokens, config):
    rows = torch.full_like(tokens, -1)
    for r, i in reversed(list(enumerate(special_ids(config)))):
        if i >= 0:
            rows = torch.where(tokens == i, torch.full_like(tokens, r), rows)
    return rows


class HashBucketEmbedding(HashEmbeddingBase):
    def __init__(self, config):
        super().__init__(config)
        e = config.embed
        self.num_rows, self.mode, self.padded_rows = int(e["num_rows"]), e["mode"], int(e["padded_rows"])
        self.table = nn.Embedding(self.padded_rows, config.hidden_size)

    def embed_words(self, tok, codes, word):
        if self.mode == "md5":
            self.check(codes, 16)
            ids = md5_mod(codes, self.num_rows)
        else:
            self.check(codes, 1)
            ids = codes[..., 0].long()
        return self.table(ids * word)


class PoolEmbedding(HashEmbeddingBase):
    def __init__(self, config):
        super().__init__(config)
        e, h = config.embed, config.hidden_size
        self.num_bits, self.k = int(e["num_bits"]), int(e["pool_bits"])
        self.num_chunks = -(-self.num_bits // self.k)
        self.codebook = nn.Parameter(torch.zeros(2 ** self.k, h))
        self.chunk_logits = nn.Parameter(torch.zeros(self.num_chunks, h))
        self.word_row = nn.Parameter(torch.zeros(h))

    def chunk_weights(self, device):
        w = torch.zeros(self.num_bits, self.num_chunks, device=device)
        for t in range(self.num_bits):
            i, m = divmod(t, self.k)
            length = min(self.k, self.num_bits - i * self.k)
            w[t, i] = float(2 ** (length - 1 - m))
        return w

    def embed_words(self, tok, codes, word):
        self.check(codes, self.num_bits // 8)
        w_hat = torch.softmax(self.chunk_logits.float(), dim=0).to(self.codebook.dtype)
        c = torch.matmul(unpack_bits(codes).float(), self.chunk_weights(codes.device)).round_().long()
        out = self.codebook[c[..., 0]] * w_hat[0]
        for i in range(1, self.num_chunks):
            out = out + self.codebook[c[..., i]] * w_hat[i]
        out = out + self.word_row
        return out * word.unsqueeze(-1).to(out.dtype)


class AddEmbedding(HashEmbeddingBase):
    def __init__(self, config):
        super().__init__(config)
        self.num_bits = int(config.embed["num_bits"])
        self.codebooks = nn.Parameter(torch.zeros(self.num_bits, 2, config.hidden_size))
        self.word_row = nn.Parameter(torch.zeros(config.hidden_size))

    def embed_words(self, tok, codes, word):
        self.check(codes, self.num_bits // 8)
        dtype = self.codebooks.dtype
        g = 1.0 / math.sqrt(self.num_bits)
        b0, b1 = self.codebooks[:, 0], self.codebooks[:, 1]
        const = b0.sum(dim=0) * g + self.word_row
        a = torch.cat([(b1 - b0) * g, const.unsqueeze(0)], dim=0)
        bits = unpack_bits(codes) * word.unsqueeze(-1)
        x = torch.cat([bits, word.unsqueeze(-1)], dim=-1).to(dtype)
        return torch.matmul(x, a)


class ProjEmbedding(HashEmbeddingBase):
    def __init__(self, config):
        super().__init__(config)
        self.num_bits = int(config.embed["num_bits"])
        self.weight = nn.Parameter(torch.zeros(config.hidden_size, self.num_bits))
        self.word_row = nn.Parameter(torch.zeros(config.hidden_size))

    def embed_words(self, tok, codes, word):
        self.check(codes, self.num_bits // 8)
        t = self.num_bits
        bits = unpack_bits(codes).float()
        k = bits.sum(dim=-1, keepdim=True)
        scale = rsqrt_or_zero(k * (t - k) / t) * word.unsqueeze(-1)
        x = torch.cat([bits * scale, word.unsqueeze(-1).float()], dim=-1)
        w = self.weight.float()
        w = w - w.mean(dim=1, keepdim=True)
        w = w * rsqrt_or_zero(w.pow(2).sum(dim=1, keepdim=True))
        a = torch.cat([w.t(), self.word_row.float().unsqueeze(0)], dim=0)
        return torch.matmul(x, a).to(self.special.dtype)


class BertHashEmbedding(HashEmbeddingBase):
    needs_codes = False

    def __init__(self, config):
        super().__init__(config)
        p = int(config.embed["projections"])
        self.hash_table = nn.Parameter(torch.zeros(config.padded_vocab_size, p))
        self.proj = nn.Parameter(torch.zeros(config.hidden_size, p))

    def embed_words(self, tok, codes, word):
        x = F.embedding(tok, self.hash_table) * word.unsqueeze(-1).to(self.hash_table.dtype)
        return F.linear(x, self.proj)


def rolling_features(codes, seeds, parts, b: int, dim: int):
    """Code rows int [M, W] -> float32 [M, dim] (EELBERT, seed 001; megahash's rolling_features)."""
    codes = codes.long()
    per = seeds.shape[0]
    half = b // 2
    out = torch.zeros(codes.shape[0], dim, dtype=torch.float32, device=codes.device)
    run = 0
    for i, (start, size) in enumerate(parts, start=1):
        if size > 0 and codes.shape[0] > 0:
            s = codes[:, start:start + size]
            valid = s >= 0
            weights = valid.float() / valid.sum(dim=1, keepdim=True).clamp_min(1).float()
            uniq, inverse = torch.unique(s.clamp_min(0), return_inverse=True)
            hs = seeds[:, run:run + i].reshape(-1)
            q = torch.remainder(uniq.unsqueeze(-1) * hs, b)
            q = torch.where(q > half, q - b, q)
            values = (q.double() * (2.0 / b)).float()
            out[:, run * per:(run + i) * per] = F.embedding_bag(
                inverse.reshape(s.shape), values, per_sample_weights=weights, mode="sum")
        run += i
    return out


class RollingEmbedding(HashEmbeddingBase):
    def __init__(self, config):
        super().__init__(config)
        e = config.embed
        self.n, self.max_len, self.width = int(e["rolling_ngram"]), int(e["max_len"]), int(e["width"])
        self.buckets, self.dim = int(e["rolling_buckets"]), int(e["rolling_dim"])
        parts, start = [], 0
        for i in range(1, self.n + 1):
            size = max(0, self.max_len - i + 1)
            parts.append((start, size))
            start += size
        self.parts = parts
        p = self.n * (self.n + 1) // 2
        self.register_buffer("seeds", torch.zeros(self.dim // p, p, dtype=torch.long))
        self.linear = nn.Parameter(torch.zeros(config.hidden_size, self.dim)) if e.get("rolling_linear") else None

    def embed_words(self, tok, codes, word):
        self.check(codes, self.width)
        with torch.no_grad():
            flat = codes.reshape(-1, codes.shape[-1])
            feats = rolling_features(flat, self.seeds, self.parts, self.buckets, self.dim)
        x = feats.view(*codes.shape[:-1], self.dim) * word.unsqueeze(-1)
        if self.linear is None:
            return x.to(self.special.dtype)
        return F.linear(x.to(self.linear.dtype), self.linear)


EMBEDDINGS = {"vocab": VocabEmbedding, "hash-emb": HashBucketEmbedding, "pool": PoolEmbedding,
              "add": AddEmbedding, "proj": ProjEmbedding, "bert-hash": BertHashEmbedding,
              "rolling": RollingEmbedding}


class FixedInput(nn.Module):
    """The fixed input of rndembqk/fixedseqqk layers: ``epsilon`` [L, h] or ``tokens`` [L] (-1 padded)."""

    def __init__(self, config):
        super().__init__()
        f = config.fixed_qk
        self.kind, self.source, self.active = f["kind"], f["source"], bool(f.get("active", True))
        if self.source == "random":
            self.register_buffer("epsilon", torch.zeros(int(f["length"]), config.hidden_size))
        else:
            self.register_buffer("tokens", torch.full((int(f["length"]),), -1, dtype=torch.long))

    def length(self) -> int:
        if self.source == "random":
            return self.epsilon.shape[0]
        return int((self.tokens >= 0).sum())


# =============================================================================== heads

class HashBitsHead(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.linear = nn.Linear(config.hidden_size, int(config.code_width) * 8)

    def forward(self, hidden):
        return self.linear(hidden)


class HashBucketHead(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.num_buckets = int(config.num_buckets)
        self.padded = int(config.embed.get("head_padded_rows") or self.num_buckets)
        self.linear = nn.Linear(config.hidden_size, self.padded, bias=False)

    def forward(self, hidden):
        logits = self.linear(hidden)
        if self.padded != self.num_buckets:
            col = torch.arange(self.padded, device=logits.device)
            logits = logits.masked_fill(col >= self.num_buckets, -1e4)
        return logits


class ShuffleRandomHead(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.linear = nn.Linear(config.hidden_size, 3)

    def forward(self, hidden):
        return self.linear(hidden)


# =============================================================================== models

class MegahashPreTrainedModel(PreTrainedModel):
    config_class = MegahashConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    supports_gradient_checkpointing = False
    _no_split_modules = ["Layer"]
    _supports_sdpa = True

    def _init_weights(self, module):
        std = float((self.config.megahash_config.get("model") or {}).get("init_std", 0.02))
        if isinstance(module, nn.Linear):
            module.weight.data.normal_(0.0, std)
            if module.bias is not None:
                module.bias.data.zero_()
        elif isinstance(module, nn.Embedding):
            module.weight.data.normal_(0.0, std)

    # -- text helpers -------------------------------------------------------------------------
    def set_text_coder(self, coder) -> None:
        """Use ``coder`` (a ``hashing_megahash.TextCoder``) for ``encode_text`` and generation."""
        self._text_coder = coder
        if isinstance(getattr(self, "model", None), MegahashPreTrainedModel):
            self.model._text_coder = coder

    def codes_for_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Word-hash codes [b, s, width] of token id rows (each row one text from its start), computed
        by the text coder; word streams: from the word table (an <unk> token gets zero codes, while
        ``encode_text`` hashes unknown words themselves)."""
        coder = self.text_coder
        rows = [torch.from_numpy(coder.codes(row)) for row in input_ids.tolist()]
        codes = torch.stack(rows).to(input_ids.device)
        return codes if codes.dtype == torch.uint8 else codes.long()

    @property
    def text_coder(self):
        coder = getattr(self, "_text_coder", None)
        if coder is None:
            from .hashing_megahash import HASHING_FILE, TextCoder

            folder = getattr(self.config, "_name_or_path", "") or ""
            if folder and not os.path.isdir(folder):  # a Hub repository id: fetch the hashing files
                try:
                    from huggingface_hub import snapshot_download

                    folder = snapshot_download(folder, allow_patterns=["megahash_*", "tokenizer.model"])
                except Exception:  # offline / no such repository: reported below
                    pass
            if not os.path.isfile(os.path.join(folder, HASHING_FILE)):
                raise ValueError(f"no {HASHING_FILE} in {folder!r}: load the model from its exported folder or call "
                                 "model.set_text_coder(TextCoder.from_pretrained(folder))")
            coder = self._text_coder = TextCoder.from_pretrained(folder)
        return coder

    def needs_codes(self) -> bool:
        return bool(self.config.hash_spec) and (self.config.embedding not in ("vocab", "bert-hash")
                                                or self.config.head != "vocab")

    def encode_text(self, text: str, return_tensors: bool = True):
        """Raw text -> (input_ids [1, n], hash_codes [1, n, width] or None), as megahash's data stage
        and evaluation tokenise and hash it."""
        coder = self.text_coder
        ids, words = coder.encode(text)
        codes = coder.codes(ids, words) if self.needs_codes() else None
        if not return_tensors:
            return ids, codes
        tid = torch.tensor([ids], dtype=torch.long, device=self.device)
        if codes is None:
            return tid, None
        t = torch.from_numpy(codes)
        t = t if t.dtype == torch.uint8 else t.long()
        return tid, t.unsqueeze(0).to(self.device)

    def reset_fixed_maps(self) -> None:
        """Forget the cached rndembqk/fixedseqqk maps (call after changing weights in eval mode)."""
        base = self.model if hasattr(self, "model") else self
        base._fixed_cache = None


class MegahashModel(MegahashPreTrainedModel):
    """Embedding -> layers -> final norm; returns the last hidden states [b, s, h]."""

    def __init__(self, config: MegahashConfig):
        super().__init__(config)
        self.embedding = EMBEDDINGS[config.embedding](config)
        self.decoder = Decoder(config)
        self.embedding_extras = RobertaEmbeddingExtras(config) if is_roberta(config) else None
        self.fixed_qk = FixedInput(config) if config.fixed_qk else None
        self._fixed_cache = None
        self.post_init()

    def get_input_embeddings(self):
        return self.embedding.word_embeddings if isinstance(self.embedding, VocabEmbedding) else None

    def _fixed_layers(self):
        return [i for i, layer in enumerate(self.decoder.layers)
                if layer.kind in ("rndembqk", "fixedseqqk") and not layer.skip]

    def fixed_maps(self, needed: int):
        """{layer: (q [n, L, d], k [g, L, d])} of the fixed input (eq. 4.9-4.12), computed by running the
        fixed input through the stack (cached in eval mode; recomputed with gradients in training)."""
        fixed = self.fixed_qk
        total = fixed.length()
        if needed > total:
            raise ValueError(f"{fixed.kind}: positions up to {needed} exceed the fixed input ({total} positions)")
        param = next(self.parameters())
        causal = self.config.arch == "decoder"
        # causal: position t of the fixed pass sees positions <= t only, so one pass over the whole
        # input serves every length; bidirectional (encoders): the pass has the batch's length
        length = needed if (self.training or not causal) else total
        key = (param.dtype, param.device, length)
        if not self.training and self._fixed_cache is not None and self._fixed_cache[0] == key:
            return self._fixed_cache[1]
        with torch.set_grad_enabled(self.training and torch.is_grad_enabled()):
            if fixed.source == "random":
                emb = fixed.epsilon[:length].unsqueeze(0).to(param.dtype)
            else:
                emb = self.embedding(fixed.tokens[:length].unsqueeze(0), None)
                if self.embedding_extras is not None:
                    emb = self.embedding_extras(emb)
            cos, sin = rope_cos_sin(0, length, self.config.hidden_size // self.config.num_attention_heads,
                                    self.config.rope_theta, emb.device)
            if self.embedding_extras is not None:  # no RoPE: the identity rotation
                cos, sin = torch.ones_like(cos), torch.zeros_like(sin)
            capture: dict = {}
            ctx = {"offset": 0, "cos": cos, "sin": sin, "embeddings": emb, "capture": capture, "key_mask": None}
            last = max(self._fixed_layers())
            x = emb
            for i, layer in enumerate(self.decoder.layers[:last + 1]):
                ctx["layer"] = i
                x = layer(x, ctx, None)
        if not self.training:
            self._fixed_cache = (key, capture)
        return capture

    def forward(self, input_ids=None, hash_codes=None, attention_mask=None, past_key_values=None, use_cache=None,
                output_hidden_states=False, return_dict=True, **kwargs):
        b, s = input_ids.shape
        decoder = self.config.arch == "decoder"
        cache = past_key_values if isinstance(past_key_values, MegahashCache) else None
        if cache is None and use_cache and decoder:
            cache = MegahashCache(len(self.decoder.layers))
        offset = cache.offset if cache is not None else 0
        key_mask = None
        if attention_mask is not None and attention_mask.dim() == 2:
            am = attention_mask[:, -s:].bool() if decoder else attention_mask.bool()
            if not decoder:
                key_mask = am
            elif not bool(am.all()):
                # causal model: right padding changes nothing before it; left padding would
                if bool((am[:, 1:] & ~am[:, :-1]).any()) or not bool(am[:, 0].all()):
                    raise ValueError("megahash decoders support right padding only; generate prompts of "
                                     "different lengths one at a time (or with batch_size=1)")
        if hash_codes is None and getattr(self.embedding, "needs_codes", False):
            if offset:
                raise ValueError("pass hash_codes for the new tokens when decoding with a cache "
                                 "(generate() computes them)")
            hash_codes = self.codes_for_ids(input_ids)  # e.g. lm-eval's hf model passes ids only
        emb = self.embedding(input_ids, hash_codes)
        cos, sin = rope_cos_sin(offset, s, self.config.hidden_size // self.config.num_attention_heads,
                                self.config.rope_theta, emb.device)
        if self.embedding_extras is not None:  # model.layout=roberta: learned positions, no RoPE
            emb = self.embedding_extras(emb, key_mask)
            cos, sin = torch.ones_like(cos), torch.zeros_like(sin)
        fixed = None
        if self.fixed_qk is not None and self._fixed_layers():
            fixed = self.fixed_maps(offset + s)
        ctx = {"offset": offset, "cos": cos, "sin": sin, "embeddings": emb, "key_mask": key_mask, "fixed": fixed}
        hidden = [] if output_hidden_states else None
        x = emb
        for i, layer in enumerate(self.decoder.layers):
            if hidden is not None:
                hidden.append(x)
            ctx["layer"] = i
            x = layer(x, ctx, None if cache is None else cache.states[i])
        if self.decoder.final_layernorm is not None:
            x = self.decoder.final_layernorm(x)
        if hidden is not None:
            hidden.append(x)
        if cache is not None:
            cache.offset += s
        return BaseModelOutputWithPast(last_hidden_state=x, past_key_values=cache,
                                       hidden_states=tuple(hidden) if hidden is not None else None)


class MegahashForCausalLM(MegahashPreTrainedModel, GenerationMixin):
    """Decoder with its head: vocab logits [b, s, vocab_size] (the real vocabulary; TP padding rows are
    kept in the weights but not scored), or the hash-bits / hash-bucket head's logits."""

    def __init__(self, config: MegahashConfig):
        super().__init__(config)
        self.model = MegahashModel(config)
        self.tied = bool(config.tie_embeddings) and getattr(self.model.embedding, "tieable", False)
        uses_output = config.objective != "sr" and config.head == "vocab"
        self.output_layer = (nn.Linear(config.hidden_size, config.padded_vocab_size, bias=False)
                             if uses_output and not self.tied else None)
        self.head = None
        if config.objective == "sr":
            self.head = ShuffleRandomHead(config)
        elif config.head == "hash-bits":
            self.head = HashBitsHead(config)
        elif config.head == "hash-bucket":
            self.head = HashBucketHead(config)
        self.post_init()

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # the model creates its own MegahashCache

    def get_input_embeddings(self):
        return self.model.get_input_embeddings()

    def get_output_embeddings(self):
        return self.output_layer

    def head_logits(self, hidden):
        if self.head is not None:
            return self.head(hidden)
        weight = self.model.embedding.weight if self.tied else self.output_layer.weight
        return F.linear(hidden, weight[: self.config.vocab_size])

    def forward(self, input_ids=None, hash_codes=None, attention_mask=None, past_key_values=None, use_cache=None,
                labels=None, output_hidden_states=False, return_dict=True, logits_to_keep=0, **kwargs):
        out = self.model(input_ids=input_ids, hash_codes=hash_codes, attention_mask=attention_mask,
                         past_key_values=past_key_values, use_cache=use_cache,
                         output_hidden_states=output_hidden_states)
        hidden = out.last_hidden_state
        if logits_to_keep:
            hidden = hidden[:, -logits_to_keep:]
        logits = self.head_logits(hidden)
        loss = None
        if labels is not None:
            if self.head is None:  # causal LM: position t predicts labels[t + 1]
                shift = logits[:, :-1] if self.config.arch == "decoder" else logits
                tgt = labels[:, 1:] if self.config.arch == "decoder" else labels
                loss = F.cross_entropy(shift.float().reshape(-1, shift.shape[-1]), tgt.reshape(-1), ignore_index=-100)
            elif isinstance(self.head, ShuffleRandomHead):
                loss = F.cross_entropy(logits.float().reshape(-1, 3), labels.reshape(-1), ignore_index=-100)
        cls = CausalLMOutputWithPast if self.config.arch == "decoder" else MaskedLMOutput
        if cls is MaskedLMOutput:
            return cls(loss=loss, logits=logits, hidden_states=out.hidden_states)
        return cls(loss=loss, logits=logits, past_key_values=out.past_key_values, hidden_states=out.hidden_states)

    # -- generation -------------------------------------------------------------------------
    def _generation_codes(self, input_ids, given):
        """Codes of the whole sequence so far: the given prompt codes, then the text coder's codes
        of the generated tokens (computed over the full sequence, as megahash's evaluation does)."""
        if given is not None and given.shape[1] >= input_ids.shape[1]:
            return given[:, : input_ids.shape[1]]
        codes = self.codes_for_ids(input_ids)
        if given is not None:
            codes[:, : given.shape[1]] = given.to(codes.dtype)
        return codes

    def generate(self, *args, **kwargs):
        if self.head is not None or self.config.arch != "decoder":
            raise ValueError("generate() needs a decoder with the vocabulary head; this model's head predicts "
                             f"{'word-hash codes' if self.head is not None else 'masked tokens'} (use its logits)")
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        mask = kwargs.get("attention_mask")
        if torch.is_tensor(input_ids) and torch.is_tensor(mask) and input_ids.shape[0] > 1 and not bool(mask.bool().all()):
            return generate_left_padded(self, super().generate, input_ids, mask,
                                        {k: v for k, v in kwargs.items() if k not in ("input_ids", "attention_mask")})
        return super().generate(*args, **kwargs)

    def prepare_inputs_for_generation(self, input_ids, past_key_values=None, attention_mask=None, hash_codes=None,
                                      **kwargs):
        inputs = super().prepare_inputs_for_generation(input_ids, past_key_values=past_key_values,
                                                       attention_mask=attention_mask, **kwargs)
        inputs.pop("position_ids", None)
        if self.needs_codes() and self.config.embedding not in ("vocab", "bert-hash"):
            n = inputs["input_ids"].shape[1]
            inputs["hash_codes"] = self._generation_codes(input_ids, hash_codes)[:, -n:]
        else:
            inputs.pop("hash_codes", None)
        return inputs


def generate_left_padded(model, generate, input_ids, mask, kwargs):
    """Batched ``generate()`` of padded prompts (left padding, as transformers pads for generation; or
    right): each prompt is generated without its padding (exactly the unbatched result, for every
    attention kind, including the recurrent and fixed-input ones whose states padding would
    disturb), and the rows are put back in the batch layout transformers returns: the prompts as
    given, then the new tokens, rows that stopped early filled with ``pad_token_id``."""
    if kwargs.get("return_dict_in_generate"):
        raise ValueError("padded batches: generate() returns token ids here (return_dict_in_generate=False)")
    gen_cfg = kwargs.get("generation_config") or model.generation_config
    pad = kwargs.get("pad_token_id", getattr(gen_cfg, "pad_token_id", None))
    if pad is None:
        pad = getattr(gen_cfg, "eos_token_id", None)
        pad = pad[0] if isinstance(pad, (list, tuple)) else (pad if pad is not None else 0)
    codes = kwargs.pop("hash_codes", None)
    rows = []
    for i in range(input_ids.shape[0]):
        keep = mask[i].bool()
        row_kwargs = dict(kwargs)
        if codes is not None:
            row_kwargs["hash_codes"] = codes[i:i + 1, keep]
        row = input_ids[i:i + 1, keep]
        out = generate(row, attention_mask=torch.ones_like(row), **row_kwargs)
        rows.append(out[0, row.shape[1]:])
    width = max(r.shape[0] for r in rows)
    new = torch.full((len(rows), width), int(pad), dtype=input_ids.dtype, device=input_ids.device)
    for i, r in enumerate(rows):
        new[i, : r.shape[0]] = r
    return torch.cat([input_ids, new], dim=1)


class MegahashForMaskedLM(MegahashForCausalLM):
    """Encoders (``model.arch=encoder``): bidirectional, ``attention_mask`` is the padding mask;
    logits of the MLM vocabulary head, or of the Shuffle+Random 3-way head."""


__all__ = ["MegahashCache", "MegahashForCausalLM", "MegahashForMaskedLM", "MegahashModel", "MegahashPreTrainedModel"]
