"""Optional GPU dispatch to flash-linear-attention's gated delta rule (``fla.ops.gated_delta_rule.
chunk_gated_delta_rule``, [Yang25b]; Triton, chunk 64): used by
:func:`megahash.ops.gated_delta.chunk.gated_delta_causal` on CUDA tensors when ``fla`` is installed, packed
documents through its ``cu_seqlens``; megahash's own chunked form otherwise (always on CPU)."""

from __future__ import annotations

import torch


def gated_delta_kernel():
    """``fla.ops.gated_delta_rule.chunk_gated_delta_rule`` or None (fla not installed)."""
    try:  # by name: the exported remote code must not list fla among its imports (optional extra)
        return __import__("fla.ops.gated_delta_rule", fromlist=["chunk_gated_delta_rule"]).chunk_gated_delta_rule
    except Exception:  # not installed, or a Triton that cannot build on this machine
        return None


def fla_gated_delta(q, k, v, g, beta, state=None, need_state: bool = False, doc=None):
    """On CUDA: (out, state) from fla's kernel, or None where fla cannot run it (see :func:`fla_gated_delta_rule`)."""
    if not q.is_cuda or (doc is not None and (state is not None or need_state)):
        return None
    kernel = gated_delta_kernel()
    if kernel is None:
        return None
    return fla_gated_delta_rule(kernel, q, k, v, g, beta, state, need_state, doc)


def fla_gated_delta_rule(kernel, q, k, v, g, beta, state=None, need_state: bool = False, doc=None):
    """megahash's layout through fla's kernel on any device (CPU tensors run it under Triton's interpreter,
    ``TRITON_INTERPRET=1``: tests/ops/test_fla_interpreted.py): scaled q, k [b, h, L, d_k], v [b, h, L, d_v],
    g, beta [b, h, L] (broadcast to one shape), state [b, h, d_k, d_v]; ``doc`` [b, 1, L] document ids (no
    state then): the rows' documents as fla's variable-length sequences. -> (out [b, h, L, d_v], state or None)."""
    lead = torch.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2], g.shape[:-1], beta.shape[:-1])
    b, h, L = *lead, q.shape[-2]

    def bthd(t):  # [b, h, L, x] -> fla's [b, L, h, x] (or, for packed documents, [1, b L, h, x])
        t = t.expand(*lead, L, t.shape[-1]).transpose(1, 2)
        return t if doc is None else t.reshape(1, b * L, h, t.shape[-1])

    cu = None
    if doc is not None:
        ids = doc.reshape(b, L)
        new = torch.ones_like(ids, dtype=torch.bool)
        new[:, 1:] = ids[:, 1:] != ids[:, :-1]  # a document (or a row) starts
        cu = torch.cat([new.reshape(-1).nonzero().reshape(-1), torch.tensor([b * L], device=ids.device)])
    out, final = kernel(
        bthd(q),
        bthd(k),
        bthd(v),
        bthd(g.unsqueeze(-1)).squeeze(-1),
        bthd(beta.unsqueeze(-1)).squeeze(-1),
        scale=1.0,
        initial_state=state,
        output_final_state=need_state,
        cu_seqlens=cu,
    )
    return out.reshape(b, L, h, v.shape[-1]).transpose(1, 2).to(v.dtype), final
