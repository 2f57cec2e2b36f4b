"""Helpers shared by the corruption objectives (MLM, Shuffle+Random)."""
from __future__ import annotations

import torch

NUM_SPECIAL = 5  # <s>=0 <pad>=1 </s>=2 <unk>=3 <mask>=4 (megahash.hashing.words): never corrupted
PAD_ID, MASK_ID = 1, 4


def special_mask(tokens: torch.Tensor) -> torch.Tensor:
    return tokens < NUM_SPECIAL


def bernoulli(shape, p: float, generator: torch.Generator, device) -> torch.Tensor:
    """Boolean [shape] with P(True) = p, drawn from ``generator`` (CPU) and moved to ``device``."""
    return (torch.rand(shape, generator=generator) < p).to(device)


def draw_from_batch(tokens, hash_codes, pool_mask, count: int, generator: torch.Generator):
    """``count`` (token, codes) pairs drawn uniformly with replacement from the positions of
    ``pool_mask`` (the batch's own ordinary words: a vocabulary-free corpus sample)."""
    flat_pos = pool_mask.reshape(-1).nonzero(as_tuple=True)[0]
    if count == 0 or flat_pos.numel() == 0:
        return None, None
    pick = flat_pos[torch.randint(flat_pos.numel(), (count,), generator=generator).to(flat_pos.device)]
    toks = tokens.reshape(-1)[pick]
    codes = None if hash_codes is None else hash_codes.reshape(-1, hash_codes.shape[-1])[pick]
    return toks, codes


def replace_with_drawn(new_tokens, new_codes, tokens, hash_codes, pool_mask, where, generator: torch.Generator) -> None:
    """In place: the positions ``where`` of ``new_tokens`` (and ``new_codes``) get (token, codes)
    pairs drawn by :func:`draw_from_batch` from the original batch, so codes move with their words."""
    toks, codes = draw_from_batch(tokens, hash_codes, pool_mask, int(where.sum()), generator)
    if toks is not None:
        new_tokens[where] = toks
        if new_codes is not None:
            new_codes[where] = codes
