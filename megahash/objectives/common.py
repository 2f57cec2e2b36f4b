"""Helpers shared by the corruption objectives (MLM, Shuffle+Random); torch is imported inside the
functions (the objective files are read by config checks, before torch)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from megahash.errors import DataError

if TYPE_CHECKING:
    import torch

NUM_SPECIAL = 5  # <s>=0 <pad>=1 </s>=2 <unk>=3 <mask>=4 (megahash.hashing.words): never corrupted
PAD_ID, MASK_ID = 1, 4


def special_mask(tokens: torch.Tensor, special_ids: dict | None = None) -> torch.Tensor:
    """Positions of special tokens: the tokenizer's special ids by role (``data.special_ids``), or
    the word ids 0-4 when none are given."""
    import torch

    if not special_ids:
        return tokens < NUM_SPECIAL
    ids = [int(i) for i in special_ids.values() if i is not None]
    return torch.isin(tokens, torch.tensor(ids, dtype=tokens.dtype, device=tokens.device))


def role_id(special_ids: dict | None, role: str, default: int) -> int:
    """The id of a special role (``default``: the word id) ; one-line error if the tokenizer lacks it."""
    if not special_ids:
        return default
    if special_ids.get(role) is None:
        raise DataError(f"the tokenizer has no {role} token, which this objective needs; use a tokenizer with one")
    return int(special_ids[role])


def bernoulli(shape, p: float, generator: torch.Generator, device) -> torch.Tensor:
    """Boolean [shape] with P(True) = p, drawn from ``generator`` (CPU) and moved to ``device``."""
    import torch

    return (torch.rand(shape, generator=generator) < p).to(device)


def draw_from_batch(tokens, hash_codes, pool_mask, count: int, generator: torch.Generator):
    """``count`` (token, codes) pairs drawn uniformly with replacement from the positions of
    ``pool_mask`` (the batch's own ordinary words: a vocabulary-free corpus sample)."""
    import torch

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


def pad_of(special_ids: dict | None) -> int:
    """The padding id (-1, matching nothing, when the tokenizer has no pad token)."""
    if not special_ids:
        return PAD_ID
    return -1 if special_ids.get("pad") is None else int(special_ids["pad"])
