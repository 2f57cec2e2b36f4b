"""Hash-bucket head: vocab-parallel Linear(h -> N) over the target word's bucket (md5-bucketN /
lsh-bucketN codes, or md5 % num_buckets), softmax cross-entropy."""

from __future__ import annotations

import torch
import torch.nn as nn
from megatron.core import parallel_state, tensor_parallel

from megahash.models.heads import target_codes, vocab_cross_entropy
from megahash.models.registry import HeadCaps, register_head, register_reference


@register_reference("head:hash-bucket")
class HashBucketReference(nn.Module):
    """Linear(h -> N) over the word's bucket (TP padding columns scored -1e4)."""

    reads_codes = True

    def __init__(self, config):
        super().__init__()
        self.num_buckets = int(config.num_buckets)
        self.padded = int(config.embed.get("head_padded_rows") or self.num_buckets)
        self.linear = nn.Linear(config.hidden_size, self.padded, bias=False)

    def forward(self, hidden):
        logits = self.linear(hidden)
        if self.padded != self.num_buckets:
            col = torch.arange(self.padded, device=logits.device)
            logits = logits.masked_fill(col >= self.num_buckets, -1e4)
        return logits


@register_head("hash-bucket", caps=HeadCaps(reads_hash_codes=True, token_loss=False))
class HashBucketHead(torch.nn.Module):
    """Predict the target word's bucket: vocab-parallel Linear(h -> N) + softmax CE
    (N from the bucket spec or model.embed.num_buckets; padding columns to a TP multiple are masked)."""

    uses_output_layer = False

    def __init__(self, config, cfg, vocab_size=None):
        super().__init__()
        from megahash.models.embeddings.base import bucket_count

        self.config = config
        self.num_buckets, self.mode = bucket_count(cfg, "model.head=hash-bucket")
        tp = parallel_state.get_tensor_model_parallel_world_size()
        self.padded = -(-self.num_buckets // tp) * tp
        self.linear = tensor_parallel.ColumnParallelLinear(
            config.hidden_size,
            self.padded,
            config=config,
            init_method=config.init_method,
            bias=False,
            skip_bias_add=False,
            gather_output=False,
        )

    def bucket_ids(self, codes: torch.Tensor) -> torch.Tensor:
        from megahash.models.embeddings.base import md5_mod

        return md5_mod(codes, self.num_buckets) if self.mode == "md5" else codes[..., 0].long()

    def forward(self, model, hidden, labels=None, label_codes=None, hash_codes=None):
        logits, _ = self.linear(hidden)  # [s, b, padded/TP]
        if self.padded != self.num_buckets:
            per = logits.shape[-1]
            col = torch.arange(per, device=logits.device) + parallel_state.get_tensor_model_parallel_rank() * per
            logits = logits.masked_fill(col >= self.num_buckets, -1e4)
        if labels is None:
            return logits.transpose(0, 1).contiguous()
        label_codes, valid = target_codes("hash-bucket", labels, label_codes, hash_codes)
        target = self.bucket_ids(label_codes).transpose(0, 1).contiguous()
        loss = vocab_cross_entropy(logits.float(), target).transpose(0, 1)
        return loss * valid
