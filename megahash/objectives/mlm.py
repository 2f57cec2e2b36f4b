"""Masked language modelling ([Devlin19]), vocabulary-free.

15% of the ordinary (non-special) tokens are selected; of those 80% become ``<mask>`` (id 4, codes
zeroed, like every special), 10% a random word and 10% stay. The random words are drawn from the
batch's own ordinary tokens *with their codes* (a vocabulary-free corpus sample), so token and codes
always stay consistent and no vocabulary size is needed. Labels are the original tokens at the
selected positions and -100 elsewhere; ``label_codes`` holds the original codes (targets of the
hash-code heads). Special tokens are never selected.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from megahash.objective_spec import ObjectiveSpec, register_objective
from megahash.objectives.common import MASK_ID, bernoulli, pad_of, replace_with_drawn, role_id, special_mask

MASK_PROB = 0.15
MASK_TOKEN_FRAC = 0.8
RANDOM_FRAC = 0.1

if TYPE_CHECKING:
    import torch


def corrupt(
    tokens: torch.Tensor,
    hash_codes: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    special_ids: dict | None = None,
    mask_prob: float = MASK_PROB,
    mask_token_frac: float = MASK_TOKEN_FRAC,
    random_frac: float = RANDOM_FRAC,
) -> dict:
    """tokens [b, s], hash_codes [b, s, w] or None -> dict(tokens, hash_codes, labels, label_codes,
    loss_mask, padding_mask). Deterministic given the generator's state (draws: one uniform per
    position for selection, one per position for the 80/10/10 split, then the random words)."""
    import torch

    if generator is None:
        generator = torch.Generator().manual_seed(0)
    dev = tokens.device
    special = special_mask(tokens, special_ids)
    word = ~special
    selected = bernoulli(tokens.shape, mask_prob, generator, dev) & word
    split = torch.rand(tokens.shape, generator=generator).to(dev)
    to_mask = selected & (split < mask_token_frac)
    to_random = selected & (split >= mask_token_frac) & (split < mask_token_frac + random_frac)

    new_tokens = tokens.clone()
    new_codes = None if hash_codes is None else hash_codes.clone()
    new_tokens[to_mask] = role_id(special_ids, "mask", MASK_ID)
    if new_codes is not None:
        new_codes[to_mask] = 0
    replace_with_drawn(new_tokens, new_codes, tokens, hash_codes, word, to_random, generator)
    labels = torch.where(selected, tokens, torch.full_like(tokens, -100)).long()
    out = {
        "tokens": new_tokens,
        "hash_codes": new_codes,
        "labels": labels,
        "loss_mask": selected.float(),
        "padding_mask": tokens != pad_of(special_ids),
    }
    if hash_codes is not None:
        out["label_codes"] = hash_codes
    return out


# labels: the original tokens at the selected positions (a vocabulary loss, no perplexity: not next-token)
register_objective(ObjectiveSpec("mlm", token_loss=True, corrupt=corrupt, arch="encoder", roles=("mask",)))
