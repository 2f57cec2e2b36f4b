"""Tolerances for comparing floating-point results that two code paths compute differently.

Two evaluations of one formula by different kernels, memory layouts, vector widths (ATen's
``ATEN_CPU_CAPABILITY`` default / avx2 / avx512: a 16-float loop tail runs scalar code, which the
compiler may contract into FMAs), thread counts or dtypes round differently; bit-equality between
them is not promised. Each rounding errs by at most u = eps/2 relative to its exact result, so two
evaluations with ``ops`` roundings each differ by at most about ops * eps relative to the size of
the terms (Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd ed., sec. 2.2 and 3.1).
Where terms cancel, that bound is absolute: ``scale`` is the size of the terms.

Bit-exact comparisons (``torch.equal``, ``np.array_equal``) are kept only where bit-equality is the
promise (integer data, copied values, resume, one deterministic path); tests/test_numerics_rules.py
asks each of them for a ``# bit-exact: <reason>`` comment.
"""

from __future__ import annotations

import os

import pytest
import torch


def ulp_tol(dtype: torch.dtype, ops: int = 1, scale: float = 1.0) -> dict:
    """``rtol``/``atol`` for ``torch.testing.assert_close`` of two evaluations of a formula of ``ops``
    roundings in ``dtype``: rtol = ops * eps, atol = ops * eps * scale (scale: magnitude of its terms)."""
    eps = torch.finfo(dtype).eps
    return {"rtol": ops * eps, "atol": ops * eps * float(scale)}


# torch 2.13's inductor cannot compile its CPU FlexAttention (and block-mask) kernels without a vector ISA: under
# ATEN_CPU_CAPABILITY=default (tests/run_numerics_capabilities.sh) they are C++ that does not compile ("'at::vec' has
# not been declared"). megahash compiles FlexAttention only for CUDA (accelerator.policy.flex_attention), so the tests
# that stand inductor's CPU FlexAttention in for CUDA's skip there (avx2 compiles and agrees).
needs_vector_isa = pytest.mark.skipif(
    os.environ.get("ATEN_CPU_CAPABILITY", "").lower() == "default",
    reason="inductor's CPU FlexAttention needs a vector ISA (torch 2.13: no code under ATEN_CPU_CAPABILITY=default)",
)
