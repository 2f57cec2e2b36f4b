"""HashFormer-Emb ([Xue25] sec. 2.3.1-2.3.3, Figure 2.1): an N-row table indexed by a hash bucket.

    i = H(t) % N  (MD5, sec. 2.3.2)   or   i = argmax(x R)  (circulant LSH, sec. 2.3.3),   e = E_i,  E in R^{N x d}

Parameters N x d (eq. 2.12). Table 2.2's Emb(50K) = 38.6M and Emb(1K) = 797.2K at d = 768 are
N = 50,260 and N = 1,038 rows (the shipped ``configs/embeddings/*-emb-{50k,1k}.yaml``). Codes: an ``md5-bucketN`` or
``lsh-bucketN`` side shard (int bucket ids, width 1), or the 128-bit ``md5`` shard together with
``model.embed.num_buckets = N`` (the bucket is then the big-endian digest modulo N, computed here;
same value as ``megahash.hashing.md5.md5_buckets``). N comes from the spec, or from
``model.embed.num_buckets`` (which must agree with a bucket spec when both are given).

The table is split by rows over tensor-parallel ranks exactly like megatron's
``VocabParallelEmbedding`` (which holds the weight, so its init and dist-checkpoint sharding are
megatron's; rows are padded to a multiple of TP, padding not counted). Each rank looks up the rows
it owns with an ``embedding_bag`` whose per-sample weight is 0 for specials and foreign rows, then
the partial sums are all-reduced (or reduce-scattered to the sequence-parallel slice under SP).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from megatron.core import parallel_state, tensor_parallel
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

from megahash.models.embeddings.base import HashEmbeddingBase, bucket_count, check_codes, md5_mod
from megahash.models.reference_layers import TorchHashEmbedding
from megahash.models.reference_ops import md5_code_mod
from megahash.models.registry import EmbeddingCaps, register_embedding, register_reference


@register_reference("hash-emb")
class HashEmbReference(TorchHashEmbedding):
    """HashFormer-Emb (eq. 2.12): row ``md5 % N`` (or the bucket code) of ``table``; specials from ``special``."""

    def __init__(self, config):
        super().__init__(config)
        e = config.embed
        self.num_rows, self.mode, self.padded_rows = int(e["num_rows"]), e["mode"], int(e["padded_rows"])
        self.table = nn.Embedding(self.padded_rows, config.hidden_size)

    def embed_words(self, tok, codes, word):
        if self.mode == "md5":
            self.check(codes, 16)
            ids = md5_code_mod(codes, self.num_rows)
        else:
            self.check(codes, 1)
            ids = codes[..., 0].long()
        return self.table(ids * word)


@register_embedding(
    "hash-emb",
    caps=EmbeddingCaps(sr_random="bits-uniform", example_hash_spec="md5-bucket64"),
    export_meta=lambda emb, cfg: {"num_rows": emb.num_rows, "mode": emb.mode, "padded_rows": emb.padded_rows},
)
class HashEmbedding(HashEmbeddingBase):
    """e = E[bucket] over an N x d table (eq. 2.12), row-split over TP."""

    sequence_local = False  # the TP-split table needs every rank to look up the whole sequence

    def __init__(self, config, cfg, vocab_size: int):
        super().__init__(config, cfg)
        self.num_rows, self.mode = bucket_count(cfg, "model.embedding=hash-emb")
        tp = parallel_state.get_tensor_model_parallel_world_size()
        self.padded_rows = -(-self.num_rows // tp) * tp
        self.table = tensor_parallel.VocabParallelEmbedding(
            num_embeddings=self.padded_rows,
            embedding_dim=config.hidden_size,
            init_method=config.init_method,
            config=config,
        )
        if not hasattr(self.table.weight, "tensor_model_parallel"):  # perform_initialization=False
            set_tensor_model_parallel_attributes(self.table.weight, is_parallel=True, dim=0, stride=1)
        self._finish_init()

    @property
    def weight(self) -> torch.Tensor:
        return self.table.weight

    def padding_rows(self) -> int:
        return self.padded_rows - self.num_rows

    def bucket_ids(self, codes: torch.Tensor) -> torch.Tensor:
        if self.mode == "md5":
            check_codes(codes, 16, "hash-emb")
            return md5_mod(codes, self.num_rows)
        check_codes(codes, 1, "hash-emb")
        return codes[..., 0].long()

    def embed_words(self, tok, codes, word):
        s, b = tok.shape
        ids = self.bucket_ids(codes)
        weight = self.table.weight
        keep = word
        tp = parallel_state.get_tensor_model_parallel_world_size()
        if tp > 1:
            start, end = self.table.vocab_start_index, self.table.vocab_end_index
            mine = (ids >= start) & (ids < end)
            keep = keep & mine
            ids = (ids - start) * mine
        else:
            ids = ids * word  # specials may carry any code: look up row 0 with weight 0
        out = F.embedding_bag(
            ids.reshape(-1, 1), weight, per_sample_weights=keep.reshape(-1, 1).to(weight.dtype), mode="sum"
        )  # [s * b, h]
        if tp == 1:
            return out
        out = out.view(s, b, -1)
        if self.config.sequence_parallel:
            return tensor_parallel.reduce_scatter_to_sequence_parallel_region(
                out, group=parallel_state.get_tensor_model_parallel_group()
            )  # [s/TP, b, h], fresh
        # the all-reduce returns its input as a view: the base copies it before writing the specials
        return tensor_parallel.reduce_from_tensor_model_parallel_region(
            out, group=parallel_state.get_tensor_model_parallel_group()
        )
