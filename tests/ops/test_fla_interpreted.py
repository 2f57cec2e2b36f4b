"""flash-linear-attention's kernel that megahash calls on GPUs (``fla.ops.based.parallel_based``, through
:func:`megahash.ops.taylor.fla_based.based_attention`: the ``approx`` kind's training path on CUDA with
``feature_dim=16``) run on CPU under Triton's interpreter (``TRITON_INTERPRET=1``), forward and backward,
equal to megahash's plain-torch chunked form (:func:`megahash.ops.taylor.chunk.taylor_causal`, what every
other device runs) at small sizes.

Needs the ``[gpu]`` extra (triton, fla-core); the CPU environment of ``launch/install_cpu.sh`` has neither,
so the suite skips this file and ``.ci/run`` installs the extra apart (``--target``, pinned by
constraints/cpu-lock.txt) and runs it, timed. Triton reads ``TRITON_INTERPRET`` when fla's kernels are
decorated, at fla's import: set here before anything imports it."""

from __future__ import annotations

import os
import sys

import pytest
import torch

if "triton" not in sys.modules:  # an already-imported Triton (a GPU run of the suite) keeps its compiled kernels
    os.environ.setdefault("TRITON_INTERPRET", "1")

from test_ops import grads, qkv

from megahash.ops.taylor.chunk import taylor_causal
from megahash.ops.taylor.fla_based import FLA_FEATURES, based_attention, based_kernel

pytestmark = pytest.mark.numerics

KERNEL = based_kernel()
if KERNEL is None and os.environ.get("MEGAHASH_REQUIRE_FLA") == "1":  # .ci/run's step: a skip would hide a break
    raise ImportError("fla.ops.based does not import (MEGAHASH_REQUIRE_FLA=1): " + repr(__import__("fla.ops.based")))
needs_fla = pytest.mark.skipif(
    KERNEL is None or os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs triton + flash-linear-attention under TRITON_INTERPRET=1 (the [gpu] extra; .ci/run installs it "
    "apart and runs this file)",
)


@needs_fla
@pytest.mark.parametrize("L", [64, 50])
def test_fla_based_equals_the_chunked_form_forward_and_backward(L):
    """Grouped heads (2 groups x 3 queries per key/value head), 16 features, dv 32, fp32: fla's interpreted
    kernel = the chunked form (chunk 16: several chunks; L = 50 leaves a partial block) within 1e-4 of the
    scale (fp32 sums of a few hundred terms; fla adds 1e-6 to the denominator, >= 1/2 per key)."""
    q, k, v = qkv(L, d=FLA_FEATURES, dv=32, seed=3, dtype=torch.float32)
    q, k = q * 0.5, k * 0.5  # scores of a trained layer's size: the Taylor kernel's square term stays moderate
    want = taylor_causal(q, k, v, 16)[0]
    got = based_attention(KERNEL, q, k, v)
    assert got.shape == want.shape and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4 * want.abs().max().item())
    for a, b, name in zip(
        grads(lambda *t: based_attention(KERNEL, *t), q, k, v),
        grads(lambda *t: taylor_causal(*t, 16)[0], q, k, v),
        "qkv",
    ):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-4 * b.abs().max().item(), msg=f"d{name}")
