"""Shuffle+Random (S+R, thesis sec. 2.3.6; Yamaguchi et al. 2021): a 3-way token classification.

Of the ordinary (non-special) tokens, each is selected for shuffling with p = 10%; within each
sequence the selected tokens are permuted among themselves (a random cyclic order, so every selected
position receives the token of another selected position; a sequence with a single selected token
leaves it unselected). Each remaining ordinary token is then replaced with p = 10% ("~10% of the
rest") by a random word drawn from the batch's own ordinary tokens (the corpus sample; the
vocabulary-free counterpart of the reference's random vocabulary ids). Hash codes always move with
their tokens. Labels: 0 original, 1 shuffled, 2 random, -100 special (untouched, no loss).
The expected fractions of ordinary tokens are therefore ~10% shuffled and 9% (= 10% of the other
90%) random, as in the reference collator (HUIYINXUE/hashformer).
"""
from __future__ import annotations

import torch

from megahash.objectives.common import pad_of, role_id, PAD_ID, bernoulli, replace_with_drawn, special_mask

SHUFFLE_PROB = 0.1
RANDOM_PROB = 0.1
ORIGINAL, SHUFFLED, RANDOM, IGNORE = 0, 1, 2, -100


def _cyclic_shuffle_sources(selected: torch.Tensor, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """For the selected positions (row-major flat indices ``dst``) the flat index ``src`` of the
    token each receives: a random cyclic permutation within each row."""
    b, s = selected.shape
    dst = selected.reshape(-1).nonzero(as_tuple=True)[0]
    if dst.numel() == 0:
        return dst, dst
    rows = dst // s
    keys = rows.double() + torch.rand(dst.numel(), generator=generator, dtype=torch.float64).to(dst.device)
    order = dst[torch.argsort(keys)]  # grouped by row, random order inside each row
    counts = torch.bincount(rows, minlength=b)
    starts = torch.cumsum(counts, 0) - counts
    pos = torch.arange(order.numel(), device=dst.device)
    row_of = rows[torch.argsort(keys)]
    nxt = starts[row_of] + (pos - starts[row_of] + 1) % counts[row_of]  # next in the row's cycle
    return order, order[nxt]


def corrupt(
    tokens: torch.Tensor,
    hash_codes: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    special_ids: dict | None = None,
    shuffle_prob: float = SHUFFLE_PROB,
    random_prob: float = RANDOM_PROB,
) -> dict:
    """tokens [b, s], hash_codes [b, s, w] or None -> dict(tokens, hash_codes, labels, loss_mask,
    padding_mask); deterministic given the generator's state."""
    if generator is None:
        generator = torch.Generator().manual_seed(0)
    dev = tokens.device
    special = special_mask(tokens, special_ids)
    word = ~special
    shuffled = bernoulli(tokens.shape, shuffle_prob, generator, dev) & word
    single = shuffled.sum(dim=1, keepdim=True) < 2  # nothing to swap with
    shuffled = shuffled & ~single
    random = bernoulli(tokens.shape, random_prob, generator, dev) & word & ~shuffled

    new_tokens = tokens.clone()
    new_codes = None if hash_codes is None else hash_codes.clone()
    dst, src = _cyclic_shuffle_sources(shuffled, generator)
    flat_tok = new_tokens.view(-1)
    flat_tok[dst] = tokens.reshape(-1)[src]
    if new_codes is not None:
        w = hash_codes.shape[-1]
        new_codes.view(-1, w)[dst] = hash_codes.reshape(-1, w)[src]
    replace_with_drawn(new_tokens, new_codes, tokens, hash_codes, word, random, generator)
    labels = torch.full_like(tokens, ORIGINAL, dtype=torch.long)
    labels[shuffled] = SHUFFLED
    labels[random] = RANDOM
    labels[special] = IGNORE
    return {
        "tokens": new_tokens,
        "hash_codes": new_codes,
        "labels": labels,
        "loss_mask": word.float(),
        "padding_mask": tokens != pad_of(special_ids),
    }
