"""One causal softmax map for a whole batch (the fixed-Q/K kinds, [Xue25] eq. 4.9-4.12), computed once
and applied to the values of every sequence laid side by side (V [g, T, b*d]), with a flash-style
backward ([Dao22], alg. 2 without tiling) that recomputes the map from Q, K and the rows'
log-sum-exp: nothing of size L x T is kept for backward, only O(L d + T b d).

    P = softmax(Q K^T * scale) (causal: key t visible to query i iff t <= i + T - L),  O = P V
    dV = P^T dO,  dP = dO V^T,  dS = P (dP - rowsum(dO * O)),  dQ = dS K scale,  dK = dS^T Q scale

The map is formed in float32 at least; P V runs in the values' dtype. Query heads share their
group's key (q [g, rep, L, d], k [g, 1, T, d]). A batch of one sequence (the fixed sequence's own
pass, or batch 1) needs no folding: it is plain attention through torch's SDPA (flash kernels on
CPU and GPU), which keeps no map either."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from megahash.ops.shared_map.naive import naive_shared_softmax


def _scores(q, k, scale: float, causal: bool):
    s = (q @ k.transpose(-1, -2)).to(torch.promote_types(q.dtype, torch.float32)).mul_(scale)
    if causal:
        L, T = s.shape[-2], s.shape[-1]
        s = s.masked_fill_(torch.ones(L, T, dtype=torch.bool, device=s.device).triu(T - L + 1), float("-inf"))
    return s


class SharedMapAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, scale: float, causal: bool):
        s = _scores(q, k, scale, causal)
        lse = torch.logsumexp(s, -1, keepdim=True)
        p = s.sub_(lse).exp_().to(v.dtype)
        out = p @ v
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.scale, ctx.causal = scale, causal
        return out

    @staticmethod
    def backward(ctx, d_out):
        q, k, v, out, lse = ctx.saved_tensors
        p = _scores(q, k, ctx.scale, ctx.causal).sub_(lse).exp_()
        dv = (p.to(v.dtype).transpose(-1, -2) @ d_out).sum(1, keepdim=True)
        dp = (d_out @ v.transpose(-1, -2)).to(p.dtype)
        ds = p.mul_(dp.sub_((d_out * out).sum(-1, keepdim=True).to(p.dtype))).mul_(ctx.scale).to(q.dtype)
        dq = ds @ k
        dk = (ds.transpose(-1, -2) @ q).sum(1, keepdim=True)
        return dq, dk, dv, None, None


def _sdpa(q, k, v, scale: float, causal: bool):
    """q [g, rep, L, d], k [g, T, d], v [g, T, e] -> [g, rep, L, e] through torch's SDPA (which keeps no map)."""
    g, rep, L, d = q.shape
    T = k.shape[1]
    kk = k.unsqueeze(1).expand(g, rep, T, d).reshape(1, g * rep, T, d)
    vv = v.unsqueeze(1).expand(g, rep, T, v.shape[-1]).reshape(1, g * rep, T, v.shape[-1])
    mask = None
    if causal and L != T:
        mask = torch.ones(L, T, dtype=torch.bool, device=q.device).tril(T - L)
    out = F.scaled_dot_product_attention(q.reshape(1, g * rep, L, d), kk, vv, attn_mask=mask,
                                         is_causal=causal and L == T, scale=scale)
    return out.reshape(g, rep, L, -1)


def shared_softmax(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool = True,
                   key_mask: Optional[torch.Tensor] = None, dropout=None) -> torch.Tensor:
    """q [g, rep, L, d], k [g, T, d] (the batch-shared queries/keys), v [b, g, T, e] -> [b, g, rep, L, e].

    ``key_mask`` [b, T] (True = valid, encoders): each sequence's values and its mask column share the
    map (o = P (m v) / P m). ``dropout`` (a function on the map, training with attention dropout)
    takes the naive form (:func:`megahash.ops.shared_map.naive.naive_shared_softmax`), which keeps the map."""
    b, g, T, e = v.shape
    if b == 1 and key_mask is None and dropout is None:  # one sequence (the fixed pass itself, batch 1):
        return _sdpa(q, k, v[0], scale, causal).unsqueeze(0)  # plain attention, flash kernels where they exist
    if key_mask is not None:
        m = key_mask.to(v.dtype)[:, None, :, None].expand(b, g, T, 1)
        v = torch.cat([v * m, m], -1)
    folded = v.permute(1, 2, 0, 3).reshape(g, 1, T, -1)  # [g, 1, T, b*e']
    if dropout is not None:
        out = naive_shared_softmax(q, k.unsqueeze(1), folded, scale, causal, dropout)
    else:
        out = SharedMapAttention.apply(q, k.unsqueeze(1), folded, scale, causal)
    out = out.reshape(g, q.shape[1], q.shape[2], b, -1).permute(3, 0, 1, 2, 4)  # [b, g, rep, L, e']
    if key_mask is not None:
        out = out[..., :e] / out[..., e:]
    return out
