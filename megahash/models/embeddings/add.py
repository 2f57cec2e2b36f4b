"""HashFormer-Add ([Xue25] sec. 2.3.4, eq. 2.2): T two-row codebooks, one per bit, summed.

    e = sum_{j=1..T} B^j[tau_j] / gamma,   B^j in R^{2 x d},  gamma = sqrt(T)  (footnote 5)   (2.2)

Parameters 2 x T x d (eq. 2.14: 196,608 for T = 128, d = 768) plus the shared word row
(:mod:`megahash.models.embeddings.base`: 197,376 = Table 2.2's 197.4K).

Computed without materialising T x d per token: since B^j[tau_j] = B^j[0] + tau_j (B^j[1] - B^j[0]),

    e = ( sum_j B^j[0] + tau @ Delta ) / sqrt(T),   Delta = B[:, 1] - B[:, 0]   ([T, d])

i.e. one [tokens, T] x [T, d] matmul on the unpacked bits; the constant sum_j B^j[0] / sqrt(T)
plus the word row is one more matmul row selected by the "is a word" column (zero for specials).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from megahash.models.embeddings.base import HashEmbeddingBase, bit_shifts, bit_spec, check_codes, unpack_bits
from megahash.models.reference_layers import TorchHashEmbedding
from megahash.models.reference_ops import unpack_code_bits
from megahash.models.registry import EmbeddingCaps, register_embedding, register_reference


@register_reference("add")
class AddReference(TorchHashEmbedding):
    """Add (eq. 2.2): e = sum_j B^j[tau_j] / sqrt(T), + the word row."""

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
        bits = unpack_code_bits(codes) * word.unsqueeze(-1)
        x = torch.cat([bits, word.unsqueeze(-1)], dim=-1).to(dtype)
        return torch.matmul(x, a)


@register_embedding(
    "add",
    caps=EmbeddingCaps(sr_random="bits-density", example_hash_spec="lsh128"),
    export_meta=lambda emb, cfg: {"num_bits": emb.num_bits},
)
class AddEmbedding(HashEmbeddingBase):
    """e = sum_j B^j[tau_j] / sqrt(T) (eq. 2.2); codebooks [T, 2, d] (row 0 = bit 0, row 1 = bit 1)."""

    def __init__(self, config, cfg, vocab_size: int):
        super().__init__(config, cfg)
        self.num_bits = bit_spec(cfg, "add")
        self.codebooks = torch.nn.Parameter(
            torch.empty(self.num_bits, 2, config.hidden_size, dtype=config.params_dtype)
        )
        self.word_row = torch.nn.Parameter(torch.empty(config.hidden_size, dtype=config.params_dtype))
        self._init(self.codebooks)  # N(0, init_std): e has std init_std at init, like a vocab row
        self._init(self.word_row, 0)
        self.register_buffer("shifts", bit_shifts(), persistent=False)
        self._finish_init()

    def embed_words(self, tok, codes, word):
        check_codes(codes, self.num_bits // 8, "add")
        dtype = self.codebooks.dtype
        g = 1.0 / math.sqrt(self.num_bits)
        b0, b1 = self.codebooks[:, 0], self.codebooks[:, 1]
        const = b0.sum(dim=0) * g + self.word_row  # [d]
        a = torch.cat([(b1 - b0) * g, const.unsqueeze(0)], dim=0)  # [T + 1, d]
        bits = unpack_bits(codes, self.shifts) * word.unsqueeze(-1)  # uint8, 0 for specials
        x = torch.cat([bits, word.unsqueeze(-1)], dim=-1).to(dtype)
        return torch.matmul(x, a)
