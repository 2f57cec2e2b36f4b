"""Chunked form of the gated delta rule ([Yang25b], in the WY/UT representation of [Yang24c]):
training, prefill, and decoding with the carried state.

State S [d_k, d_v] per head, log decay g_t <= 0 (a_t = e^{g_t}), beta_t in (0, 1), q scaled by 1/sqrt(d_k):

    S_t = a_t (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T,     o_t = S_t^T q_t.

The sequence is cut into chunks of C tokens (zero-padded at the end: a padded token has beta = 0 and
g = 0, so it changes nothing). Inside a chunk, with G_i = g_1 + ... + g_i and the state S_0 before it,
the pseudo-values u_i = beta_i (v_i - k_i^T e^{g_i} S_{i-1}) solve a unit lower-triangular system (the
UT transform),

    T u = beta v - diag(beta e^G) K S_0,   T = I + strict_tril(beta_i (k_i . k_j) e^{G_i - G_j}),

so u = U - W S_0 with U = T^{-1} (beta v), W = T^{-1} (beta e^G k): ONE batched triangular solve for all
chunks, no loop over tokens. Then

    o_i = e^{G_i} q_i^T S_0 + sum_{j<=i} e^{G_i - G_j} (q_i . k_j) u_j,
    S_C = e^{G_C} S_0 + K~^T u,   K~_j = e^{G_C - G_j} k_j,

the intra-chunk products batched over all chunks as well. Only S_0 of each chunk needs the chunks before
it: the states are carried by a Python loop over the chunks, three batched GEMM-sized operator calls a
chunk (u = U - W S_0; S <- e^{G_C} S + K~^T u), since the chunk transitions e^{G_C} I - K~^T W are matrices
that do not commute and no ATen operator scans their products. The operator count therefore grows by a
constant per chunk (never per token); fla's Triton kernel runs the same loop inside one kernel
(:mod:`megahash.ops.gated_delta.fla_gated`). Every exponent is a difference G_i - G_j <= 0 (masked before
the exponential), so nothing overflows.

Packed documents (``doc``, nondecreasing ids): a key reaches a query only inside its document, so the
decays e^{G_i - G_j} are masked to the same document, a position sees the state before its chunk only
when its document continues from the chunk before (the state passed in belongs to document 0), and a
chunk's state carries on only while its last document continues it; no loop over documents
(docs/attention.md "Packed documents: linear and recurrent kinds").
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megahash.ops.gated_delta.fla_gated import fla_gated_delta
from megahash.ops.utils.documents import chunk_ids, same_document
from megahash.ops.utils.fp32 import fp32_kernel

CHUNK = 64  # the default chunk (fla's; its kernel takes 16, 32 or 64)
L2_EPS = 1e-6  # fla's l2norm: x / sqrt(sum x^2 + eps)


def l2norm(x: torch.Tensor, eps: float = L2_EPS) -> torch.Tensor:
    """x / sqrt(|x|^2 + eps) over the last dimension (fla's ``l2norm``)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def gated_delta_chunk(length: int, chunk: int = 0) -> int:
    """The chunk size: ``chunk`` if > 0, else 64; at most ``length``."""
    return max(1, min(chunk if chunk > 0 else CHUNK, length))


@fp32_kernel
def gated_delta_causal(
    q,
    k,
    v,
    g,
    beta,
    chunk: int = 0,
    state=None,
    need_state: bool = False,
    doc=None,
    qk_l2norm: bool = False,
    scale: float | None = None,
):
    """The gated delta rule: q, k [..., L, d_k], v [..., L, d_v], g (log decay) and beta [..., L] (leading
    dims broadcast, e.g. [b, heads]); ``state`` S [..., d_k, d_v] before this call; ``doc`` [..., L]
    document ids (the state restarts at each document start); ``qk_l2norm``: q and k L2-normalised first
    (fla's ``use_qk_l2norm_in_kernel``). q is scaled by ``scale`` (default d_k^{-1/2}, fla's). Returns (out [..., L, d_v] in q's dtype,
    accumulated in fp32 under autocast (:func:`megahash.ops.utils.fp32.fp32_kernel`), the state after the
    call or None). On CUDA with flash-linear-attention installed fla's ``chunk_gated_delta_rule`` runs it
    (packed documents through its ``cu_seqlens`` when no state is carried); the chunked form otherwise."""
    if qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    q = q * (q.shape[-1] ** -0.5 if scale is None else scale)
    if doc is None or (state is None and not need_state):
        out = fla_gated_delta(q, k, v, g, beta, state, need_state, doc)
        if out is not None:
            return out
    return chunk_gated_delta(q, k, v, g, beta, gated_delta_chunk(q.shape[-2], chunk), state, need_state, doc)


def chunk_gated_delta(q, k, v, g, beta, chunk: int, state=None, need_state: bool = False, doc=None):
    """The chunked form (module docstring) on scaled q: (out [..., L, d_v], state or None)."""
    lead = torch.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2], g.shape[:-1], beta.shape[:-1])
    L, d_k, d_v = q.shape[-2], q.shape[-1], v.shape[-1]
    C = chunk
    n = -(-L // C)
    pad = n * C - L

    def chunks(x):  # [..., L, f] -> [*lead, n, C, f]
        return F.pad(x, (0, 0, 0, pad)).expand(*lead, n * C, x.shape[-1]).unflatten(-2, (n, C))

    qc, kc, vc = chunks(q), chunks(k), chunks(v)
    gc = F.pad(g, (0, pad)).expand(*lead, n * C).unflatten(-1, (n, C)).cumsum(-1)  # G [*lead, n, C]
    bc = F.pad(beta, (0, pad)).expand(*lead, n * C).unflatten(-1, (n, C))
    keep = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    first = last = carry = None
    if doc is not None:
        docc = chunk_ids(doc, C)  # [..., n, C] (padded with the last id)
        keep = keep & same_document(docc)
        before = torch.cat([torch.zeros_like(docc[..., :1, -1:]), docc[..., :-1, -1:]], dim=-2)  # [..., n, 1]
        first = docc == before  # positions that see the state before their chunk
        last = docc == docc[..., -1:]  # positions of the chunk's last document
        carry = before[..., 0] == docc[..., -1]  # the chunk's state carries the state before it
    decay = (gc.unsqueeze(-1) - gc.unsqueeze(-2)).masked_fill(~keep, float("-inf")).exp()  # e^{G_i - G_j}, j <= i
    kb = kc * bc.unsqueeze(-1)
    head = gc.exp() if first is None else gc.exp() * first  # e^{G_i}: reach of the state before the chunk
    rhs = torch.cat([vc * bc.unsqueeze(-1), kb * head.unsqueeze(-1)], dim=-1)
    # T's strict lower triangle; its diagonal is not read (unitriangular) and gets no gradient
    uw = torch.linalg.solve_triangular((kb @ kc.transpose(-1, -2)) * decay, rhs, upper=False, unitriangular=True)
    u, w = uw.split([d_v, d_k], dim=-1)
    scores = (qc @ kc.transpose(-1, -2)) * decay  # [*lead, n, C, C]
    if n == 1 and state is None and not need_state:  # one chunk, nothing carried: the parallel form
        return (scores @ u).flatten(-3, -2)[..., :L, :], None
    tail = (gc[..., -1:] - gc).exp() if last is None else (gc[..., -1:] - gc).exp() * last  # e^{G_C - G_j}
    gate = gc[..., -1].exp() if carry is None else gc[..., -1].exp() * carry  # e^{G_C}
    starts, new_u, state = _carry(u, w, (kc * tail.unsqueeze(-1)).transpose(-1, -2), gate, state, need_state, lead)
    out = (qc * head.unsqueeze(-1)) @ starts + scores @ new_u
    return out.flatten(-3, -2)[..., :L, :], state


def _carry(u, w, kt, gate, state, need_state, lead):
    """The loop over chunks: (the state before each chunk [*lead, n, d_k, d_v], the pseudo-values
    u - W S_0 [*lead, n, C, d_v], the state after the last chunk or None). Chunk tensors flattened to
    [n, B, ., .] so each step is one ``baddbmm``."""
    n, d_k, d_v = u.shape[-3], kt.shape[-2], u.shape[-1]

    def steps(x):
        return x.movedim(len(lead), 0).reshape(n, -1, *x.shape[len(lead) + 1 :]).unbind(0)

    us, ws, kts, gates = steps(u), steps(-w), steps(kt), steps(gate[..., None, None])
    h = None if state is None else state.expand(*lead, d_k, d_v).reshape(-1, d_k, d_v)
    starts, news = [], []
    for c in range(n):
        starts.append(h)
        new = us[c] if h is None else torch.baddbmm(us[c], ws[c], h)  # u - W S_0
        news.append(new)
        if c < n - 1 or need_state:  # S <- e^{G_C} S + K~^T u
            h = kts[c] @ new if h is None else torch.baddbmm(h * gates[c], kts[c], new)
    zero = u.new_zeros(us[0].shape[0], d_k, d_v)
    starts = torch.stack([zero if s is None else s for s in starts]).reshape(n, *lead, d_k, d_v).movedim(0, -3)
    news = torch.stack(news).reshape(n, *lead, *u.shape[-2:]).movedim(0, -3)
    return starts, news, (h.reshape(*lead, d_k, d_v) if need_state else None)
