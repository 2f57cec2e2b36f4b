"""Optional GPU dispatch to flash-linear-attention's gated delta rule (``fla.ops.gated_delta_rule.
chunk_gated_delta_rule``, [Yang25b]; Triton, chunk 64): used by
:func:`megahash.ops.gated_delta.chunk.gated_delta_causal` on CUDA tensors when ``fla`` is installed, packed
documents through its ``cu_seqlens``; megahash's own chunked form otherwise (always on CPU), and for
training where fla refuses the backward (:func:`backward_refusal`)."""

from __future__ import annotations

import functools
import importlib.util
import warnings

import torch


def gated_delta_kernel():
    """``fla.ops.gated_delta_rule.chunk_gated_delta_rule`` or None (fla not installed)."""
    try:  # by name: the exported remote code must not list fla among its imports (optional extra)
        return __import__("fla.ops.gated_delta_rule", fromlist=["chunk_gated_delta_rule"]).chunk_gated_delta_rule
    except Exception:  # not installed, or a Triton that cannot build on this machine
        return None


@functools.cache  # fla's flags are constants once it is imported
def backward_refusal() -> str | None:
    """Why fla would refuse the gated delta rule's backward on this machine, or None. fla 0.6's
    ``chunk_bwd_dqkwg`` with a gate raises on Hopper GPUs under Triton >= 3.4.0 and < 3.7.1 (fla issue #640:
    wrong results) unless tilelang serves it (fla's backend dispatch tries tilelang first). Reads the flags the
    refusing code reads (``fla.ops.common.chunk_o``'s ``IS_NVIDIA_HOPPER``, ``TRITON_ABOVE_3_4_0``,
    ``TRITON_ABOVE_3_7_1``; a later fla without them refuses nothing). Seen on an H200 with the GPU image's
    torch 2.11 / Triton 3.6.0 (benchmarks/results/2026-11-30_gpu_check_NVIDIA-H200_rerun.md)."""
    try:
        chunk_o = importlib.import_module("fla.ops.common.chunk_o")
    except Exception:
        return None
    hopper = getattr(chunk_o, "IS_NVIDIA_HOPPER", False) and getattr(chunk_o, "TRITON_ABOVE_3_4_0", False)
    if not hopper or getattr(chunk_o, "TRITON_ABOVE_3_7_1", True) or importlib.util.find_spec("tilelang"):
        return None
    triton = getattr(importlib.import_module("triton"), "__version__", "?")
    return (
        f"fla refuses the gated delta rule's backward on Hopper with Triton {triton} (fla issue #640): training "
        "uses megahash's chunked form instead (fla's kernel still runs without gradients); Triton >= 3.7.1 or "
        "tilelang brings fla's kernel back"
    )


def _needs_backward(*tensors) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def fla_gated_delta(q, k, v, g, beta, state=None, need_state: bool = False, doc=None):
    """On CUDA: (out, state) from fla's kernel, or None where fla cannot run it (see :func:`fla_gated_delta_rule`)
    or would refuse its backward (:func:`backward_refusal`, said once as a warning)."""
    if not q.is_cuda or (doc is not None and (state is not None or need_state)):
        return None
    kernel = gated_delta_kernel()
    if kernel is None:
        return None
    if _needs_backward(q, k, v, g, beta, state) and (why := backward_refusal()) is not None:
        warnings.warn(why, RuntimeWarning, stacklevel=2)  # Python's default filter: once per call site
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
