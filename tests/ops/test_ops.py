"""megahash.ops (issue 26): every fast kernel equals its naive oracle (fp64, several lengths and chunk
sizes, gradients too), the one-score-per-key scan is within fp32/bf16 tolerance of the exact map, the
batch-shared map keeps nothing of size L x T for backward, and every attention kind's model issues
the same number of ATen operator calls at two sequence lengths (no Python loop over the sequence).
The flash-linear-attention path runs under the ``gpu`` marker."""

from __future__ import annotations

import math
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest
import torch

from megahash.accelerator import policy, rng
from megahash.ops.cumsoftmax.chunk import cumsoftmax_causal
from megahash.ops.cumsoftmax.naive import naive_cumsoftmax
from megahash.ops.cumsoftmax.recurrent import cumsoftmax_recurrent
from megahash.ops.orders.chunk import orders_causal
from megahash.ops.orders.naive import naive_orders
from megahash.ops.orders.recurrent import orders_recurrent
from megahash.ops.shared_map.naive import naive_shared_softmax
from megahash.ops.shared_map.parallel import shared_softmax
from megahash.ops.taylor.chunk import taylor_causal
from megahash.ops.taylor.naive import naive_taylor
from megahash.ops.taylor.recurrent import taylor_recurrent
from megahash.training.op_count import CountOps

pytestmark = pytest.mark.numerics  # compares floating-point results (see tests/numerics.py)

LENGTHS = (1, 5, 16, 33)
CHUNKS = (1, 3, 8, 64)
TOL_ORDERS = 1e-6


def qkv(L, d=6, dv=5, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 2, 3, L, d, dtype=dtype, generator=g)  # [b, groups, rep, L, d]: GQA broadcast
    k = torch.randn(2, 2, 1, L, d, dtype=dtype, generator=g)
    v = torch.randn(2, 2, 1, L, dv, dtype=dtype, generator=g)
    return q, k, v


def grads(fn, *xs):
    xs = [x.detach().clone().requires_grad_(True) for x in xs]
    w = torch.randn(fn(*xs).shape, dtype=xs[0].dtype, generator=torch.Generator().manual_seed(9))
    (fn(*xs) * w).sum().backward()
    return [x.grad for x in xs]


def close(a, b, tol=1e-10):
    torch.testing.assert_close(a, b, rtol=tol, atol=tol)


@pytest.mark.parametrize("L", LENGTHS)
def test_taylor_chunked_equals_naive_and_recurrent(L):
    q, k, v = qkv(L)
    want = naive_taylor(q, k, v)
    rec, rstate = taylor_recurrent(q, k, v)
    close(rec, want)
    for chunk in CHUNKS:
        out, state = taylor_causal(q, k, v, chunk, need_state=True)
        close(out, want)
        close(state[0], rstate[0])
        close(state[1], rstate[1])
        for a, b in zip(grads(lambda *t: taylor_causal(*t, chunk)[0], q, k, v), grads(naive_taylor, q, k, v)):
            close(a, b, 1e-9)


def test_taylor_features_recomputed_in_backward():
    """Full-width (d = 48, D = 1,225) and narrow (d = 6) features: values and gradients equal the
    oracle, and no tensor saved for backward holds features (a trailing dimension of D per token)."""
    from megahash.ops.taylor.feature_map import feature_dim

    for d in (48, 6):
        q, k, v = qkv(40, d=d, dv=4)
        close(taylor_causal(q, k, v, 8)[0], naive_taylor(q, k, v))
        for a, b in zip(grads(lambda *t: taylor_causal(*t, 8)[0], q, k, v), grads(naive_taylor, q, k, v)):
            close(a, b, 1e-9)
        shapes = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: shapes.append(t.shape) or t, lambda t: t):
            taylor_causal(*(t.clone().requires_grad_(True) for t in (q, k, v)), 8)
        assert shapes and all(s[-1] != feature_dim(d) for s in shapes), shapes


def test_taylor_features_equal_the_kernel():
    """phi(q).phi(k) = 1 + s + s^2/2 for odd and even widths (the strided pair layout of the map)."""
    from megahash.ops.taylor.feature_map import feature_dim, taylor_features, taylor_kernel

    for d in (1, 2, 3, 5, 16):
        q, k, _ = qkv(7, d=d)
        fq, fk = taylor_features(q), taylor_features(k)
        assert fq.shape[-1] == feature_dim(d)
        close(fq @ fk.transpose(-1, -2), taylor_kernel(q, k.expand_as(q)))


