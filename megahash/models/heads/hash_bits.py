"""Hash-bits head: Linear(h -> T) predicting the target word's T hash bits (md5 / lshT codes), loss =
sum over bits of the binary cross-entropy = -log p(code) under independent Bernoulli bits."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from megahash.errors import ConfigError
from megahash.models.heads import full_sequence, target_codes
from megahash.models.registry import HeadCaps, register_head, register_reference


@register_reference("head:hash-bits")
class HashBitsReference(nn.Module):
    """Linear(h -> T): logits of the target word's T hash bits."""

    reads_codes = True

    def __init__(self, config):
        super().__init__()
        self.linear = nn.Linear(config.hidden_size, int(config.code_width) * 8)

    def forward(self, hidden):
        return self.linear(hidden)


@register_head("hash-bits", caps=HeadCaps(reads_hash_codes=True, token_loss=False))
class HashBitsHead(torch.nn.Module):
    """Predict the target word's T hash bits: logits Linear(h -> T), loss sum_bits BCE
    (= -sum_bits log sigmoid(+-logit) = -log p(code))."""

    uses_output_layer = False

    def __init__(self, config, cfg, vocab_size=None):
        super().__init__()
        from megahash.models.embeddings.base import bit_shifts, parse_spec

        spec = parse_spec(cfg, "hash-bits head")
        if not spec.is_bits:
            raise ConfigError(
                f"model.head=hash-bits needs bit codes (model.embed.hash_spec md5 or lshT), got {spec.name!r}; "
                f"bucket codes need a head that reads bucket ids"
            )
        self.config = config
        self.num_bits = spec.num_bits
        self.linear = torch.nn.Linear(config.hidden_size, self.num_bits, dtype=config.params_dtype)
        if config.perform_initialization and not self.linear.weight.is_meta:
            with torch.no_grad():
                config.init_method(self.linear.weight)
                self.linear.bias.zero_()
        self.register_buffer("shifts", bit_shifts(), persistent=False)

    def targets(self, codes: torch.Tensor) -> torch.Tensor:
        from megahash.models.embeddings.base import unpack_bits

        return unpack_bits(codes, self.shifts).float()

    def forward(self, model, hidden, labels=None, label_codes=None, hash_codes=None):
        logits = self.linear(full_sequence(hidden, self.config)).transpose(0, 1)  # [b, s, T]
        if labels is None:
            return logits.contiguous()
        label_codes, valid = target_codes("hash-bits", labels, label_codes, hash_codes)
        target = self.targets(label_codes)
        loss = F.binary_cross_entropy_with_logits(logits.float(), target, reduction="none").sum(dim=-1)
        return loss * valid
