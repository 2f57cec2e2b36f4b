"""Chunked causal linear attention: batched GEMMs over all chunks at once, the state carried by a
cumulative sum over chunks ([Katharopoulos20], eq. 4-6; the chunk form of [Yang24]).

For a kernel K(q, k) = phi(q).phi(k) the causal sums are, for a query i in chunk c,

    num_i = sum_{j<=i, j in c} K(q_i, k_j) v_j + phi(q_i) S_{<c},   S_{<c} = sum_{c'<c} phi(K_c')^T V_c'
    den_i = sum_{j<=i, j in c} K(q_i, k_j)     + phi(q_i) z_{<c},   z_{<c} = sum_{c'<c} phi(K_c')^T 1

The sequence is cut into n chunks of C tokens (zero-padded at the end) and viewed as [..., n, C, f]:
the intra-chunk maps tril(K(Q_c, K_c)) are one batched GEMM ([..., n, C, C], L*C entries, never
L x L), the per-chunk states phi(K_c)^T V_c another, and S_{<c} is their exclusive cumulative sum
over the chunk axis. The number of operator calls does not depend on L.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from megahash.ops.utils.documents import carry_matrix, chunk_ids, same_document
from megahash.ops.utils.fp32 import autocast_off


def to_chunks(x: torch.Tensor, chunk: int) -> torch.Tensor:
    """[..., L, f] -> [..., n, C, f], zero-padded at the end to n*C >= L."""
    pad = (-x.shape[-2]) % chunk
    if pad:
        x = F.pad(x, (0, 0, 0, pad))
    return x.reshape(*x.shape[:-2], x.shape[-2] // chunk, chunk, x.shape[-1])


def exclusive_cumsum(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Sums of the entries before each one along ``dim`` (the first is 0), without cancellation."""
    c = torch.cumsum(x.narrow(dim, 0, x.shape[dim] - 1), dim)
    return torch.cat([torch.zeros_like(x.narrow(dim, 0, 1)), c], dim)


class FeatureMatmul(torch.autograd.Function):
    """phi(x) @ b (or phi(x)^T @ b) with phi recomputed in backward: saves x and b, not the wider
    features (the feature map fused into the GEMM as far as plain torch allows)."""

    @staticmethod
    def forward(ctx, x, b, features, transpose):
        f = features(x)
        ctx.save_for_backward(x, b)
        ctx.features, ctx.transpose = features, transpose
        return (f.transpose(-1, -2) if transpose else f) @ b

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g):
        x, b = ctx.saved_tensors
        with autocast_off(g.device.type):  # a backward called inside autocast: still fp32 GEMMs
            return FeatureMatmul._backward(ctx, x, b, g)

    @staticmethod
    def _backward(ctx, x, b, g):
        with torch.enable_grad():
            xd = x.detach().requires_grad_(True)
            f = ctx.features(xd)
        if ctx.transpose:  # y = f^T b: dF = b g^T, db = f g
            grad_f, grad_b = b @ g.transpose(-1, -2), f.detach() @ g
        else:  # y = f b: dF = g b^T, db = f^T g
            grad_f, grad_b = g @ b.transpose(-1, -2), f.detach().transpose(-1, -2) @ g
        (grad_x,) = torch.autograd.grad(f, xd, grad_f.sum_to_size(f.shape))
        return grad_x, grad_b.sum_to_size(b.shape), None, None


def feature_matmul(features: Callable, x: torch.Tensor, b: torch.Tensor, transpose: bool = False) -> torch.Tensor:
    """features(x) @ b, or features(x)^T @ b with ``transpose`` (:class:`FeatureMatmul`)."""
    if torch.is_grad_enabled() and (x.requires_grad or b.requires_grad):
        return FeatureMatmul.apply(x, b, features, transpose)
    f = features(x)
    return (f.transpose(-1, -2) if transpose else f) @ b