@pytest.mark.parametrize("L", LENGTHS)
def test_orders_chunked_equals_naive_and_recurrent(L):
    """(The first-order denominator q_i . sum k_j has no sign and can be near 0, which amplifies
    fp64 round-off: TOL_ORDERS.)"""
    q, k, v = qkv(L, seed=1)
    want = naive_orders(q, k, v)
    rec, rstate = orders_recurrent(q, k, v)
    close(rec, want, TOL_ORDERS)
    for chunk in CHUNKS:
        out, state = orders_causal(q, k, v, chunk, need_state=True)
        close(out, want, TOL_ORDERS)
        for a, b in zip(state, rstate):
            close(a, b)
    cut = max(1, L // 2)  # prefill then continue at an offset
    if cut == L:
        return
    o1, st = orders_causal(q[..., :cut, :], k[..., :cut, :], v[..., :cut, :], 3, need_state=True)
    o2, _ = orders_causal(q[..., cut:, :], k[..., cut:, :], v[..., cut:, :], 4, state=st, offset=cut)
    close(torch.cat([o1, o2], -2), want, TOL_ORDERS)


@pytest.mark.parametrize("L", LENGTHS)
def test_cumsoftmax_scan_equals_naive_and_recurrent(L):
    q, k, v = qkv(L, seed=2)
    s = (q * k).sum(-1) / math.sqrt(q.shape[-1])
    want = naive_cumsoftmax(s, v)
    out, state = cumsoftmax_causal(s, v, need_state=True)
    close(out, want)
    rec, rstate = cumsoftmax_recurrent(s, v)
    close(rec, want)
    for a, b in zip(state, rstate):
        close(a, b)
    for a, b in zip(grads(lambda *t: cumsoftmax_causal(*t)[0], s, v), grads(naive_cumsoftmax, s, v)):
        close(a, b, 1e-9)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 2e-5)])
def test_cumsoftmax_scan_fp32_and_bf16_inputs(dtype, tol):
    """Inputs of the training dtype, computed in fp32 (as the module does), against the exact map
    in fp64 of the same (rounded) inputs: fp32 round-off only, at 4,096 tokens. The fp64 map is eq. 4.18 as
    cumulative sums with one shift per sequence (``shifted_cumsums``, O(L)), where the [L, L] map of
    ``naive_cumsoftmax`` held 1.6 GB here (~10 CPU-s); with scores within +-40 no term underflows in fp64, so
    its round-off (~1e-13) is far below the tolerance."""
    from test_numerics_scan_map import shifted_cumsums

    q, k, v = qkv(4096, d=16, dv=8, seed=3, dtype=torch.float32)
    s = ((q * k).sum(-1) / 4.0).to(dtype)
    v = v.to(dtype)
    got, _ = cumsoftmax_causal(s.float(), v.float())
    assert s.abs().max() < 40
    want = shifted_cumsums(s, v)
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)


@pytest.mark.parametrize("L,T", [(7, 7), (1, 9), (4, 9), (12, 12)])
def test_shared_map_equals_naive_and_keeps_no_map(L, T):
    g = torch.Generator().manual_seed(4)
    q = torch.randn(2, 3, L, 6, dtype=torch.float64, generator=g)
    k = torch.randn(2, T, 6, dtype=torch.float64, generator=g)
    v = torch.randn(3, 2, T, 5, dtype=torch.float64, generator=g)  # batch of 3 sharing the map
    mask = torch.rand(3, T, generator=g) > 0.3
    mask[:, 0] = True
    for causal in (True, False):
        for key_mask in (None, mask):
            got = shared_softmax(q, k, v, 0.4, causal, key_mask)
            for bi in range(3):  # each sequence: softmax over its own valid keys
                keep = torch.ones(L, T, dtype=torch.bool).tril(T - L) if causal else torch.ones(L, T, dtype=torch.bool)
                if key_mask is not None:
                    keep = keep & key_mask[bi]
                s = (q @ k.unsqueeze(1).transpose(-1, -2) * 0.4).masked_fill(~keep, float("-inf"))
                close(got[bi], torch.softmax(s, -1) @ v[bi].unsqueeze(1))
                if bi == 0 and key_mask is None:  # one sequence: plain SDPA
                    close(shared_softmax(q, k, v[:1], 0.4, causal)[0], got[0])
    fast = grads(lambda *t: shared_softmax(*t, 0.4, True), q, k, v)
    slow = grads(
        lambda q, k, v: (
            naive_shared_softmax(q, k.unsqueeze(1), v.permute(1, 2, 0, 3).reshape(2, 1, T, -1), 0.4, True)
            .reshape(2, 3, L, 3, 5)
            .permute(3, 0, 1, 2, 4)
        ),
        q,
        k,
        v,
    )
    for a, b in zip(fast, slow):
        close(a, b, 1e-9)
    sizes = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: sizes.append(tuple(t.shape)) or t, lambda t: t):
        shared_softmax(*(t.clone().requires_grad_(True) for t in (q, k, v)), 0.4, True)
    assert not [s for s in sizes if s[-2:] == (L, T) and L * T > 9], sizes  # no [.., L, T] map saved


