"""Optional GPU dispatch to flash-linear-attention's Based kernel (``fla.ops.based.parallel_based``,
feature dimension 16, Taylor kernel 1 + s + s^2/2 with s = q.k/sqrt(16), normalised): used for
causal training/prefill on CUDA tensors when ``fla`` is installed; megahash's own chunked form
otherwise (always on CPU). Its denominator carries fla's +1e-6 (relative 1e-6 at worst: the kernel
sum is >= 1/2 per key)."""

from __future__ import annotations

import torch

FLA_FEATURES = 16


def based_kernel():
    """``fla.ops.based.parallel_based`` or None (fla not installed)."""
    try:  # by name: the exported remote code must not list fla among its imports (optional extra)
        return __import__("fla.ops.based", fromlist=["parallel_based"]).parallel_based
    except Exception:  # not installed, or a Triton that cannot build on this machine
        return None


def fla_taylor(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor | None:
    """q [b, g, rep, L, 16], k/v [b, g, 1, L, .] on CUDA -> [b, g, rep, L, dv], or None where fla cannot run it."""
    if not q.is_cuda or q.shape[-1] != FLA_FEATURES:
        return None
    kernel = based_kernel()
    if kernel is None:
        return None
    return based_attention(kernel, q, k, v)


def based_attention(kernel, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """megahash's grouped layout through fla's kernel on any device (CPU tensors run it under Triton's
    interpreter, ``TRITON_INTERPRET=1``: tests/ops/test_fla_interpreted.py): q [b, g, rep, L, 16],
    k/v [b, g, 1, L, .] -> [b, g, rep, L, dv] in v's dtype."""
    b, g, rep, L, f = q.shape

    def bthk(t):  # [b, g, rep, L, x] -> fla's [b, L, g * rep, x]
        return t.expand(b, g, rep, L, t.shape[-1]).reshape(b, g * rep, L, t.shape[-1]).transpose(1, 2)

    out = kernel(bthk(q), bthk(k), bthk(v), use_norm=True)
    out = out[0] if isinstance(out, tuple) else out
    return out.transpose(1, 2).reshape(b, g, rep, L, v.shape[-1]).to(v.dtype)
