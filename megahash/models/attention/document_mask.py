"""Softmax attention inside packed documents (``data.reset_attention_mask``) and within a sliding window (a
kind's ``window``; not a kind).

Token i attends to token j iff doc[i] = doc[j] (and j <= i in a decoder; key j not padding in an encoder),
the block-diagonal form of softmax(QK^T/sqrt(d_h) + M) V ([Xue25] eq. 3.1) with M = 0 inside a
document and -inf across (Megatron-LM's ``--reset-attention-mask``); with a window of W keys also
i - W < j <= i (|i - j| < W in an encoder; :mod:`megahash.ops.utils.window`), the two rules joined as
FlexAttention's ``and_masks`` joins mask functions. The document ids [b, s] come from
the tokens (megahash/data/documents.py); the kernel is the accelerator's choice
(:func:`megahash.accelerator.policy.document_attention_kernel`): FlexAttention with a ``BlockMask`` (no [s, s]
tensor; blocks outside the documents and the window skipped) or SDPA with a mask built once per forward
(additive, in the queries' dtype) and shared by the layers (kept on the document-id tensor, or without
documents in the forward's ``MixState.masks``). A token always sees itself, so a padding query whose
document (or window) holds only padding keys gets a finite output.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megahash.accelerator import policy
from megahash.ops.utils.window import band_mask, in_window


def _rows(document_ids: torch.Tensor, b: int) -> torch.Tensor:
    """Document ids for b sequences: rows a kind input appended (a fixed sequence) are one document."""
    if document_ids.shape[0] >= b:
        return document_ids
    extra = document_ids.new_zeros(b - document_ids.shape[0], document_ids.shape[1])
    return torch.cat([document_ids, extra])


def _cached(document_ids: torch.Tensor | None, masks: dict | None, key: tuple, build):
    """One mask per (forward, key): the layers of a forward share it, kept on the forward's document-id
    tensor, else in its ``masks`` dict (None: built at every call)."""
    if torch.compiler.is_compiling():
        return build()
    store = masks
    if document_ids is not None:
        store = getattr(document_ids, "_megahash_masks", None)
        if store is None:
            store = document_ids._megahash_masks = {}
    if store is None:
        return build()
    if key not in store:
        store[key] = build()
    return store[key]


def boolean_mask(
    document_ids: torch.Tensor | None,
    b: int,
    causal: bool,
    keep: torch.Tensor | None,
    window: int | None = None,
    s: int | None = None,
    device=None,
) -> torch.Tensor:
    """[b, 1, s, s] boolean (True = attend) block-diagonal (causal) mask; ``keep`` [b, s] valid keys;
    ``window``: also within the sliding window (without documents: ``s`` positions on ``device``, batch dim 1
    unless ``keep``)."""
    if document_ids is None:
        mask = torch.ones(1, s, s, dtype=torch.bool, device=device)
        if causal:
            mask = mask.tril()
    else:
        doc = _rows(document_ids, b)
        s = doc.shape[1]
        mask = doc[:, :, None] == doc[:, None, :]
        if causal:
            mask = mask & torch.ones(s, s, dtype=torch.bool, device=doc.device).tril()
    if window is not None:
        mask = mask & band_mask(s, s, window, causal, mask.device)
    if keep is not None:
        mask = mask & keep[:, None, :].bool()
        mask = mask | torch.eye(s, dtype=torch.bool, device=mask.device)
    return mask[:, None]


def block_mask(
    document_ids: torch.Tensor | None,
    b: int,
    causal: bool,
    keep: torch.Tensor | None,
    compiled: bool = False,
    window: int | None = None,
    s: int | None = None,
    device=None,
):
    """FlexAttention ``BlockMask`` of the same rule (built from the ids; blocks without a visible key skipped);
    ``compiled``: built by a compiled kernel, block by block (eager, torch evaluates the rule on all [b, s, s]).
    The document rule and the window rule are two mask functions joined by FlexAttention's ``and_masks``."""
    from torch.nn.attention.flex_attention import and_masks, create_block_mask

    rules = []
    if document_ids is not None:
        doc = _rows(document_ids, b)
        s, device = doc.shape[1], doc.device

        def same_document(bi, hi, qi, ki):
            return doc[bi, qi] == doc[bi, ki]

        rules.append(same_document)
    if causal:
        rules.append(lambda bi, hi, qi, ki: qi >= ki)
    if window is not None:
        rules.append(lambda bi, hi, qi, ki: in_window(qi, ki, window, causal))
    if keep is not None:  # padding keys: masked, except a token's own position

        def valid_key(bi, hi, qi, ki):
            return keep[bi, ki] | (qi == ki)

        rules.append(valid_key)
    rule = and_masks(*rules)
    rows = b if document_ids is not None or keep is not None else None
    return create_block_mask(rule, rows, None, s, s, device=device, _compile=compiled)


def attend(q, k, v, document_ids, causal: bool, keep=None, scale=None, dropout_p: float = 0.0, window=None, masks=None):
    """q, k, v [b, heads, s, d_h] (k, v already repeated to q's heads) -> [b, heads, s, d_h]: inside the packed
    documents of ``document_ids`` [b, s] (or None) and within ``window`` keys (or None); ``masks``: the forward's
    mask store when there are no document ids."""
    b, s = q.shape[0], q.shape[2]
    keep = None if keep is None else keep.bool()
    head_dim = min(q.shape[-1], v.shape[-1])
    rows = b if document_ids is not None or keep is not None else 1
    if policy.document_attention_kernel(q.device, dropout_p > 0, head_dim, q.dtype) == "flex":
        bm = _cached(
            document_ids,
            masks,
            ("flex", rows, s, causal, keep is not None, window),
            lambda: block_mask(document_ids, b, causal, keep, True, window, s, q.device),
        )
        return policy.flex_attention(q.device)(q, k, v, block_mask=bm, scale=scale)
    mask = _cached(
        document_ids,
        masks,
        ("sdpa", rows, s, causal, keep is not None, window, q.dtype),
        lambda: additive_mask(boolean_mask(document_ids, b, causal, keep, window, s, q.device), q.dtype),
    )
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, scale=scale)


def additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The boolean mask as SDPA's additive form (0 / -inf) in the queries' dtype, made once per forward: SDPA
    converts a boolean mask to this form at every call (every layer); measured 0.9x the time of a boolean
    mask's forward + backward at s = 1024 on CPU."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
