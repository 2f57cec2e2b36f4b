"""Causal LM: next-token prediction. Nothing is corrupted; ``corrupt`` only shifts a window.

megahash's dataset already yields shifted ``tokens``/``labels`` (and ``hash_codes``/``label_codes``),
so the trainer uses its batches as they are; :func:`corrupt` is the same shift for callers holding an
unshifted window of s + 1 tokens (tests, notebooks), with the interface of the other objectives.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from megahash.objective_spec import ObjectiveSpec, register_objective
from megahash.objectives.common import pad_of

if TYPE_CHECKING:
    import torch


def corrupt(
    tokens: torch.Tensor,
    hash_codes: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    special_ids: dict | None = None,
) -> dict:
    """tokens [b, s + 1] (codes [b, s + 1, w]) -> inputs/labels [b, s]; ``generator`` is unused.

    Returns dict(tokens, hash_codes, labels, label_codes, loss_mask): labels[t] = tokens[t + 1],
    label_codes[t] = hash_codes[t + 1] (targets of the hash-code heads), loss_mask 0 where the label
    is the tokenizer's pad (``special_ids``, as the other objectives take it; none given: the word id 1;
    a tokenizer without a pad masks nothing)."""
    labels = tokens[:, 1:].contiguous()
    out = {
        "tokens": tokens[:, :-1].contiguous(),
        "hash_codes": None if hash_codes is None else hash_codes[:, :-1].contiguous(),
        "labels": labels,
        "loss_mask": (labels != pad_of(special_ids)).float(),
    }
    if hash_codes is not None:
        out["label_codes"] = hash_codes[:, 1:].contiguous()
    return out


# the dataset's shifted batch as it is; next-token loss over the vocabulary: perplexity, lm-eval, Qwen2
register_objective(ObjectiveSpec("clm", token_loss=True, next_token=True, arch="decoder", standard=True))
