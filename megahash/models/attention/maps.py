"""How an attention kind's maps are captured for ``megahash indicators`` (not a kind): the ``maps=`` hooks the
kinds' register lines name, one per family.

A hook ``maps(layer, record) -> handles`` attaches forward hooks to one attention layer (or to its parts) and, at
each forward, calls ``record(found)`` with what that forward attended to; it never changes the forward: it reads
what its hooks see or recomputes it from the layer's input with the kind's own methods. ``found``:

- ``source``: how A was obtained (a phrase for the report);
- ``probs`` [b | 1, heads, L, L] float64: the (equivalent) attention matrix A (b = 1: one map for the batch);
- ``logits`` [b | 1, heads, L, L] and ``valid`` [L, L] (the positions holding a logit), or ``logit_values``
  (pre-softmax values not of A's shape, e.g. one per key), or neither;
- ``causal``;
- ``check``: None, or a function returning max |A V - the layer's output| (the capture's ``verify`` mode: tests).

A kind's own formula ``map_of(layer, q, k, v, attention_mask)`` (the keys above but ``causal``) stays in its file;
:func:`kernel_maps` applies it to the q, k, v of a linear kind's kernel.
"""

from __future__ import annotations

import inspect
import math

import torch

from megahash.models.mixing import MixState


def softmax_maps(q, k, scale: float, causal: bool, mask=None):
    """q [sq, b, n, d], k [sk, b, g, d] -> (A [b, n, sq, sk], logits [b, n, sq, sk], valid [sq, sk]) in float64."""
    qh = q.permute(1, 2, 0, 3).double()
    kh = k.permute(1, 2, 0, 3).double()
    if kh.shape[1] != qh.shape[1]:
        kh = kh.repeat_interleave(qh.shape[1] // kh.shape[1], dim=1)
    logits = (qh @ kh.transpose(-1, -2)) * scale
    sq, sk = logits.shape[-2:]
    valid = torch.ones(sq, sk, dtype=torch.bool, device=logits.device)
    valid = valid.tril(sk - sq) if causal else valid
    keep = valid.expand_as(logits)
    if mask is not None:  # megatron: True = masked out, [b, 1, 1|sq, sk]
        keep = keep & ~mask.bool()
    probs = torch.softmax(logits.masked_fill(~keep, float("-inf")), dim=-1)
    return probs, logits, valid


def layer_inputs(layer, args, kwargs) -> tuple:
    """(x, attention_mask, rotary_pos_emb, state) of one call of an attention layer (megatron's contract)."""
    got = inspect.signature(layer.forward).bind_partial(*args, **kwargs).arguments
    state = got.get("inference_context")
    return got["hidden_states"], got.get("attention_mask"), got.get("rotary_pos_emb"), state or MixState()


def softmax_core_maps(layer, record) -> list:
    """Softmax kinds: A = softmax(QK^T / sqrt(d_h) + mask) of the q, k (after RoPE, GQA groups repeated) that the
    layer's softmax core receives (``layer.core_attention``: the part ``parts.core_attention`` builds, or
    megatron-core's); logits on the causal positions; checked against the core's output."""
    from megatron.core.transformer.enums import AttnMaskType

    def hook(mod, args, kwargs, output):
        names = ["query", "key", "value", "attention_mask"]
        got = dict(zip(names, args))
        got.update({k: v for k, v in kwargs.items() if k in names})
        q, k, mask = got["query"], got["key"], got.get("attention_mask")
        mtype = kwargs.get("attn_mask_type") or getattr(mod, "attn_mask_type", None)
        causal = mtype == AttnMaskType.causal and mask is None
        scale = getattr(mod, "softmax_scale", None) or 1.0 / math.sqrt(q.shape[-1])
        probs, logits, valid = softmax_maps(q, k, scale, causal, mask)

        def check():
            v = got["value"].permute(1, 2, 0, 3).double()
            v = v.repeat_interleave(probs.shape[1] // v.shape[1], dim=1)
            av = (probs @ v).permute(2, 0, 1, 3).reshape(output.shape)
            return (av - output.double()).abs().max()

        source = "softmax(QK^T/sqrt(d_h)) from core_attention"
        record({"source": source, "probs": probs, "logits": logits, "valid": valid, "causal": causal, "check": check})

    return [layer.core_attention.register_forward_hook(hook, with_kwargs=True)]


def recomputed_maps(maps_of):
    """A capture from the layer's input: after each forward, ``maps_of(layer, x, attention_mask, rotary_pos_emb,
    state, out)`` (``out``: the mixing output the layer handed ``linear_proj``) gives ``found``, or None for a
    forward it does not describe."""

    def capture(layer, record) -> list:
        seen = {}

        def before_proj(mod, args):
            seen["out"] = args[0]

        def after(mod, args, kwargs, output):
            found = maps_of(layer, *layer_inputs(mod, args, kwargs), seen.pop("out"))
            if found is not None:
                record(found)

        return [
            layer.linear_proj.register_forward_pre_hook(before_proj),
            layer.register_forward_hook(after, with_kwargs=True),
        ]

    return capture


def _identity(layer, x, attention_mask, rotary_pos_emb, state, out) -> dict:
    L = x.shape[0]
    probs = torch.eye(L, dtype=torch.float64).expand(x.shape[1], 1, L, L)
    return {"source": "identity (no token mixing)", "probs": probs, "causal": True}


def no_mixing_maps(layer, record) -> list:
    """Kinds that mix no tokens (each output reads its own token only): A = I, no logits."""
    return recomputed_maps(_identity)(layer, record)


def kernel_maps(map_of):
    """Linear kinds (a ``kernel`` on [b, g, rep, s, d], :mod:`megahash.models.attention.linear_base`): the kind's
    ``map_of(layer, q, k, v, attention_mask)`` of the q, k, v its kernel gets (the kind's ``kernel_inputs`` of the
    layer's input); its ``check`` gets the layer's mixing output in the kernel's layout [b, g, rep, s, d_v]."""

    def of_kernel(layer, x, attention_mask, rotary_pos_emb, state, out) -> dict:
        q, k, v = layer.kernel_inputs(x, rotary_pos_emb)
        found = dict(map_of(layer, q, k, v, attention_mask), causal=layer.causal)
        check = found.pop("check", None)
        if check is not None:
            b, g, rep, s, _ = q.shape
            kernel_out = out.reshape(s, b, g * rep, -1).permute(1, 2, 0, 3).reshape(b, g, rep, s, -1)
            found["check"] = lambda: check(kernel_out)
        return found

    return recomputed_maps(of_kernel)
