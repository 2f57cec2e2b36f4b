"""Baseline vocabulary embedding: a ``VocabParallelEmbedding`` table of V x h (rows split over TP)."""

from __future__ import annotations

import torch
import torch.nn as nn
from megatron.core import tensor_parallel

from megahash.models.embeddings.base import EmbeddingOutput
from megahash.models.registry import EmbeddingCaps, register_embedding, register_reference


@register_reference("vocab")
class VocabReference(nn.Module):
    """The vocabulary table ``word_embeddings`` [padded vocab, h] (tieable with the output layer)."""

    tieable = True

    def __init__(self, config):
        super().__init__()
        self.word_embeddings = nn.Embedding(config.padded_vocab_size, config.hidden_size)

    @property
    def weight(self):
        return self.word_embeddings.weight

    def forward(self, tokens, codes=None):
        return self.word_embeddings(tokens)


@register_embedding("vocab", caps=EmbeddingCaps(reads_hash_codes=False, standard=True, qwen2=True, sr_random="token"))
class VocabEmbedding(EmbeddingOutput):
    """e = E[token] (V x h table); the table can be tied to the LM head."""

    tieable = True

    def __init__(self, config, cfg, vocab_size: int):
        super().__init__(config=config)
        self.word_embeddings = tensor_parallel.VocabParallelEmbedding(
            num_embeddings=vocab_size,
            embedding_dim=config.hidden_size,
            init_method=config.init_method,
            config=config,
        )
        self.dropout = torch.nn.Dropout(config.hidden_dropout)

    @property
    def weight(self) -> torch.Tensor:
        return self.word_embeddings.weight

    def forward(self, tokens: torch.Tensor, hash_codes=None) -> torch.Tensor:
        return self.finish(self.word_embeddings(tokens))
