"""EELBERT dynamic hash embedding ([Cohn23]): rolling hashes of character i-grams.

For i = 1..n and the i-grams g of the word (code points, words cut to ``max_len`` characters), the
data stage stores the polynomial rolling hashes H(g) = sum_k g[k] p^(i-1-k) mod m (p = 31,
m = 1e9+7; :mod:`megahash.hashing.rolling`). With seeded random multipliers h in [0, 2^32)^(d/P x P),
P = n(n+1)/2 (``megahash.hashing.rolling.rolling_seeds``), partition i of the embedding is

    q = outer(H(g), h[:, run:run+i].flatten()) mod b          (b = model.embed.options.rolling_buckets)
    q = q - [q > b/2] b ;   q = q / (b/2)                      (map to [-1, 1])
    e[run d/P : (run+i) d/P] = mean over the i-grams g of q    (run = 1 + 2 + ... + (i-1))

([Julian23]'s ``hash_embedding``, partition scheme included; an i with no i-grams leaves zeros; dims
beyond P * floor(d/P) stay zero). No trainable embedding table: the features are a fixed function
of the codes, computed under no_grad in exact int64 arithmetic (H < 2^31, h < 2^32) once per
*distinct* i-gram hash and averaged once per *distinct* word of the batch. ``model.embed.options.rolling_dim`` (0 = hidden) is the feature width d and
``model.embed.options.rolling_linear`` adds a trainable Linear(d -> hidden) (bias-free), the only
non-special parameters. ``megahash.hashing.rolling.rolling_embedding_from_codes`` is the numpy
reference this layer is tested against.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from megahash.errors import ConfigError
from megahash.models.embeddings.base import HashEmbeddingBase, check_codes, parse_spec
from megahash.models.reference_layers import TorchHashEmbedding
from megahash.models.reference_ops import rolling_code_features
from megahash.models.registry import EmbeddingCaps, register_embedding, register_reference


@register_reference("rolling")
class RollingReference(TorchHashEmbedding):
    """EELBERT rolling hash ([Cohn23]): features of the word's i-gram hashes, optional ``linear``."""

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
            feats = rolling_code_features(flat, self.seeds, self.parts, self.buckets, self.dim)
        x = feats.view(*codes.shape[:-1], self.dim) * word.unsqueeze(-1)
        if self.linear is None:
            return x.to(self.special.dtype)
        return F.linear(x.to(self.linear.dtype), self.linear)


_ROW_MIX = None


