"""Plain-torch math shared by the kinds' reference forwards (no megatron-core, no transformers).

The megatron-free ops of every attention, embedding and head reference (``@register_reference`` in
the kind files) and of the generic shell :mod:`megahash.models.torch_model`: RoPE (megatron's
non-interleaved rotary, rotate_half), softmax attention over grouped K/V, the chunked/recurrent
linear-attention kernels (Taylor softmax of Based, eq. 4.6; the Appendix I recurrence, eq.
4.14-4.17; the running softmax of eq. 4.7-4.8/4.18), the decoding-cache helper, bit unpacking and
the EELBERT rolling features. ``megahash export-hf`` copies this file verbatim into every
Hugging Face folder (:mod:`megahash.convert.remote_code`), so it imports torch, math and typing only.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

NUM_SPECIAL = 5


def append_state(cache: Optional[dict], key: str, t: torch.Tensor, dim: int = 2) -> torch.Tensor:
    if cache is None:
        return t
    if key in cache:
        t = torch.cat([cache[key], t], dim=dim)
    cache[key] = t
    return t


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


def orders_causal(q, k, v, chunk: int, state=None, offset: int = 0, need_state: bool = False):
    """Appendix I: eq. 4.14-4.17 (separately normalised orders, element-wise squares), chunked."""
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


def orders_bidirectional(q, k, v, key_mask=None):
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
    """t [b, heads, s, d] (or [heads, s, d]); t cos + rotate_half(t) sin, computed without a ``cat``
    of the activations: rotate_half(t) sin = roll(t, d/2) sin' with sin' the table with its first
    half negated (the table repeats its frequencies in both halves; bit for bit the same values)."""
    h = t.shape[-1] // 2
    sin = sin.to(t.dtype)
    sin = torch.cat((-sin[..., :h], sin[..., h:]), dim=-1)  # the [s, d] table only
    return t * cos.to(t.dtype) + torch.roll(t, h, dims=-1) * sin


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


def split_heads(t: torch.Tensor, n: int) -> torch.Tensor:
    """[b, s, n*d] -> [b, n, s, d]."""
    b, s, _ = t.shape
    return t.view(b, s, n, -1).transpose(1, 2)


# ----------------------------------------------------------------- Taylor softmax (eq. 4.6)

def feature_dim(d: int) -> int:
    return 1 + d + d * d


def taylor_features(x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1]
    x2 = (x.unsqueeze(-1) * x.unsqueeze(-2)).flatten(-2) / (math.sqrt(2.0) * math.sqrt(d))
    return torch.cat([torch.ones_like(x[..., :1]), x / d ** 0.25, x2], dim=-1)


def taylor_kernel(q, k):
    s = q @ k.transpose(-1, -2) * (1.0 / math.sqrt(q.shape[-1]))
    return 1 + s + 0.5 * s.square()


def taylor_chunk(length: int, d: int, chunk_size: int = 0) -> int:
    if chunk_size > 0:
        return chunk_size
    return length if length <= 2 * feature_dim(d) else 1024


def taylor_causal(q, k, v, chunk: int, state=None, need_state: bool = False):
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


def taylor_bidirectional(q, k, v, key_mask=None):
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


# ----------------------------------------------------------------- running softmax (eq. 4.7-4.8, 4.18)

def running_softmax_causal(s, v, chunk: int, state=None, need_state: bool = False):
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


def running_softmax_bidirectional(s, v, key_mask=None):
    if key_mask is not None:
        s = s.masked_fill(~key_mask, float("-inf"))
    w = torch.softmax(s, dim=-1)
    o = (w.unsqueeze(-2) @ v).squeeze(-2)
    return o.unsqueeze(-2).expand(*o.shape[:-1], s.shape[-1], o.shape[-1])



class PerHeadWeight(nn.Module):
    """A bare [rows, cols] parameter named ``weight`` (megahash's PerHeadParameter)."""

    def __init__(self, rows: int, cols: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(rows, cols))


def make_norm(config, size: Optional[int] = None):
    if config.arch == "decoder":
        return nn.RMSNorm(size or config.hidden_size, eps=config.norm_eps)
    return nn.LayerNorm(size or config.hidden_size, eps=config.norm_eps)


def unpack_code_bits(codes: torch.Tensor) -> torch.Tensor:
    """uint8 [..., T/8] packed MSB first -> uint8 [..., T]."""
    shifts = torch.arange(7, -1, -1, dtype=torch.uint8, device=codes.device)
    bits = (codes.to(torch.uint8).unsqueeze(-1) >> shifts) & 1
    return bits.reshape(*codes.shape[:-1], codes.shape[-1] * 8)


def md5_code_mod(codes: torch.Tensor, n: int) -> torch.Tensor:
    c = codes.long()
    r = torch.zeros(codes.shape[:-1], dtype=torch.long, device=codes.device)
    for j in range(codes.shape[-1]):
        r = (r * 256 + c[..., j]) % n
    return r


def safe_rsqrt(x):
    return torch.where(x > 0, torch.rsqrt(x.clamp_min(1e-30)), torch.zeros_like(x))


def rolling_code_features(codes, seeds, parts, b: int, dim: int):
    """Code rows int [M, W] -> float32 [M, dim] (EELBERT, seed 001; megahash's rolling_code_features)."""
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


