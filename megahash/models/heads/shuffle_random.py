"""Shuffle+Random head ([Xue25] sec. 2.3.6): Linear(h -> 3), cross-entropy over original / shuffled /
random; labels -100 cost 0. Trained by the objective that names it as its own head (not selected by
``model.head``)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from megahash.models.heads import full_sequence
from megahash.models.registry import HeadCaps, register_head, register_reference


@register_reference("head:shuffle-random")
class ShuffleRandomReference(nn.Module):
    """Linear(h -> 3): original / shuffled / random ([Xue25] sec. 2.3.6); cross-entropy over 3 classes."""

    token_classes = 3

    def __init__(self, config):
        super().__init__()
        self.linear = nn.Linear(config.hidden_size, 3)

    def forward(self, hidden):
        return self.linear(hidden)


@register_head("shuffle-random", caps=HeadCaps(selectable=False, token_loss=False))
class ShuffleRandomHead(torch.nn.Module):
    """Shuffle+Random ([Xue25] sec. 2.3.6, [Yamaguchi21]): Linear(h, 3) + CE; labels
    0 original, 1 shuffled, 2 random, -100 ignored (specials)."""

    uses_output_layer = False

    def __init__(self, config, cfg=None, vocab_size=None):
        super().__init__()
        self.config = config
        self.linear = torch.nn.Linear(config.hidden_size, 3, dtype=config.params_dtype)
        if config.perform_initialization and not self.linear.weight.is_meta:
            with torch.no_grad():
                config.init_method(self.linear.weight)
                self.linear.bias.zero_()

    def forward(self, model, hidden, labels=None, label_codes=None, hash_codes=None):
        logits = self.linear(full_sequence(hidden, self.config)).transpose(0, 1)  # [b, s, 3]
        if labels is None:
            return logits.contiguous()
        loss = F.cross_entropy(
            logits.float().reshape(-1, 3), labels.reshape(-1).long(), ignore_index=-100, reduction="none"
        )
        return loss.view(labels.shape)
