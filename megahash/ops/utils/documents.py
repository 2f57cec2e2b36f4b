"""Document boundaries for the linear and recurrent kernels (packed rows, ``data.reset_attention_mask``).

``doc`` [..., L] are nondecreasing document ids of a row (``ForwardState.document_ids``,
:mod:`megahash.data.documents`). A key j reaches a query i only when doc(j) == doc(i): the causal sums
restart at each document start. In a chunked form, because ids never decrease, the keys of an earlier
chunk c' that share position i's document are exactly that chunk's *tail* (its keys of the document
of its last token, doc_end(c')), and only when doc(i) == doc_end(c'); a position whose document starts
inside its own chunk gets nothing from earlier chunks. So a same-document mask on the intra-chunk
maps, tail states per chunk, and a 0/1 chunk-to-chunk matrix W[c, c'] = [c' < c][doc_end(c') ==
doc_start(c)] replace the exclusive cumulative sum over chunks: the number of operator calls does not
depend on the number of documents (no Python loop over documents)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def chunk_ids(doc: torch.Tensor, chunk: int) -> torch.Tensor:
    """[..., L] -> [..., n, C], padded at the end with the last id (padded keys are zero anyway)."""
    pad = (-doc.shape[-1]) % chunk
    if pad:
        doc = torch.cat([doc, doc[..., -1:].expand(*doc.shape[:-1], pad)], dim=-1)
    return doc.reshape(*doc.shape[:-1], doc.shape[-1] // chunk, chunk)


def same_document(docc: torch.Tensor) -> torch.Tensor:
    """[..., n, C] ids -> [..., n, C, C] bool: query i and key j of a chunk share a document."""
    return docc.unsqueeze(-1) == docc.unsqueeze(-2)


def carry_matrix(docc: torch.Tensor) -> torch.Tensor:
    """W [..., n + 1, n] (0/1): row c < n takes the tail state of chunk c' < c when doc_end(c') ==
    doc_start(c); row n (the state after the call) takes every tail of the last token's document."""
    start = torch.cat([docc[..., :, 0], docc[..., -1:, -1]], dim=-1)  # [..., n + 1]
    end = docc[..., :, -1]  # [..., n]
    n = end.shape[-1]
    before = torch.ones(n + 1, n, dtype=torch.bool, device=docc.device).tril(-1)
    return (start.unsqueeze(-1) == end.unsqueeze(-2)) & before


def pair_mask(doc: torch.Tensor, key_mask=None) -> torch.Tensor:
    """Encoders: [..., L, L] bool, query i sees key j of its document (and a valid key, ``key_mask``
    [..., L]); a query always sees itself (a padding query stays finite)."""
    m = same_document(doc)
    if key_mask is not None:
        eye = torch.eye(doc.shape[-1], dtype=torch.bool, device=doc.device)
        m = (m & key_mask.unsqueeze(-2).bool()) | eye
    return m


def starts(doc: torch.Tensor) -> torch.Tensor:
    """[..., L] bool: position i starts a document (i = 0 or doc(i) != doc(i-1))."""
    return F.pad(doc[..., 1:] != doc[..., :-1], (1, 0), value=True)


def first_index(doc: torch.Tensor) -> torch.Tensor:
    """[..., L] long: the index of the first token of position i's document."""
    idx = torch.arange(doc.shape[-1], device=doc.device).expand_as(doc)
    return torch.cummax(torch.where(starts(doc), idx, torch.zeros_like(idx)), dim=-1).values


def document_positions(doc: torch.Tensor) -> torch.Tensor:
    """[..., L] long: the position of each token within its document (0 at every document start)."""
    return torch.arange(doc.shape[-1], device=doc.device) - first_index(doc)


def row_ids(doc: torch.Tensor, lead: int) -> torch.Tensor:
    """document_ids [b, L] -> [b, 1, ..., 1, L] broadcasting against [b, g, rep, L, .] kernels (``lead``
    singleton axes between b and L)."""
    return doc.reshape(doc.shape[0], *([1] * lead), doc.shape[-1])


def document_rows(doc, q: torch.Tensor):
    """``doc`` [b, L] (the forward's document ids; None: no resets) as [b, 1, .., 1, L] against the kernels'
    q [b, g, rep, L, d]; None when ``doc`` is."""
    return None if doc is None else row_ids(doc.to(q.device), q.dim() - 3)
