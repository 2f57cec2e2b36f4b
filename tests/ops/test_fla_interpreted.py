"""flash-linear-attention's kernels that megahash calls on GPUs run on CPU under Triton's interpreter
(``TRITON_INTERPRET=1``), forward and backward, equal to megahash's plain-torch chunked forms (what every other
device runs) at small sizes:

* ``fla.ops.based.parallel_based`` (through :func:`megahash.ops.taylor.fla_based.based_attention`: the ``approx``
  kind's training path on CUDA with ``feature_dim=16``) against :func:`megahash.ops.taylor.chunk.taylor_causal`;
* ``fla.ops.gated_delta_rule.chunk_gated_delta_rule`` (through
  :func:`megahash.ops.gated_delta.fla_gated.fla_gated_delta_rule`: the gated delta rule on CUDA, packed documents
  as fla's ``cu_seqlens``) against :func:`megahash.ops.gated_delta.chunk.chunk_gated_delta`. Two shims let fla
  0.6's kernels run under the interpreter, for this test only: its autotuned kernels take their first config
  (the interpreter has no benchmarker; every config computes the same values), and the chunk loop of
  ``fla.ops.common.chunk_delta_h`` gets loop indices that have the compiled kernel's ``.to(dtype)`` (the
  interpreter hands a Python int).

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

from numerics import ulp_tol
from test_ops import grads, qkv

from conftest import ROOT
from megahash.ops.gated_delta.chunk import chunk_gated_delta, l2norm
from megahash.ops.gated_delta.fla_gated import fla_gated_delta_rule, gated_delta_kernel
from megahash.ops.taylor.chunk import taylor_causal
from megahash.ops.taylor.fla_based import FLA_FEATURES, based_attention, based_kernel

pytestmark = pytest.mark.numerics

KERNEL = based_kernel()
GATED = gated_delta_kernel()
if (KERNEL is None or GATED is None) and os.environ.get("MEGAHASH_REQUIRE_FLA") == "1":  # .ci/run: a skip would
    # hide a break
    raise ImportError(
        "fla.ops.based / fla.ops.gated_delta_rule do not import (MEGAHASH_REQUIRE_FLA=1): "
        + repr([__import__("fla.ops.based"), __import__("fla.ops.gated_delta_rule")])
    )
needs_fla = pytest.mark.skipif(
    KERNEL is None or GATED is None or os.environ.get("TRITON_INTERPRET") != "1",
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


@pytest.fixture
def loop_indices(monkeypatch):
    """The second interpreter shim of the module docstring: loop indices with ``.to(dtype)`` (undone after)."""
    import builtins

    class Index(int):
        def to(self, dtype, **_):
            return int(self)

    chunk_delta_h = __import__("fla.ops.common.chunk_delta_h", fromlist=["range"])
    monkeypatch.setattr(chunk_delta_h, "range", lambda *a: map(Index, builtins.range(*a)), raising=False)


@pytest.fixture
def interpretable(monkeypatch, loop_indices):
    """The two interpreter shims of the module docstring (undone after the test)."""
    import triton.runtime.autotuner as autotuner

    prune = autotuner.Autotuner.prune_configs
    monkeypatch.setattr(autotuner.Autotuner, "prune_configs", lambda self, *a, **k: prune(self, *a, **k)[:1])


@needs_fla
@pytest.mark.usefixtures("interpretable")
@pytest.mark.parametrize("packed", [False, True], ids=["state", "documents"])
def test_fla_gated_delta_rule_equals_the_chunked_form_forward_and_backward(packed):
    """2 rows x 2 heads, d_k = d_v = 16, fp32, L = 100 (two of fla's 64-token chunks, the second partial):
    with an initial and a final state, or with packed documents (fla's cu_seqlens, one starting inside a
    chunk), fla's interpreted kernel = the chunked form within 1,000 fp32 roundings of the scale (see ``tol``),
    outputs, state and the gradients of q, k, v, g, beta."""
    _gated_delta_equals_the_chunked_form(packed)


@needs_fla
@pytest.mark.usefixtures("loop_indices")
def test_gpu_check_fla_configs_replace_autotuning(tmp_path, monkeypatch):
    """benchmarks/gpu_check.py's ``write_fla_configs`` under fla's own switch (``FLA_CACHE_MODE=default``,
    ``FLA_CONFIG_DIR``, read by ``fla.ops.utils.cache`` at each call): every autotuned kernel of
    ``chunk_gated_delta_rule`` takes its one written config, so none is pruned or benchmarked (the GPU check's
    gated-delta tests compile 9 kernels, not 52 configs), and forward and backward, with a state and with packed
    documents, still equal the chunked form."""
    import importlib.util

    import triton.runtime.autotuner as autotuner
    from fla.ops.utils import cache

    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu_check.py")
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    written = gpu_check.write_fla_configs(tmp_path)
    monkeypatch.setattr(cache, "FLA_CACHE_MODE", cache.FlaCacheMode.DEFAULT)
    monkeypatch.setenv("FLA_CONFIG_DIR", str(tmp_path))
    for tuner in gpu_check.fla_autotuners().values():
        monkeypatch.setattr(tuner, "cache", {})  # forget what the tests before chose
    pruned, ran = [], []
    prune, run = autotuner.Autotuner.prune_configs, cache.CachedAutotuner.run
    monkeypatch.setattr(
        autotuner.Autotuner, "prune_configs", lambda self, *a, **k: pruned.append(self) or prune(self, *a, **k)
    )
    monkeypatch.setattr(
        cache.CachedAutotuner, "run", lambda self, *a, **k: ran.append(self.kernel_name) or run(self, *a, **k)
    )
    for packed in (False, True):
        _gated_delta_equals_the_chunked_form(packed)
    assert len(set(ran)) == 9 and set(ran) <= set(written), sorted(set(ran))
    assert not pruned, [getattr(t, "kernel_name", t) for t in pruned]


def _gated_delta_equals_the_chunked_form(packed: bool) -> None:
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(2, 2, 100, 16, generator=g) for _ in range(3))
    q, k = l2norm(q) * 16**-0.5, l2norm(k)  # what gated_delta_causal hands either form
    decay, beta = -torch.rand(2, 2, 100, generator=g), torch.rand(2, 2, 100, generator=g)
    h0 = None if packed else torch.randn(2, 2, 16, 16, generator=g)
    doc = torch.tensor([[0] * 40 + [1] * 30 + [2] * 30, [0] * 90 + [1] * 10])[:, None, :] if packed else None

    def fla(*t):
        return fla_gated_delta_rule(GATED, *t, state=h0, need_state=not packed, doc=doc)

    def ours(*t):
        return chunk_gated_delta(*t, 64, state=h0, need_state=not packed, doc=doc)

    def tol(want):
        """fp32 sums of ~100 terms through each chunk's 64 x 64 unit-triangular inverse (fla's WY form, a forward
        substitution that multiplies the roundings by up to the matrix's condition, ~10 here): 1,000 roundings of
        the scale (1.2e-4 of it). A fixed 1e-5 of the scale failed once in a fresh-clone .ci/run (1.36e-5 abs at scale 0.39),
        passing elsewhere; a wrong decay, gate or state is off by O(1) of the scale."""
        return ulp_tol(torch.float32, ops=1000, scale=want.abs().max().item()) | {"rtol": 0}

    (got, got_state), (want, want_state) = fla(q, k, v, decay, beta), ours(q, k, v, decay, beta)
    assert got.shape == want.shape and got.dtype == torch.float32
    torch.testing.assert_close(got, want, **tol(want))
    if not packed:
        torch.testing.assert_close(got_state, want_state, **tol(want_state))
    inputs = (q, k, v, decay, beta)
    for a, b, name in zip(grads(lambda *t: fla(*t)[0], *inputs), grads(lambda *t: ours(*t)[0], *inputs), "qkvgb"):
        torch.testing.assert_close(a, b, **tol(b), msg=f"d{name}")


@needs_fla
@pytest.mark.parametrize(
    "flags, refused",
    [
        ((True, True, False), True),
        ((True, True, True), False),
        ((True, False, False), False),
        ((False, True, False), False),
    ],
    ids=["hopper-triton-3.6", "hopper-triton-3.7.1", "hopper-triton-3.3", "not-hopper"],
)
def test_backward_refusal_agrees_with_fla(monkeypatch, flags, refused):
    """fla 0.6 raises in the gated delta rule's backward (``chunk_bwd_dqkwg`` with a gate) on Hopper under
    Triton >= 3.4.0 and < 3.7.1 (fla #640; the H200 of 2026-11-30, Triton 3.6.0, met it). megahash's
    ``backward_refusal`` reads the same flags of fla's module and says so exactly when fla's own function raises,
    so training takes megahash's chunked form there instead of crashing in its first backward."""
    import fla.ops.common.chunk_o as chunk_o

    from megahash.ops.gated_delta import fla_gated

    for name, value in zip(("IS_NVIDIA_HOPPER", "TRITON_ABOVE_3_4_0", "TRITON_ABOVE_3_7_1"), flags):
        monkeypatch.setattr(chunk_o, name, value)
    fla_gated.backward_refusal.cache_clear()
    try:
        said = fla_gated.backward_refusal()
    finally:
        fla_gated.backward_refusal.cache_clear()
    t = torch.zeros(1, 64, 1, 16)
    try:
        chunk_o.chunk_bwd_dqkwg(t, t, t, t, torch.zeros(1, 1, 1, 16, 16), torch.zeros(1, 1, 1, 16, 16),
                                g=torch.zeros(1, 64, 1))  # fmt: skip
        raised = None
    except RuntimeError as e:
        raised = str(e)
    except Exception:  # past the refusal, into the kernel (these are no real inputs): fla did not refuse
        raised = None
    assert (raised is not None and "3.7.1" in raised) == refused
    assert (said is not None) == refused, said
    if refused:
        assert "#640" in said and "chunked form" in said
