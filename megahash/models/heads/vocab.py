"""The vocabulary head: the model's vocab-parallel ``output_layer`` (tied or not) + megatron's
vocab-parallel cross-entropy; positions labelled -100 (MLM: unmasked tokens) cost 0. For clm it is
exactly the LM head."""
from __future__ import annotations

import torch

from megahash.models.heads import vocab_cross_entropy
from megahash.models.registry import HeadCaps, register_head


@register_head("vocab", caps=HeadCaps(standard=True, qwen2=True))
class VocabHead(torch.nn.Module):
    """LM / MLM head: ``model.logits`` (vocab-parallel ``output_layer``) + vocab-parallel CE."""

    uses_output_layer = True

    def __init__(self, config=None, cfg=None, vocab_size=None):
        super().__init__()

    def forward(self, model, hidden, labels=None, label_codes=None, hash_codes=None):
        logits = model.logits(hidden)  # [s, b, V/TP]
        if labels is None:
            return logits.transpose(0, 1).contiguous()
        lab = labels.transpose(0, 1).contiguous()
        ignore = lab < 0
        loss = vocab_cross_entropy(logits.float(), lab.clamp(min=0))
        return loss.masked_fill(ignore, 0.0).transpose(0, 1).contiguous()  # [b, s]
