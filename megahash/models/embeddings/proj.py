"""HashFormer-Proj ([Xue25] sec. 2.3.4, eq. 2.3): Pearson correlation of the bit vector with d learned axes.

    e_j = < tau - mean(tau), w^j - mean(w^j) > / ( ||tau - mean(tau)|| * ||w^j - mean(w^j)|| ),  j = 1..d   (2.3)

with tau in {0,1}^T the token's hash bits (MD5 or LSH, T = 128) and w^j in R^T learned;
parameters T x d (eq. 2.15: 98,304 for T = 128, d = 768) plus the shared word row (module
docstring of :mod:`megahash.models.embeddings.base`: 99,072 = Table 2.2's 99.1K).

Computation, exact and cheap: with the rows w-hat^j = (w^j - mean(w^j)) / ||w^j - mean(w^j)|| (centred,
unit norm, fp32) the centring of tau drops out, because sum_t w-hat^j_t = 0:
<tau - mean(tau), w-hat^j> = <tau, w-hat^j>; and ||tau - mean(tau)|| = sqrt(k (T - k) / T) with k the
popcount. So e = (tau @ W-hat^T) * rsqrt(k (T - k) / T): one [tokens, T] x [T, d] matmul on the
unpacked 0/1 bits, in fp32 (Pearson is numerically delicate); the word row rides along as an extra
column of the matmul. A constant bit vector (k = 0 or T) has no correlation: its e is 0.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from megahash.models.embeddings.base import (
    HashEmbeddingBase,
    bit_shifts,
    bit_spec,
    check_codes,
    rsqrt_or_zero,
    unpack_bits,
)
from megahash.models.reference_layers import TorchHashEmbedding
from megahash.models.reference_ops import safe_rsqrt, unpack_code_bits
from megahash.models.registry import EmbeddingCaps, register_embedding, register_reference


@register_reference("proj")
class ProjReference(TorchHashEmbedding):
    """Proj (eq. 2.3): e_j = Pearson correlation of the centred bits with w^j, + the word row."""

    def __init__(self, config):
        super().__init__(config)
        self.num_bits = int(config.embed["num_bits"])
        self.weight = nn.Parameter(torch.zeros(config.hidden_size, self.num_bits))
        self.word_row = nn.Parameter(torch.zeros(config.hidden_size))

    def embed_words(self, tok, codes, word):
        self.check(codes, self.num_bits // 8)
        t = self.num_bits
        bits = unpack_code_bits(codes).float()
        k = bits.sum(dim=-1, keepdim=True)
        scale = safe_rsqrt(k * (t - k) / t) * word.unsqueeze(-1)
        x = torch.cat([bits * scale, word.unsqueeze(-1).float()], dim=-1)
        w = self.weight.float()
        w = w - w.mean(dim=1, keepdim=True)
        w = w * safe_rsqrt(w.pow(2).sum(dim=1, keepdim=True))
        a = torch.cat([w.t(), self.word_row.float().unsqueeze(0)], dim=0)
        return torch.matmul(x, a).to(self.special.dtype)


@register_embedding(
    "proj", caps=EmbeddingCaps(sr_random="bits-density"), export_meta=lambda emb, cfg: {"num_bits": emb.num_bits}
)
class ProjEmbedding(HashEmbeddingBase):
    """e = PCC(tau, w^j) for j = 1..d (eq. 2.3); weight [d, T] like a Linear(T -> d)."""

    def __init__(self, config, cfg, vocab_size: int):
        super().__init__(config, cfg)
        self.num_bits = bit_spec(cfg, "proj")
        self.weight = torch.nn.Parameter(torch.empty(config.hidden_size, self.num_bits, dtype=config.params_dtype))
        self.word_row = torch.nn.Parameter(torch.empty(config.hidden_size, dtype=config.params_dtype))
        self._init(self.weight)
        self._init(self.word_row, 0)
        self.register_buffer("shifts", bit_shifts(), persistent=False)
        self._finish_init()

    def normalized_weight(self) -> torch.Tensor:
        """W-hat [d, T] in fp32: rows centred and scaled to unit norm."""
        w = self.weight.float()
        w = w - w.mean(dim=1, keepdim=True)
        return w * rsqrt_or_zero(w.pow(2).sum(dim=1, keepdim=True))

    def embed_words(self, tok, codes, word):
        check_codes(codes, self.num_bits // 8, "proj")
        t = self.num_bits
        bits = unpack_bits(codes, self.shifts).float()  # [s, b, T]
        k = bits.sum(dim=-1, keepdim=True)
        scale = rsqrt_or_zero(k * (t - k) / t) * word.unsqueeze(-1)  # 0 for specials
        x = torch.cat([bits * scale, word.unsqueeze(-1).float()], dim=-1)  # [s, b, T + 1]
        a = torch.cat([self.normalized_weight().t(), self.word_row.float().unsqueeze(0)], dim=0)  # [T + 1, d]
        return torch.matmul(x, a).to(self.out_dtype)
