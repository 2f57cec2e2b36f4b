"""The vocabulary head: the model's vocab-parallel ``output_layer`` (tied or not) + megatron's
vocab-parallel cross-entropy; positions labelled -100 (MLM: unmasked tokens) cost 0. For clm it is
exactly the LM head. At one TP rank the projection and the loss run fused and chunked over tokens
(:mod:`megahash.models.chunked_ce`: the same values, no [tokens x V] logits kept for backward)."""

from __future__ import annotations

import torch
from megatron.core import parallel_state

from megahash.models.chunked_ce import linear_cross_entropy
from megahash.models.heads import vocab_cross_entropy
from megahash.models.registry import HeadCaps, register_head


@register_head("vocab", caps=HeadCaps(standard=True, qwen2=True))
class VocabHead(torch.nn.Module):
    """LM / MLM head: ``model.logits`` (vocab-parallel ``output_layer``) + vocab-parallel CE."""

    uses_output_layer = True

    def __init__(self, config=None, cfg=None, vocab_size=None):
        super().__init__()
        self.z_loss = float(cfg.train.z_loss) if cfg is not None else 0.0  # train.z_loss (models/chunked_ce.py)

    def forward(self, model, hidden, labels=None, label_codes=None, hash_codes=None):
        weight = model.output_weight()
        if (
            labels is not None
            and parallel_state.get_tensor_model_parallel_world_size() == 1
            and not hasattr(weight, "ds_status")
        ):  # ZeRO-3 gathers the weight in the layer's own forward
            # projection + cross-entropy chunked over tokens: no [tokens x V] logits kept (models/chunked_ce.py)
            lab = labels.transpose(0, 1)
            loss = linear_cross_entropy(hidden, weight, lab.clamp(min=0), cap=model.logit_softcap, z_coef=self.z_loss)
            return loss.masked_fill(lab < 0, 0.0).transpose(0, 1).contiguous()  # [b, s]
        logits = model.logits(hidden)  # [s, b, V/TP]
        if labels is None:
            return logits.transpose(0, 1).contiguous()
        lab = labels.transpose(0, 1).contiguous()
        ignore = lab < 0
        loss = vocab_cross_entropy(logits.float(), lab.clamp(min=0))
        if self.z_loss:  # one TP rank (config_checks): the whole vocabulary's log-sum-exp
            loss = loss + self.z_loss * torch.logsumexp(logits.float(), dim=-1).square()
        return loss.masked_fill(ignore, 0.0).transpose(0, 1).contiguous()  # [b, s]
