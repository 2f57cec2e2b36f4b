"""The LM head's projection and cross-entropy fused and chunked over tokens, so the [tokens x vocab]
logits (fp32 or otherwise) are never materialised whole (one TP rank).

loss_i = logsumexp_v(h_i W_v) - h_i W_{y_i} (the vocab-parallel cross-entropy at TP=1, megatron-core's
``VocabParallelCrossEntropy``, Megatron-LM eq. of [Shoeybi19] sec. 3). Forward computes the
logits of ``rows`` tokens at a time (the GEMM in autocast's dtype where autocast is on, in forward and backward
alike: :func:`gemm_dtype`; the softmax in fp32) and keeps the log-sum-exp of each token; it saves only the
hidden states (and the weight, a parameter). Backward recomputes each chunk's logits and forms
d logits = (softmax - onehot(y)) * dloss, then dh = d logits W and dW = d logits^T h, accumulated in
fp32 over chunks. Peak memory of the head: one chunk of fp32 logits (``CHUNK_ELEMENTS``) instead of
two [tokens x vocab] fp32 tensors (logits and softmax) held from forward to backward; one extra
head GEMM per step (the recompute). The same idea as Liger-Kernel's fused linear cross-entropy and
DeepSpeed's ``chunked_cross_entropy`` (which keeps the logits whole in their own dtype).

Two levers of compact models (issue 44) act here on each chunk: a logit soft-cap z = c tanh(u / c) of the
raw logits u (``model.logit_softcap``, Gemma 2 / modded-nanogpt), and a z-loss z_coef * lse^2 added to each
token's loss (``train.z_loss``, PaLM [Chowdhery22] sec. 5). Their backward: d loss / d z = softmax (1 + 2 z_coef
lse) - onehot(y), times d z / d u = 1 - (z / c)^2.
"""

from __future__ import annotations

import torch

from megahash.models import cpu_linear

CHUNK_ELEMENTS = 1 << 26  # fp32 logits per chunk: 256 MiB (1,334 tokens at a 50,304-token vocabulary)


def chunk_rows(vocab: int) -> int:
    return max(1, CHUNK_ELEMENTS // max(1, vocab))


def _mm_t(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [n, k] @ b [m, k]^T (oneDNN on CPU in fp32 where ``cpu_linear`` uses it)."""
    if cpu_linear.usable(a, b):
        return cpu_linear._onednn_gemm(a, b)
    return a @ b.t()


def gemm_dtype(hidden: torch.Tensor) -> torch.dtype:
    """The dtype of the head's GEMMs, forward and backward alike: autocast's where it is on for the hidden
    states' device and would cast them (not fp64), else theirs. Autocast reaches a custom Function's forward
    but not its backward: for fp32 hidden states under bf16 autocast (not the model's: its final norm hands
    bf16) the backward's three GEMMs (logits recomputed, dh, dW) ran in fp32, and the recomputed logits were
    not the forward's, whose log-sum-exp they were normalised by."""
    dev = hidden.device.type
    if hidden.dtype != torch.float64 and torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return hidden.dtype


class LinearCrossEntropy(torch.autograd.Function):
    """hidden [N, h], weight [V, h], target [N] (ids in [0, V)), soft-cap, z-loss coefficient -> per-token loss
    [N] (fp32; fp64 for fp64)."""

    @staticmethod
    def forward(ctx, hidden, weight, target, rows, cap=0.0, z_coef=0.0):
        acc = torch.promote_types(hidden.dtype, torch.float32)
        dt = gemm_dtype(hidden)
        h, w = hidden.to(dt), weight.to(dt)
        n = h.shape[0]
        lse = torch.empty(n, dtype=acc, device=hidden.device)
        picked = torch.empty(n, dtype=acc, device=hidden.device)
        for s in range(0, n, rows):
            e = min(n, s + rows)
            logits = _capped(_mm_t(h[s:e], w).to(acc), cap)[0]
            torch.logsumexp(logits, dim=-1, out=lse[s:e])
            torch.gather(logits, 1, target[s:e, None], out=picked[s:e, None])
        ctx.save_for_backward(h, weight, target, lse)  # h in the GEMMs' dtype: half the bytes under bf16
        ctx.rows, ctx.cap, ctx.z_coef, ctx.hidden_dtype = rows, cap, z_coef, hidden.dtype
        return lse - picked + z_coef * lse.square() if z_coef else lse - picked

    @staticmethod
    def backward(ctx, grad):
        hidden, weight, target, lse = ctx.saved_tensors  # hidden in the forward GEMMs' dtype
        w = weight.to(hidden.dtype)
        n, rows = hidden.shape[0], ctx.rows
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dh = torch.empty_like(hidden) if need_h else None
        dw = None
        grad = grad.to(lse.dtype)
        minus_one = torch.full((min(n, rows), 1), -1.0, dtype=lse.dtype, device=hidden.device)
        for s in range(0, n, rows):
            e = min(n, s + rows)
            h = hidden[s:e]
            logits, t = _capped(_mm_t(h, w).to(lse.dtype), ctx.cap)
            p = logits.sub_(lse[s:e, None]).exp_()  # softmax of the chunk
            if ctx.z_coef:
                p.mul_(1 + 2 * ctx.z_coef * lse[s:e, None])
            p.scatter_add_(1, target[s:e, None], minus_one[: e - s])  # - onehot(y)
            p = p.mul_(grad[s:e, None])
            if t is not None:
                p.mul_(1 - t.square_())
            p = p.to(hidden.dtype)
            if need_h:
                torch.mm(p, w, out=dh[s:e])
            if need_w:
                part = p.t() @ h
                dw = part.to(lse.dtype) if dw is None else dw.add_(part)
        if need_w:
            dw = dw.to(weight.dtype)
        if need_h:
            dh = dh.to(ctx.hidden_dtype)
        return dh, dw, None, None, None, None


def _capped(raw: torch.Tensor, cap: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(c tanh(raw / c), tanh(raw / c)) for a soft-cap c; (raw, None) without one."""
    if not cap:
        return raw, None
    t = torch.tanh(raw / cap)
    return t * cap, t


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    rows: int | None = None,
    cap: float = 0.0,
    z_coef: float = 0.0,
) -> torch.Tensor:
    """Per-token cross-entropy of ``hidden @ weight^T`` [..., V] against ``target`` [...] (-> [...], fp32), the
    logits soft-capped at ``cap`` and ``z_coef`` lse^2 added (0: off; module docstring)."""
    shape = target.shape
    loss = LinearCrossEntropy.apply(
        hidden.reshape(-1, hidden.shape[-1]),
        weight,
        target.reshape(-1),
        rows or chunk_rows(weight.shape[0]),
        float(cap),
        float(z_coef),
    )
    return loss.view(shape)