def unique_rows(flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.unique(flat, dim=0, return_inverse=True)`` via a 64-bit row hash (1-D unique, much
    faster on CPU), verified exactly; falls back to the 2-D unique on a (never seen) collision."""
    global _ROW_MIX
    if _ROW_MIX is None or _ROW_MIX.numel() < flat.shape[1]:
        g = torch.Generator().manual_seed(0x5EED)
        _ROW_MIX = torch.randint(1, 2**62, (max(64, flat.shape[1]),), generator=g) * 2 + 1  # odd
    mix = _ROW_MIX[: flat.shape[1]].to(flat.device)
    key = (flat.long() * mix).sum(dim=1)  # wraps mod 2^64
    _, first, inverse = _unique_first(key)
    uniq = flat[first]
    if bool((uniq[inverse] == flat).all()):
        return uniq, inverse
    return torch.unique(flat, dim=0, return_inverse=True)


def _unique_first(key: torch.Tensor):
    uniq, inverse = torch.unique(key, return_inverse=True)
    first = torch.full((uniq.numel(),), key.numel(), dtype=torch.long, device=key.device)
    first.scatter_reduce_(0, inverse, torch.arange(key.numel(), device=key.device), reduce="amin")
    return uniq, first, inverse


@dataclass(frozen=True)
class RollingOptions:
    """``model.embed.options`` of rolling ([EELBERT]): largest i-gram n, buckets b, seed, feature width."""

    rolling_ngram: int = 3  # n: largest i-gram (must match the hash spec rollingN)
    rolling_buckets: int = 1_000_000_007  # b
    rolling_seed: int = 42
    rolling_dim: int = 0  # width of the rolling features before the optional Linear (0 = hidden)
    rolling_linear: bool = True  # Linear(rolling_dim -> hidden)
    RANGES = {
        "rolling_ngram": (1, None, False, False, "largest i-gram of the rolling hash"),
        "rolling_buckets": (2, None, False, False, "rolling-hash buckets b"),
        "rolling_seed": (0, 2**32 - 1, False, False, "seed"),
        "rolling_dim": (0, None, False, False, "rolling feature width; 0 = hidden size"),
    }


@register_embedding(
    "rolling",
    caps=EmbeddingCaps(sr_random="batch", example_hash_spec="rolling3"),
    options=RollingOptions,
    export_meta=lambda emb, cfg: {
        "rolling_ngram": emb.n,
        "max_len": emb.max_len,
        "width": emb.width,
        "rolling_buckets": emb.buckets,
        "rolling_dim": emb.dim,
        "rolling_linear": emb.linear is not None,
        "rolling_seed": cfg.model.embed.options.rolling_seed,
    },
)
class RollingEmbedding(HashEmbeddingBase):
    """EELBERT: fixed rolling-hash features ([Cohn23]), optional Linear(rolling_dim -> hidden)."""

    def __init__(self, config, cfg, vocab_size: int):
        super().__init__(config, cfg)
        from megahash.hashing.rolling import rolling_partitions, rolling_seeds

        e = cfg.model.embed.options
        spec = parse_spec(cfg, "rolling")
        if spec.kind != "rolling":
            raise ConfigError(f"model.embedding=rolling needs model.embed.hash_spec rollingN, got {spec.name!r}")
        self.n, self.max_len = int(spec.params["n"]), int(spec.params["max_len"])
        if e.rolling_ngram != self.n:
            raise ConfigError(
                f"model.embed.options.rolling_ngram={e.rolling_ngram} but model.embed.hash_spec={spec.name} holds "
                f"i-grams up to {self.n}; set model.embed.options.rolling_ngram={self.n}"
            )
        self.width = spec.width
        self.parts = rolling_partitions(self.n, self.max_len)
        self.buckets = int(e.rolling_buckets)
        if not 2 <= self.buckets < 2**31:
            raise ConfigError(f"model.embed.options.rolling_buckets must be in [2, 2^31), got {self.buckets}")
        self.dim = int(e.rolling_dim) or config.hidden_size
        if self.dim < self.n * (self.n + 1) // 2:
            raise ConfigError(f"model.embed.options.rolling_dim={self.dim} is smaller than n(n+1)/2 partitions")
        if not e.rolling_linear and self.dim != config.hidden_size:
            raise ConfigError(
                f"model.embed.options.rolling_dim={self.dim} != hidden {config.hidden_size} needs model.embed.options.rolling_linear=true"
            )
        seeds = torch.from_numpy(rolling_seeds(self.dim, self.n, int(e.rolling_seed)))
        self.register_buffer("seeds", seeds.clone())  # persistent: checkpoints carry the exact multipliers
        self.linear = None
        if e.rolling_linear:
            self.linear = torch.nn.Parameter(torch.empty(config.hidden_size, self.dim, dtype=config.params_dtype))
            self._init(self.linear)
        self._finish_init()

    @torch.no_grad()
    def features(self, codes: torch.Tensor) -> torch.Tensor:
        """Code rows [..., W] -> float32 [..., rolling_dim], computed once per distinct row."""
        flat = codes.reshape(-1, codes.shape[-1])
        uniq, inverse = unique_rows(flat)
        feats = rolling_code_features(uniq, self.seeds, self.parts, self.buckets, self.dim)
        return feats[inverse].view(*codes.shape[:-1], self.dim)

    def embed_words(self, tok, codes, word):
        check_codes(codes, self.width, "rolling")
        x = self.features(codes) * word.unsqueeze(-1)
        if self.linear is None:
            return x.to(self.out_dtype)
        return F.linear(x.to(self.linear.dtype), self.linear)
