"""BERT-Hash ([NeuML25], neuml "BERT Hash Nano"): the vocabulary projected to P dims, then re-encoded.

    e = L( H[token] ),   H in R^{|V| x P},  L: Linear(P -> d) without bias

Parameters |V| x P + P x d ([NeuML25]: 30,522 x 5 + 5 x 768 = 156,450; "projections = 5 is like a
160-bit hash"). Reads token ids (not hash codes), so it needs a tokenizer vocabulary like ``vocab``;
``model.embed.options.projections`` is P. The five special ids use the shared special table like every
hash embedding (their H rows are kept so the count is [NeuML25]'s formula).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from megahash.models.embeddings.base import HashEmbeddingBase
from megahash.models.reference_layers import TorchHashEmbedding
from megahash.models.registry import EmbeddingCaps, register_embedding, register_reference


@register_reference("bert-hash")
class BertHashReference(TorchHashEmbedding):
    """BERT-Hash ([NeuML25]): ``hash_table`` [vocab, P] then ``proj`` P -> h."""

    needs_codes = False

    def __init__(self, config):
        super().__init__(config)
        p = int(config.embed["projections"])
        self.hash_table = nn.Parameter(torch.zeros(config.padded_vocab_size, p))
        self.proj = nn.Parameter(torch.zeros(config.hidden_size, p))

    def embed_words(self, tok, codes, word):
        x = F.embedding(tok, self.hash_table) * word.unsqueeze(-1).to(self.hash_table.dtype)
        return F.linear(x, self.proj)


@dataclass(frozen=True)
class BertHashOptions:
    """``model.embed.options`` of bert-hash: P, the hash projections per token ([BERTHash])."""

    projections: int = 5
    RANGES = {"projections": (1, None, False, False, "bert-hash projections")}


@register_embedding(
    "bert-hash",
    caps=EmbeddingCaps(reads_hash_codes=False, sr_random="token"),
    options=BertHashOptions,
    export_meta=lambda emb, cfg: {"projections": emb.projections},
)
class BertHashEmbedding(HashEmbeddingBase):
    """e = Linear_{P->d}(H[token]) with H [|V|, P] ([NeuML25])."""

    def __init__(self, config, cfg, vocab_size: int):
        super().__init__(config, cfg)
        p = int(cfg.model.embed.options.projections)  # >= 1 (BertHashOptions.RANGES)
        self.projections = p
        self.vocab_size = vocab_size
        self.hash_table = torch.nn.Parameter(torch.empty(vocab_size, p, dtype=config.params_dtype))
        self.proj = torch.nn.Parameter(torch.empty(config.hidden_size, p, dtype=config.params_dtype))
        self._init(self.hash_table, 1.0)
        self._init(self.proj, cfg.model.init_std / math.sqrt(p))  # e has std init_std at init
        self._finish_init()

    def embed_words(self, tok, codes, word):
        x = F.embedding(tok, self.hash_table) * word.unsqueeze(-1).to(self.hash_table.dtype)
        return F.linear(x, self.proj)
