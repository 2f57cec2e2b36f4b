"""Plain-torch math shared by the plain-torch layers (no megatron-core, no transformers).

The megatron-free ops of the kinds' plain-torch side (the attention kinds' derived layers, the embedding and
head references, ``@register_reference`` in the kind files) and of the generic shell
:mod:`megahash.models.reference_layers`: RoPE angles as megatron-core makes them, the plain softmax core, bit
unpacking and the EELBERT rolling features. The kernels of the linear
and fixed-map kinds are in :mod:`megahash.ops` (one package per family, exported the same way). ``megahash
export-hf`` copies this file verbatim into every Hugging Face folder (:mod:`megahash.convert.remote_code`),
so it imports torch, math, typing and the torch-only megahash modules it names only.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from megahash.models.arch import arch_of
from megahash.ops.utils.fp32 import no_autocast
from megahash.ops.utils.window import band_mask

NUM_SPECIAL = 5


def megahash_option(config, section: str, key: str, default=None):
    """A field of the resolved megahash config tree carried by the export (``config.megahash_config``)."""
    tree = getattr(config, "megahash_config", None) or {}
    node = tree.get(section) or {}
    *outer, last = key.split(".")
    for k in outer:
        if k == "options" and k not in node:  # exported before kinds owned their options
            continue
        node = node.get(k) or {}
    return node.get(last, default)


def is_roberta(config) -> bool:
    """``model.layout=roberta``: post-LN layers, learned positions, token types, embedding LayerNorm."""
    return megahash_option(config, "model", "layout", "prenorm") == "roberta"


def rope_freqs(offset: int, length: int, dim: int, base: float, device, positions=None) -> torch.Tensor:
    """RoPE angles [length, 1, 1, dim] of positions offset.. as megatron-core's ``RotaryEmbedding`` makes them
    (non-interleaved: the frequencies repeated in both halves, float32), or [length, b, 1, dim] at the
    per-token ``positions`` [b, length] (packed documents)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim))
    seq = torch.arange(length, device=device, dtype=torch.float32) + offset
    freqs = torch.outer(seq, inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    if positions is not None:
        return emb[positions.t()].unsqueeze(2)
    return emb[:, None, None, :]


def packed_documents(config, input_ids, offset: int) -> tuple:
    """(document ids, positions) [b, s] of packed rows under the run's ``data.reset_attention_mask`` /
    ``data.reset_position_ids`` (saved in ``config.megahash_config``), each None when off; a full forward
    only (offset 0; decoding continues the text as one document). The EOD ends its own document:
    doc[i] = #EOD before i, positions restart at 0 after each EOD (Megatron-LM's semantics)."""
    data = (getattr(config, "megahash_config", None) or {}).get("data") or {}
    if offset or not (data.get("reset_attention_mask") or data.get("reset_position_ids")):
        return None, None
    eos = (data.get("special_ids") or {}).get("eos")
    is_eod = (input_ids == (2 if eos is None else int(eos))).long()
    doc = is_eod.cumsum(-1) - is_eod
    pos = None
    if data.get("reset_position_ids"):
        idx = torch.arange(doc.shape[-1], device=doc.device).expand_as(doc)
        start = torch.ones_like(doc, dtype=torch.bool)
        start[:, 1:] = doc[:, 1:] != doc[:, :-1]
        pos = idx - torch.cummax(torch.where(start, idx, torch.zeros_like(idx)), dim=-1).values
    return (doc if data.get("reset_attention_mask") else None), pos


class SoftmaxCore(nn.Module):
    """The plain-torch softmax core of a layer (megatron's is ``SDPACoreAttention``, same contract): query
    [sq, b, n, d], key/value [sk, b, g, d] (query head i uses group i // (n/g)), ``attention_mask`` [b, 1, 1, sk]
    (True = masked) or None, ``document_ids`` [b, s] (packed documents: attention inside each; a token always
    sees itself), ``window`` (a sliding window of that many keys, :mod:`megahash.ops.utils.window`; a token
    always sees itself) -> [sq, b, n*d]. No dropout."""

    def __init__(self, causal: bool, scale: float):
        super().__init__()
        self.causal, self.scale = causal, scale

    def forward(self, query, key, value, attention_mask=None, document_ids=None, window=None, **_kw):
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, d]
        b, n, sq, _ = q.shape
        if k.shape[1] != n:
            k = k.repeat_interleave(n // k.shape[1], dim=1)
            v = v.repeat_interleave(n // v.shape[1], dim=1)
        sk = k.shape[2]
        window = None if window is None or window >= sk else window  # a window of the whole length: none
        keep = None if attention_mask is None else ~attention_mask.reshape(b, sk)
        mask, is_causal = None, False
        if document_ids is not None and sq == sk:
            mask = document_ids[:, :, None] == document_ids[:, None, :]
            if self.causal:
                mask = mask & torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril()
        elif keep is None and window is None and self.causal and sq == sk:
            is_causal = True
        elif keep is None and self.causal:
            mask = torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril(sk - sq)
        if window is not None:
            band = band_mask(sq, sk, window, self.causal, q.device)
            mask = band if mask is None else mask & band
        if keep is not None:
            mask = keep[:, None, :] if mask is None else mask & keep[:, None, :]
            if document_ids is not None or window is not None:
                mask = mask | torch.eye(sq, dtype=torch.bool, device=q.device)
        if mask is not None:
            mask = mask[:, None] if mask.dim() == 3 else mask
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=self.scale)
        return out.permute(2, 0, 1, 3).reshape(sq, b, n * out.shape[-1])


class PerHeadWeight(nn.Module):
    """A bare [rows, cols] parameter named ``weight`` (megahash's PerHeadParameter): zeros, or ``init(w)``
    in place; ``flat``: one vector [rows * cols]."""

    def __init__(self, rows: int, cols: int, init=None, flat: bool = False):
        super().__init__()
        w = torch.zeros(rows, cols)
        if init is not None:
            init(w)
        self.weight = nn.Parameter(w.reshape(-1) if flat else w)


def make_norm(config, size: int | None = None):
    if arch_of(config.arch).rms_norm:
        return nn.RMSNorm(size or config.hidden_size, eps=config.norm_eps)
    return nn.LayerNorm(size or config.hidden_size, eps=config.norm_eps)


def unpack_code_bits(codes: torch.Tensor) -> torch.Tensor:
    """uint8 [..., T/8] packed MSB first -> uint8 [..., T]."""
    shifts = torch.arange(7, -1, -1, dtype=torch.uint8, device=codes.device)
    bits = (codes.to(torch.uint8).unsqueeze(-1) >> shifts) & 1
    return bits.reshape(*codes.shape[:-1], codes.shape[-1] * 8)


def chunk_integers(bits: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """0/1 bits [..., T] times the chunks' place values [T, n] -> the chunk integers, int64 [..., n], exactly: in
    fp32 with autocast off (under bf16 autocast the GEMM kept 8 significant bits: 46% of 10-bit codewords were
    other rows, and 1023 became 1024, past the codebook)."""
    with no_autocast(bits):
        return torch.matmul(bits.float(), weights.float()).round_().long()  # exact: values < 2^20


def md5_code_mod(codes: torch.Tensor, n: int) -> torch.Tensor:
    c = codes.long()
    r = torch.zeros(codes.shape[:-1], dtype=torch.long, device=codes.device)
    for j in range(codes.shape[-1]):
        r = (r * 256 + c[..., j]) % n
    return r


def safe_rsqrt(x):
    return torch.where(x > 0, torch.rsqrt(x.clamp_min(1e-30)), torch.zeros_like(x))


ROLLING_CHUNK_ELEMS = 1 << 22  # int64 elements of one [i-gram hashes, d_i] block


def rolling_code_features(codes: torch.Tensor, seeds: torch.Tensor, parts, b: int, dim: int) -> torch.Tensor:
    """Code rows int [M, W] -> float32 features [M, dim] (EELBERT, [Cohn23]; the one copy, used by
    :mod:`megahash.models.embeddings.rolling` and its exported reference).

    The value of an i-gram, map((H(g) * h_i) mod b) in [-1, 1]^(d/P * i), depends only on its hash,
    so it is computed once per distinct i-gram hash of the batch (exact int64 residues, mapped in
    float64, in blocks of ``ROLLING_CHUNK_ELEMS``) and each word's partition i is the mean over its
    i-grams: one ``embedding_bag`` with weights valid/count (padding slots -1 weigh 0; a word with no
    i-gram of length i gets zeros)."""
    codes = codes.long()
    per = seeds.shape[0]
    half = b // 2  # q > b/2  <=>  q > b // 2 for integer q
    out = torch.zeros(codes.shape[0], dim, dtype=torch.float32, device=codes.device)
    run = 0
    for i, (start, size) in enumerate(parts, start=1):
        if size > 0 and codes.shape[0] > 0:
            s = codes[:, start : start + size]
            valid = s >= 0
            weights = valid.float() / valid.sum(dim=1, keepdim=True).clamp_min(1).float()
            uniq, inverse = torch.unique(s.clamp_min(0), return_inverse=True)
            hs = seeds[:, run : run + i].reshape(-1)  # [per * i], row-major like the reference
            values = torch.empty(uniq.numel(), hs.numel(), dtype=torch.float32, device=codes.device)
            step = max(1, ROLLING_CHUNK_ELEMS // hs.numel())
            for a in range(0, uniq.numel(), step):
                q = torch.remainder(uniq[a : a + step].unsqueeze(-1) * hs, b)  # exact: < 2^31 * 2^32
                q = torch.where(q > half, q - b, q)
                values[a : a + step] = (q.double() * (2.0 / b)).float()
            out[:, run * per : (run + i) * per] = F.embedding_bag(
                inverse.reshape(s.shape), values, per_sample_weights=weights, mode="sum"
            )
        run += i
    return out