# ------------------------------------------------------------------------ launch counts of the kinds


def _kinds():
    from megahash import catalog

    return sorted(catalog.entries("attention"))


def _count_model(kind: str, chunk: int):
    from megahash.config import load_config
    from megahash.models.attention import fixed_qk
    from megahash.models.megatron_model import build_model

    cfg = load_config(
        None,
        [
            "model.hidden_size=32",
            "model.num_layers=2",
            "model.num_heads=4",
            "model.ffn_hidden_size=64",
            f"model.schedule=uniform:{kind}",
            "data.seq_length=1024",
            "model.max_position_embeddings=1024",
            "model.attention.options.fixed_seq_length=1024",
            f"model.attention.options.chunk_size={chunk}",
        ],
    )
    rng.seed_all(0)
    model = build_model(cfg, 128, dtype=torch.float32).train()
    if getattr(model, "fixed_qk", None) is not None and model.fixed_qk.source == "text":
        fixed_qk.set_fixed_tokens(model, [(7 * i + 5) % 128 for i in range(1024)])
    return model


def _count_step(model, L: int) -> int:
    from megatron.core import tensor_parallel

    tok = torch.randint(0, 128, (1, L), generator=torch.Generator().manual_seed(L))
    mode = CountOps()
    with mode:
        logits = model.logits(model.hidden_states(tok))
        tensor_parallel.vocab_parallel_cross_entropy(logits.float(), tok.t().contiguous()).mean().backward()
    return mode.total()


@pytest.mark.usefixtures("dist")
@pytest.mark.parametrize("kind", _kinds())
def test_operator_count_does_not_grow_with_length(kind):
    """Forward + backward of a 2-layer model at 256 and 1,024 tokens (chunks of 64): the same number
    of ATen calls (what a GPU pays a launch for) for every kind. A kind that carries a matrix state
    over chunks in a loop (``AttentionCaps.chunk_loop``: the gated delta rule) pays per chunk, never per
    token: 1,024 tokens in chunks of 256 cost what 256 tokens in chunks of 64 cost (4 chunks each), and
    the 12 chunks more of 1,024 tokens in chunks of 64 at most 24 calls per chunk and layer (fewer than one
    per token of a chunk)."""
    from megahash import catalog

    model = _count_model(kind, 64)
    counts = {L: _count_step(model, L) for L in (256, 1024)}
    if not catalog.caps("attention", kind).chunk_loop:
        assert counts[256] == counts[1024], counts
        return
    assert counts[256] == _count_step(_count_model(kind, 256), 1024), counts
    assert 0 < counts[1024] - counts[256] <= 24 * 12 * 2, counts


def test_each_family_exports_its_forms():
    """As fla's packages (``fla.ops.linear_attn.__all__``): each family's ``__all__`` names the functions
    of its form modules (the same objects), and ``megahash.ops.__all__`` is their union."""
    import importlib

    import megahash.ops

    union = set()
    for family in ("cumsoftmax", "gated_delta", "linear", "orders", "shared_map", "taylor"):
        pkg = importlib.import_module(f"megahash.ops.{family}")
        assert pkg.__all__, family
        for name in pkg.__all__:
            fn = getattr(pkg, name)
            assert callable(fn) and fn.__module__.startswith(f"megahash.ops.{family}."), (family, name)
            assert getattr(importlib.import_module(fn.__module__), name) is fn, (family, name)
        union |= set(pkg.__all__)
    assert set(megahash.ops.__all__) == union
    assert all(
        getattr(megahash.ops, n) is getattr(importlib.import_module(getattr(megahash.ops, n).__module__), n)
        for n in union
    )


# ------------------------------------------------------------------------ flash-linear-attention (GPU)


@pytest.mark.gpu
def test_fla_based_kernel_equals_the_oracle():
    """On CUDA with fla installed, Based's 16 features run fla's kernel: equal to the naive form."""
    from megahash.ops.taylor.fla_based import based_kernel, fla_taylor

    if not policy.has_gpu() or based_kernel() is None:
        pytest.skip("needs a GPU and flash-linear-attention")
    q, k, v = (t.float().to(policy.device()) for t in qkv(512, d=16, dv=64, seed=5))
    got = fla_taylor(q, k, v)
    assert got is not None
    torch.testing.assert_close(got, naive_taylor(q, k, v), rtol=2e-3, atol=2e-3)
