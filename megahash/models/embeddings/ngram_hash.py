"""Token n-gram hash embeddings (``ngram-hash``): an add-on to ANY embedding kind (vocabulary or word hash),
the BigramHash of OpenAI's Parameter Golf entries and modded-nanogpt's bigram hash embedding.

For each position i of a sequence of token ids t and each order n of ``model.embed.options.ngram_hash_orders``
(2 and/or 3) the ids of the current token and the n-1 before it are hashed into B =
``model.embed.options.ngram_hash_buckets`` buckets (the Parameter Golf bigram hash, extended by a third
multiplier; exact integer arithmetic in int64):

    h_n(i) = ( XOR_{j=0..n-1} M_j * t_{i-j} ) mod (B - 1),   M = (36313, 27191, 51497)   if i >= n - 1
    h_n(i) = B - 1   (the reserved bucket)                                                 if i <  n - 1

(position i of the sequence, 0-based: the first n-1 positions have no full n-gram). Order k of the list
owns rows k*B .. k*B + B - 1 of one table T of K*B rows (K orders) and d = ``ngram_hash_dim`` columns, and the
model's input embedding becomes

    e'(i) = e(i) + P sum_k T[k*B + h_{n_k}(i)],    T in R^{KB x d} zero-initialised,  P in R^{h x d} ~ N(0, init_std)

so a model with the table starts exactly as the one without it (T = 0). ``ngram_hash_buckets = 0`` (default)
switches it off. Packed documents: the previous ids are those of the training sequence, so the tokens
before an end-of-document are hashed with the first tokens of the next document (no reset at EOD).

Decoding carries the last ``max(orders) - 1`` ids (``DecodeState.inputs`` / the HF cache's ``inputs``), so
incremental decoding equals the full forward. Parallelism: T and P are small and replicated over the
tensor-parallel ranks like the replicated hash-embedding parameters (:mod:`megahash.models.embeddings.base`):
without sequence parallelism every rank adds the term to the whole sequence and gets the full gradient;
with it each rank adds it to its own sequence slice and the gradients are summed over the TP group.
The table carries megatron-core's ``is_embedding_or_output_parameter`` marker (an embedding: AdamW, not Muon).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from megatron.core import parallel_state

from megahash.errors import ConfigError
from megahash.models.kind_input import KindInput
from megahash.models.norm import mark_sequence_parallel
from megahash.models.registry import InputCaps, register_input, register_reference


@register_reference("input:ngram-hash")
class NgramHashReference(nn.Module):
    """The n-gram table of the HF model: e' = e + P sum_k T[k B + h_k] (module docstring's hash)."""

    MULTIPLIERS = (36313, 27191, 51497)  # M_0 multiplies the current token, M_j the j-th previous one

    def __init__(self, config, meta):
        super().__init__()
        self.orders, self.buckets = tuple(int(n) for n in meta["orders"]), int(meta["buckets"])
        self.table = nn.Parameter(torch.zeros(len(self.orders) * self.buckets, int(meta["dim"])))
        self.proj = nn.Parameter(torch.zeros(config.hidden_size, int(meta["dim"])))

    @staticmethod
    def rows(ids, first: int, orders, buckets: int):
        """Token ids [b, L] at sequence positions first .. first+L-1 -> table rows [b, L, K] (k*B + h_n).
        Exact where the n-1 previous ids are inside the window (decoding puts the carried ids in front)."""
        ids = ids.long()
        length = ids.shape[1]
        pos = torch.arange(first, first + length, device=ids.device)
        out = []
        for k, n in enumerate(orders):
            h = NgramHashReference.MULTIPLIERS[0] * ids
            for j in range(1, n):
                prev = F.pad(ids, (j, 0))[:, :length]  # t_{i-j} (0 where outside the window: reserved below)
                h = torch.bitwise_xor(h, NgramHashReference.MULTIPLIERS[j] * prev)
            h = torch.where(pos >= n - 1, torch.remainder(h, buckets - 1), torch.full_like(h, buckets - 1))
            out.append(h + k * buckets)
        return torch.stack(out, dim=-1)

    @staticmethod
    def window(tokens, carried, offset: int, keep: int):
        """(ids with the carried previous ones in front, position of its first id, the ids to carry on)."""
        full = tokens if carried is None else torch.cat([carried.to(tokens.device), tokens], dim=1)
        first = offset - (0 if carried is None else carried.shape[1])
        return full, first, full[:, max(0, full.shape[1] - keep) :]

    def reset(self) -> None:
        pass

    def context(self, model, needed: int) -> dict:
        return {}

    def embed(self, input_ids, emb, cache):
        """emb [b, s, h] + the n-gram term; a cache carries the previous ids between decoding steps."""
        carried = None if cache is None else cache.inputs.get("ngram_hash")
        offset = 0 if cache is None else cache.offset
        full, first, keep = self.window(input_ids, carried, offset, max(self.orders) - 1)
        if cache is not None:
            cache.inputs["ngram_hash"] = keep
        rows = self.rows(full, first, self.orders, self.buckets)[:, full.shape[1] - input_ids.shape[1] :]
        term = F.linear(F.embedding(rows, self.table).sum(dim=-2), self.proj)
        return emb + term.to(emb.dtype)


@dataclass(frozen=True)
class NgramHashOptions:
    """``model.embed.options.*``."""

    ngram_hash_orders: str = "2,3"  # comma-separated n-gram orders, each 2 or 3
    ngram_hash_buckets: int = 0  # B: buckets per order (the last one reserved for the first n-1 positions); 0 = off
    ngram_hash_dim: int = 32  # d: columns of the table (projected to the hidden size)
    RANGES = {
        "ngram_hash_buckets": (0, None, False, False, "buckets per order (0 = off)"),
        "ngram_hash_dim": (1, None, False, False, "n-gram table width"),
    }


class NgramHashCosts:
    """Parameters K B d (the table) + h d (the projection), K orders; none when off."""

    @staticmethod
    def params(cfg):
        o = cfg.model.embed.options
        if not int(o.ngram_hash_buckets):
            return {}
        k = len([x for x in str(o.ngram_hash_orders).split(",") if x.strip()])
        d = int(o.ngram_hash_dim)
        return {"ngram": k * int(o.ngram_hash_buckets) * d + d * cfg.model.hidden_size}


def parse_orders(text) -> tuple:
    """``"2,3"`` -> (2, 3); a one-line ConfigError otherwise."""
    try:
        orders = tuple(sorted({int(x) for x in str(text).split(",") if x.strip()}))
    except ValueError:
        orders = ()
    if not orders or any(n not in (2, 3) for n in orders):
        raise ConfigError(f"model.embed.options.ngram_hash_orders={text!r}: give orders 2 and/or 3, e.g. 2,3")
    return orders


class NgramHashInput(KindInput):
    """The table T [K B, d] and projection P [h, d] added to the input embedding (module docstring)."""

    attr = "ngram_hash"

    def __init__(self, config, cfg):
        super().__init__()
        o = cfg.model.embed.options
        self.orders, self.buckets = parse_orders(o.ngram_hash_orders), int(o.ngram_hash_buckets)
        self.dim = int(o.ngram_hash_dim)
        if self.buckets < 2:
            raise ConfigError(f"model.embed.options.ngram_hash_buckets={self.buckets}: needs at least 2 (or 0 = off)")
        self.sequence_parallel = bool(config.sequence_parallel)
        dtype = config.params_dtype
        self.table = torch.nn.Parameter(torch.zeros(len(self.orders) * self.buckets, self.dim, dtype=dtype))
        self.proj = torch.nn.Parameter(torch.zeros(config.hidden_size, self.dim, dtype=dtype))
        if config.perform_initialization and not self.proj.is_meta:
            with torch.random.fork_rng(devices=[]):  # the other modules' initial weights stay as without it
                config.init_method(self.proj)
        self.table.is_embedding_or_output_parameter = True  # megatron-core's marker: an embedding (AdamW)
        mark_sequence_parallel([self.table, self.proj], self.sequence_parallel)

    def embed(self, tokens, emb, decode_state):
        carried = None if decode_state is None else decode_state.inputs.get(self.attr)
        offset = 0 if decode_state is None else decode_state.offset
        full, first, keep = NgramHashReference.window(tokens, carried, offset, max(self.orders) - 1)
        if decode_state is not None:
            decode_state.inputs[self.attr] = keep
        rows = NgramHashReference.rows(full, first, self.orders, self.buckets)[:, full.shape[1] - tokens.shape[1] :]
        rows = rows.transpose(0, 1)  # [s, b, K]
        tp = parallel_state.get_tensor_model_parallel_world_size()
        if self.sequence_parallel and tp > 1:  # this rank's slice of the sequence (as the embedding's scatter)
            n = rows.shape[0] // tp
            r = parallel_state.get_tensor_model_parallel_rank()
            rows = rows[r * n : (r + 1) * n]
        term = F.linear(F.embedding(rows, self.table).sum(dim=-2), self.proj)
        return emb + term.to(emb.dtype)

    def param_report(self) -> dict:
        return {"embedding_ngram": self.table.numel() + self.proj.numel()}

    def export_meta(self) -> dict:
        return {"kind": "ngram-hash", "orders": list(self.orders), "buckets": self.buckets, "dim": self.dim}


@register_input("ngram-hash", caps=InputCaps(section="embedding"), options=NgramHashOptions, costs=NgramHashCosts)
def build_ngram_hash(model, cfg):
    """The n-gram table of a model whose config switches it on (``ngram_hash_buckets > 0``), else None."""
    if not int(cfg.model.embed.options.ngram_hash_buckets):
        return None
    return NgramHashInput(model.config, cfg)