def chunk_linear(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    features: Callable,
    kernel: Callable,
    chunk: int,
    state: tuple | None = None,
    need_state: bool = False,
    doc: torch.Tensor | None = None,
):
    """(num [..., L, dv], den [..., L], state) of causal linear attention, chunked (module docstring).

    q [..., L, f], k [..., L, f], v [..., L, dv] (leading dims broadcast, e.g. q [b, g, rep, L, f]
    with k, v [b, g, 1, L, .]); ``kernel(qc, kc)`` = features(qc) @ features(kc)^T on [..., C, f]
    chunks; ``state`` = (S [..., D, dv], z [..., D]) of the keys before this call; the returned state
    (with ``need_state``) includes this call's keys. chunk >= L is the parallel (masked matrix) form.
    The denominator rides as a column of ones appended to v (den = A 1, z = phi(K)^T 1), so every
    GEMM yields numerator and denominator together; the zero padding of that column also drops the
    padded keys from the states. ``doc`` [..., L] (document ids, broadcasting against q[..., 0]): the
    sums restart at each document start (:mod:`megahash.ops.utils.documents`); ``state`` then
    belongs to document 0 and the returned state is the last token's document's."""
    if doc is not None:
        return _chunk_documents(q, k, v, features, kernel, chunk, state, need_state, doc)
    L = q.shape[-2]
    C = max(1, min(chunk, L))
    v1 = torch.cat([v, torch.ones_like(v[..., :1])], dim=-1)  # [..., L, dv + 1]
    qc, kc, vc = to_chunks(q, C), to_chunks(k, C), to_chunks(v1, C)
    n = qc.shape[-3]
    out = kernel(qc, kc).tril_() @ vc  # [..., n, C, dv + 1]
    new_state = None
    if n > 1 or state is not None or need_state:
        s_c = feature_matmul(features, kc, vc, transpose=True)  # per-chunk states [..., n, D, dv + 1]
        s1 = None if state is None else torch.cat([state[0], state[1].unsqueeze(-1)], dim=-1)
        if n > 1 or state is not None:
            s_prev = exclusive_cumsum(s_c, -3)
            if s1 is not None:
                s_prev = s_prev + s1.unsqueeze(-3)
            out = out + feature_matmul(features, qc, s_prev)
        if need_state:
            tot = s_c.sum(-3) if s1 is None else s_c.sum(-3) + s1
            new_state = (tot[..., :-1], tot[..., -1])
    return _split(out, L) + (new_state,)


def _split(out, L):
    out = out.flatten(-3, -2)
    if out.shape[-2] > L:
        out = out[..., :L, :]
    num, den = out.split([out.shape[-1] - 1, 1], dim=-1)  # one backward pass (a cat), not two slices
    return num, den.squeeze(-1)


def _chunk_documents(q, k, v, features, kernel, chunk, state, need_state, doc):
    """:func:`chunk_linear` with document resets: intra-chunk maps masked to the same document; chunk
    c' contributes its tail state (keys of doc_end(c')) to the positions of chunk c > c' with
    doc == doc_end(c') == doc_start(c), through the 0/1 matrix W (one GEMM over the chunk axis)."""
    L = q.shape[-2]
    C = max(1, min(chunk, L))
    v1 = torch.cat([v, torch.ones_like(v[..., :1])], dim=-1)
    qc, kc, vc = to_chunks(q, C), to_chunks(k, C), to_chunks(v1, C)
    docc = chunk_ids(doc, C)  # [..., n, C]
    same = same_document(docc)
    out = (kernel(qc, kc).tril_() * same.to(qc.dtype)) @ vc
    tail = (docc == docc[..., -1:]).to(vc.dtype).unsqueeze(-1)  # keys of each chunk's last document
    s_c = feature_matmul(features, kc, vc * tail, transpose=True)  # tail states [..., n, D, dv + 1]
    w = carry_matrix(docc).to(s_c.dtype)  # [..., n + 1, n]
    carried = (w @ s_c.flatten(-2)).unflatten(-1, s_c.shape[-2:])  # [..., n + 1, D, dv + 1]
    if state is not None:
        s1 = torch.cat([state[0], state[1].unsqueeze(-1)], dim=-1)
        first = torch.cat([docc[..., :, 0], docc[..., -1:, -1]], dim=-1) == 0  # chunks that begin in document 0
        carried = carried + first.to(s1.dtype)[..., None, None] * s1.unsqueeze(-3)
    gate = (docc == docc[..., :1]).to(qc.dtype).unsqueeze(-1)  # positions in their chunk's first document
    out = out + gate * feature_matmul(features, qc, carried[..., :-1, :, :])
    new_state = None
    if need_state:
        tot = carried[..., -1, :, :]  # row n: every tail of the last token's document
        new_state = (tot[..., :-1], tot[..., -1])
    return _split(out, L) + (new_state,)
