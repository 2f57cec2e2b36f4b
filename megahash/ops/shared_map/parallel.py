"""Parallel form of the batch-shared softmax map (the fixed-Q/K kinds, [Xue25] eq. 4.9-4.12): one
causal map for a whole batch, computed once and applied to the values of every sequence laid side
by side (V [g, T, b*d]), with a flash-style backward ([Dao22], alg. 2 without tiling) that
recomputes the map from Q, K and the rows' log-sum-exp: nothing of size L x T is kept for
backward, only O(L d + T b d).

    P = softmax(Q K^T * scale) (causal: key t visible to query i iff t <= i + T - L),  O = P V
    dV = P^T dO,  dP = dO V^T,  dS = P (dP - rowsum(dO * O)),  dQ = dS K scale,  dK = dS^T Q scale

Precision (as flash attention's kernels): autocast is disabled inside; the scores S = Q K^T and dP
are formed in float32 (float64 kept) from the inputs upcast, so bf16 inputs are never rounded to
bf16 scores; the softmax, its log-sum-exp and dS are float32; P (and P^T for dV) is cast to the
values' dtype for the products with V and dO, which accumulate in float32 inside the GEMM; dQ, dK
are float32 products cast back. The output has the values' dtype. Query heads share their group's
key (q [g, rep, L, d], k [g, 1, T, d]).

Encoders (``key_mask``): padding is masked BEFORE the exponentials: each sequence's map is the
softmax over its own valid keys (row maximum over those keys only), so no score gap between a
padded and a valid key can underflow the valid ones (the former folded form P (m v) / P m gave
0/0 = NaN from a gap of ~104 in fp32); a row with no valid key gives 0. These maps are per
sequence ([b, g, rep, L, T] while the forward or backward runs, as standard attention's), still none is kept for
backward. A batch of one sequence without padding (the fixed sequence's own pass, or batch 1)
needs no folding: it is plain attention through torch's SDPA (flash kernels on CPU and GPU, their
accuracy), which keeps no map either."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megahash.ops.shared_map.naive import naive_shared_softmax, scores
from megahash.ops.utils.fp32 import no_autocast


class SharedMapAttention(torch.autograd.Function):
    """q [g, rep, L, d], k [g, 1, T, d], v [g, 1, T, e] (one map), or v [b, g, 1, T, e] with
    ``key_mask`` [b, T] (one map per sequence) -> [(b,) g, rep, L, e] in v's dtype."""

    @staticmethod
    def forward(ctx, q, k, v, scale: float, causal: bool, key_mask=None):
        with no_autocast(q):
            s = scores(q, k, scale, causal, key_mask)
            lse = torch.logsumexp(s, -1, keepdim=True)
            lse = lse.masked_fill(torch.isneginf(lse), 0.0)  # no valid key: P = 0, output 0
            out = s.sub_(lse).exp_().to(v.dtype) @ v
        ctx.save_for_backward(q, k, v, out, lse, key_mask)
        ctx.scale, ctx.causal = scale, causal
        return out

    @staticmethod
    def backward(ctx, d_out):
        q, k, v, out, lse, key_mask = ctx.saved_tensors
        with no_autocast(q):
            p = scores(q, k, ctx.scale, ctx.causal, key_mask).sub_(lse).exp_()
            dv = (p.to(v.dtype).transpose(-1, -2) @ d_out.to(v.dtype)).sum(-3, keepdim=True)
            dt = p.dtype
            dp = d_out.to(dt) @ v.to(dt).transpose(-1, -2)
            ds = p.mul_(dp.sub_((d_out.to(dt) * out.to(dt)).sum(-1, keepdim=True))).mul_(ctx.scale)
            if key_mask is not None:  # Q, K are shared by the batch
                ds = ds.sum(0)
            dq = (ds @ k.to(dt)).to(q.dtype)
            dk = (ds.transpose(-1, -2) @ q.to(dt)).sum(1, keepdim=True).to(k.dtype)
        return dq, dk, dv, None, None, None


def _sdpa(q, k, v, scale: float, causal: bool):
    """q [g, rep, L, d], k [g, T, d], v [g, T, e] -> [g, rep, L, e] through torch's SDPA (which keeps no map)."""
    g, rep, L, d = q.shape
    T = k.shape[1]
    kk = k.unsqueeze(1).expand(g, rep, T, d).reshape(1, g * rep, T, d)
    vv = v.unsqueeze(1).expand(g, rep, T, v.shape[-1]).reshape(1, g * rep, T, v.shape[-1])
    mask = None
    if causal and L != T:
        mask = torch.ones(L, T, dtype=torch.bool, device=q.device).tril(T - L)
    out = F.scaled_dot_product_attention(
        q.reshape(1, g * rep, L, d), kk, vv, attn_mask=mask, is_causal=causal and L == T, scale=scale
    )
    return out.reshape(g, rep, L, -1)


def shared_softmax(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    causal: bool = True,
    key_mask: torch.Tensor | None = None,
    dropout=None,
) -> torch.Tensor:
    """q [g, rep, L, d], k [g, T, d] (the batch-shared queries/keys), v [b, g, T, e] -> [b, g, rep, L, e].

    ``key_mask`` [b, T] (True = valid, encoders): each sequence's softmax over its valid keys, masked
    before the exponentials. ``dropout`` (a function on the map, training with attention dropout)
    takes the naive form (:func:`megahash.ops.shared_map.naive.naive_shared_softmax`), which keeps the map."""
    b, g, T, _ = v.shape
    if b == 1 and key_mask is None and dropout is None:  # one sequence (the fixed pass itself, batch 1):
        return _sdpa(q, k, v[0], scale, causal).unsqueeze(0)  # plain attention, flash kernels where they exist
    if key_mask is not None:  # one map per sequence: [b, g, 1, T, e] -> [b, g, rep, L, e]
        key_mask = key_mask.bool()
        vb = v.unsqueeze(2)
        if dropout is not None:
            return naive_shared_softmax(q, k.unsqueeze(1), vb, scale, causal, dropout, key_mask)
        return SharedMapAttention.apply(q, k.unsqueeze(1), vb, scale, causal, key_mask)
    folded = v.permute(1, 2, 0, 3).reshape(g, 1, T, -1)  # [g, 1, T, b*e]
    if dropout is not None:
        out = naive_shared_softmax(q, k.unsqueeze(1), folded, scale, causal, dropout)
    else:
        out = SharedMapAttention.apply(q, k.unsqueeze(1), folded, scale, causal)
    return out.reshape(g, q.shape[1], q.shape[2], b, -1).permute(3, 0, 1, 2, 4)  # [b, g, rep, L, e]
