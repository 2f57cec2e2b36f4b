"""Document boundaries inside packed sequences (``data.reset_position_ids``, ``data.reset_attention_mask``,
``data.eod_mask_loss``: Megatron-LM's flags and semantics, docs/data.md#packed-documents).

Boundaries are derived from the tokens, never stored as an L x L mask: the EOD token belongs to the
document it ends, so ``doc[i]`` = the number of EOD tokens in ``tokens[:i]`` (strictly before i), and
the position of token i restarts at 0 at each document start (Megatron's ``_get_ltor_masks_and_position_ids``
without its [s, s] mask). The model hands ``document_ids`` to every attention module in the per-forward
state (``ForwardState.document_ids``); softmax kinds attend within a document
(:mod:`megahash.models.attention.document_mask`).
"""

from __future__ import annotations

import torch

FLAGS = ("reset_position_ids", "reset_attention_mask", "eod_mask_loss")
BATCH_KEYS = ("document_ids", "position_ids")  # what the model's forward takes from a batch


def document_ids(tokens: torch.Tensor, eod: int) -> torch.Tensor:
    """tokens [b, s] -> [b, s] long: doc[i] = #EOD in tokens[:i] (the EOD ends its own document)."""
    is_eod = (tokens == eod).long()
    return torch.cumsum(is_eod, dim=-1) - is_eod


def position_ids(doc: torch.Tensor) -> torch.Tensor:
    """[b, s] document ids -> position of each token within its document (0 at every document start)."""
    s = doc.shape[-1]
    idx = torch.arange(s, device=doc.device).expand_as(doc)
    start = torch.cat([torch.ones_like(doc[..., :1], dtype=torch.bool), doc[..., 1:] != doc[..., :-1]], dim=-1)
    first = torch.cummax(torch.where(start, idx, torch.zeros_like(idx)), dim=-1).values
    return idx - first


def eod_loss_mask(tokens: torch.Tensor, loss_mask: torch.Tensor, eod: int) -> torch.Tensor:
    """Megatron's ``loss_mask[tokens == eod] = 0`` (no loss on the prediction made at an EOD input)."""
    return loss_mask * (tokens != eod).to(loss_mask.dtype)


def enabled(data_cfg) -> bool:
    return any(bool(getattr(data_cfg, f, False)) for f in FLAGS)


def sample_fields(tokens: torch.Tensor, loss_mask: torch.Tensor, data_cfg, eod: int) -> dict:
    """The fields a sample (or batch) of ``tokens`` gains under the flags of ``data_cfg``."""
    out = {}
    doc = document_ids(tokens, eod)
    if data_cfg.reset_attention_mask:
        out["document_ids"] = doc
    if data_cfg.reset_position_ids:
        out["position_ids"] = position_ids(doc)
    if data_cfg.eod_mask_loss:
        out["loss_mask"] = eod_loss_mask(tokens, loss_mask, eod)
    return out


def forward_kwargs(batch: dict) -> dict:
    """The model's document keyword arguments of a batch (empty when the flags are off)."""
    return {k: batch[k] for k in BATCH_KEYS if batch.get(k) is not None}


def eod_id(special_ids: dict | None) -> int:
    """The end-of-document id: the tokenizer's ``eos`` (the data stage's 2 when none is recorded)."""
    eos = (special_ids or {}).get("eos")
    return 2 if eos is None else int(eos)
