"""HashFormer-Pool ([Xue25] sec. 2.3.4, eq. 2.1): k-bit codewords into one shared codebook, softmax-pooled.

The T bits are cut into ceil(T/k) successive k-bit chunks (the last one shorter: 8 bits for T = 128,
k = 10), each read as an integer c_i (MSB first) and looked up in one codebook B in R^{2^k x d}:

    W-hat_i = exp(W_i) / sum_l exp(W_l),  i = 1..ceil(T/k)   (softmax over chunks, per dim)   (2.1a)
    e = sum_i [ B_c (.) W-hat ]_i = sum_i B[c_i] (.) W-hat_i                                     (2.1b)

Parameters (ceil(T/k) + 2^k) x d (eq. 2.13: (13 + 1024) x 768 = 796,416) plus the shared word row
(:mod:`megahash.models.embeddings.base`: 797,184 = Table 2.2's 797.2K).

Computed as one ``embedding_bag`` (sum) over ceil(T/k) + 1 rows of a per-forward table
[ (B (.) W-hat_i) for each chunk i ; word_row ] (ceil(T/k) * 2^k + 1 rows), so no [tokens, 13, d]
tensor is ever materialised (the EmbeddingBag trick of [Xue25] sec. 2.9); specials get bag weight 0.
The backward (:class:`_PoolBag`) accumulates chunk by chunk into one 2^k x d buffer instead of
a ceil(T/k) 2^k x d gradient table.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from megahash.models.embeddings.base import HashEmbeddingBase, bit_shifts, bit_spec, check_codes, unpack_bits
from megahash.models.reference_layers import TorchHashEmbedding
from megahash.models.reference_ops import chunk_integers, unpack_code_bits
from megahash.models.registry import EmbeddingCaps, register_embedding, register_reference


@register_reference("pool")
class PoolReference(TorchHashEmbedding):
    """Pool (eq. 2.1): softmax(W)-weighted sum of the k-bit chunks' codebook rows, + the word row."""

    def __init__(self, config):
        super().__init__(config)
        e, h = config.embed, config.hidden_size
        self.num_bits, self.k = int(e["num_bits"]), int(e["pool_bits"])
        self.num_chunks = -(-self.num_bits // self.k)
        self.codebook = nn.Parameter(torch.zeros(2**self.k, h))
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
        c = chunk_integers(unpack_code_bits(codes), self.chunk_weights(codes.device))
        out = self.codebook[c[..., 0]] * w_hat[0]
        for i in range(1, self.num_chunks):
            out = out + self.codebook[c[..., i]] * w_hat[i]
        out = out + self.word_row
        return out * word.unsqueeze(-1).to(out.dtype)


def chunk_weights(num_bits: int, k: int) -> torch.Tensor:
    """[T, ceil(T/k)] float: bit t contributes 2^(len_i - 1 - m) to chunk i = t // k (m = t % k)."""
    n = -(-num_bits // k)
    w = torch.zeros(num_bits, n)
    for t in range(num_bits):
        i, m = divmod(t, k)
        length = min(k, num_bits - i * k)
        w[t, i] = float(2 ** (length - 1 - m))
    return w


@dataclass(frozen=True)
class PoolOptions:
    """``model.embed.options`` of pool: k, the bits per chunk (eq. 2.1; the codebook has 2^k rows)."""

    pool_bits: int = 10
    RANGES = {"pool_bits": (1, 20, False, False, "bits per pool chunk; the codebook has 2^k rows")}


@register_embedding(
    "pool",
    caps=EmbeddingCaps(sr_random="bits-uniform"),
    options=PoolOptions,
    export_meta=lambda emb, cfg: {"num_bits": emb.num_bits, "pool_bits": emb.k},
)
class PoolEmbedding(HashEmbeddingBase):
    """e = sum_i softmax(W)_i (.) B[c_i] (eq. 2.1); codebook [2^k, d], chunk weights W [ceil(T/k), d]."""

    def __init__(self, config, cfg, vocab_size: int):
        super().__init__(config, cfg)
        self.num_bits = bit_spec(cfg, "pool")
        self.k = int(cfg.model.embed.options.pool_bits)  # 1..20 (PoolOptions.RANGES)
        self.num_chunks = -(-self.num_bits // self.k)
        h = config.hidden_size
        self.codebook = torch.nn.Parameter(torch.empty(2**self.k, h, dtype=config.params_dtype))
        self.chunk_logits = torch.nn.Parameter(torch.empty(self.num_chunks, h, dtype=config.params_dtype))
        self.word_row = torch.nn.Parameter(torch.empty(h, dtype=config.params_dtype))
        self._init(self.codebook)
        self._init(self.chunk_logits)  # near-uniform softmax at init, as the reference's N(0, 0.02)
        self._init(self.word_row, 0)
        self.register_buffer("shifts", bit_shifts(), persistent=False)
        self.register_buffer("chunk_w", chunk_weights(self.num_bits, self.k), persistent=False)
        self.register_buffer(
            "chunk_offsets", torch.arange(self.num_chunks, dtype=torch.long) * (2**self.k), persistent=False
        )
        self._finish_init()

    def codewords(self, codes: torch.Tensor) -> torch.Tensor:
        """Packed codes [..., T/8] -> chunk integers c_i [..., ceil(T/k)] (int64)."""
        return chunk_integers(unpack_bits(codes, self.shifts), self.chunk_w)

    def embed_words(self, tok, codes, word):
        check_codes(codes, self.num_bits // 8, "pool")
        w_hat = torch.softmax(self.chunk_logits.float(), dim=0).to(self.codebook.dtype)  # (2.1a)
        c = self.codewords(codes).reshape(-1, self.num_chunks)
        return _PoolBag.apply(self.codebook, w_hat, self.word_row, c, word.reshape(-1).to(self.codebook.dtype))


class _PoolBag(torch.autograd.Function):
    """e_n = m_n (sum_i W-hat_i (.) B[c_ni] + word_row)  (eq. 2.1b), m_n = 0 for specials.

    Forward: one ``embedding_bag`` over the per-forward table [B (.) W-hat_1; ...; B (.) W-hat_n;
    word_row], written slice by slice (no [tokens, n, d] tensor). Backward, chunk by chunk with one
    2^k x d buffer G_i = sum_{tokens: c_ni = c} m g (index_add): grad B = sum_i W-hat_i (.) G_i,
    grad W-hat_i = sum_c G_i[c] (.) B[c], grad word_row = sum m g; so no n 2^k x d gradient table
    is allocated either."""

    @staticmethod
    def forward(ctx, codebook, w_hat, word_row, c, m):
        n, rows = c.shape[1], codebook.shape[0]
        table = torch.empty(n * rows + 1, codebook.shape[1], dtype=codebook.dtype, device=codebook.device)
        for i in range(n):
            torch.mul(codebook, w_hat[i], out=table[i * rows : (i + 1) * rows])
        table[-1] = word_row
        offsets = torch.arange(n, device=c.device) * rows
        idx = torch.cat([c + offsets, c.new_full((c.shape[0], 1), n * rows)], dim=1)
        out = F.embedding_bag(idx, table, per_sample_weights=m.unsqueeze(1).expand(-1, n + 1), mode="sum")
        ctx.save_for_backward(codebook, w_hat, c, m)
        return out  # [tokens, d]

    @staticmethod
    def backward(ctx, grad):
        codebook, w_hat, c, m = ctx.saved_tensors
        gm = grad.to(codebook.dtype) * m.unsqueeze(1)
        g_codebook = torch.zeros_like(codebook)
        g_w = torch.empty_like(w_hat)
        buf = torch.empty_like(codebook)
        for i in range(c.shape[1]):
            buf.zero_()
            buf.index_add_(0, c[:, i], gm)
            g_codebook.addcmul_(buf, w_hat[i])
            g_w[i] = (buf * codebook).sum(dim=0)
        return g_codebook, g_w, gm.sum(dim=0), None, None
