"""Softmax attention inside packed documents (``data.reset_attention_mask``; not a kind).

Token i attends to token j iff doc[i] = doc[j] (and j <= i in a decoder; key j not padding in an encoder),
the block-diagonal form of softmax(QK^T/sqrt(d_h) + M) V ([Xue25] eq. 3.1) with M = 0 inside a
document and -inf across (Megatron-LM's ``--reset-attention-mask``). The document ids [b, s] come from
the tokens (megahash/data/documents.py); the kernel is the accelerator's choice
(:func:`megahash.accelerator.policy.document_attention_kernel`): FlexAttention with a ``BlockMask`` (no [s, s]
tensor) or SDPA with a mask built once per forward (additive, in the queries' dtype) and shared by the
layers. A token always sees itself, so a padding query whose document holds only padding keys gets a
finite output.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megahash.accelerator import policy


def _rows(document_ids: torch.Tensor, b: int) -> torch.Tensor:
    """Document ids for b sequences: rows a kind input appended (a fixed sequence) are one document."""
    if document_ids.shape[0] >= b:
        return document_ids
    extra = document_ids.new_zeros(b - document_ids.shape[0], document_ids.shape[1])
    return torch.cat([document_ids, extra])


def _cached(document_ids: torch.Tensor, key: tuple, build):
    """One mask per (forward's document-id tensor, key): the layers of a forward share it."""
    store = getattr(document_ids, "_megahash_masks", None)
    if store is None or torch.compiler.is_compiling():
        store = {}
        if not torch.compiler.is_compiling():
            document_ids._megahash_masks = store
    if key not in store:
        store[key] = build()
    return store[key]


def boolean_mask(document_ids: torch.Tensor, b: int, causal: bool, keep: torch.Tensor | None) -> torch.Tensor:
    """[b, 1, s, s] boolean (True = attend) block-diagonal (causal) mask; ``keep`` [b, s] valid keys."""
    doc = _rows(document_ids, b)
    s = doc.shape[1]
    mask = doc[:, :, None] == doc[:, None, :]
    if causal:
        mask = mask & torch.ones(s, s, dtype=torch.bool, device=doc.device).tril()
    if keep is not None:
        mask = mask & keep[:, None, :].bool()
        mask = mask | torch.eye(s, dtype=torch.bool, device=doc.device)
    return mask[:, None]


def block_mask(document_ids: torch.Tensor, b: int, causal: bool, keep: torch.Tensor | None, compiled: bool = False):
    """FlexAttention ``BlockMask`` of the same rule (built from the ids; blocks without a visible key skipped);
    ``compiled``: built by a compiled kernel, block by block (eager, torch evaluates the rule on all [b, s, s])."""
    from torch.nn.attention.flex_attention import create_block_mask

    doc = _rows(document_ids, b)
    s = doc.shape[1]

    def mask_mod(bi, hi, qi, ki):
        ok = doc[bi, qi] == doc[bi, ki]
        if causal:
            ok = ok & (qi >= ki)
        if keep is not None:
            ok = (ok & keep[bi, ki]) | (qi == ki)
        return ok

    return create_block_mask(mask_mod, b, None, s, s, device=doc.device, _compile=compiled)


def attend(q, k, v, document_ids, causal: bool, keep=None, scale=None, dropout_p: float = 0.0):
    """q, k, v [b, heads, s, d_h] (k, v already repeated to q's heads) -> [b, heads, s, d_h]."""
    b = q.shape[0]
    keep = None if keep is None else keep.bool()
    head_dim = min(q.shape[-1], v.shape[-1])
    if policy.document_attention_kernel(q.device, dropout_p > 0, head_dim, q.dtype) == "flex":
        bm = _cached(
            document_ids,
            ("flex", b, causal, keep is not None),
            lambda: block_mask(document_ids, b, causal, keep, compiled=True),
        )
        return policy.flex_attention(q.device)(q, k, v, block_mask=bm, scale=scale)
    mask = _cached(
        document_ids,
        ("sdpa", b, causal, keep is not None, q.dtype),
        lambda: additive_mask(boolean_mask(document_ids, b, causal, keep), q.dtype),
    )
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, scale=scale)


def additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The boolean mask as SDPA's additive form (0 / -inf) in the queries' dtype, made once per forward: SDPA
    converts a boolean mask to this form at every call (every layer); measured 0.9x the time of a boolean
    mask's forward + backward at s = 1024 on CPU."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
