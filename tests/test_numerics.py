"""Every attention kind under bf16 autocast against the same weights in fp64 (issue 33).

Whole model (hidden 128, 2 layers, 4 heads, one sequence of L tokens, next-token cross-entropy): the
fp32 model runs under ``torch.autocast('cpu', dtype=torch.bfloat16)`` (the dtype decisions CUDA
autocast makes: GEMMs in bf16, reductions in fp32), the fp64 copy of its weights without, and each
kind's relative error ||x - x64|| / ||x64|| of the logits and of all parameter gradients must be
within 2x mha's in the same run, with nothing non-finite. The kinds come from the registry
(tests/_kinds.py). The kernels' own fp32 accumulation under autocast is checked against fp64 loops
written from the equations. L=2048 and L=8192 and weights at trained scales: the measurement
benchmarks/bench_numerics.py (benchmarks/results/2026-11-25_numerics_cpu.md).
"""

from __future__ import annotations

import functools
import math
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import _kinds
import pytest
import torch

from megahash.accelerator import rng
from megahash.config import load_config

pytestmark = [pytest.mark.usefixtures("dist"), pytest.mark.numerics]
VOCAB = 512
# whole model: every kind's fp64 forward + backward and its autocast one: ~0.2-1 s a kind at L=512,
# 5-10 s at L=2048 on the shared 2-core machine (~25 s CPU for all kinds: marked slow)
LENGTHS = [512, pytest.param(2048, marks=pytest.mark.slow)]
# approx-thesis's literal eq. 4.16 is ill-conditioned (its denominator has no sign: rounding q, k to
# bf16 alone moves its output by O(1)); its stabilised option is what can meet mha's error
STABILISED = {"approx-thesis": ["model.attention.options.denominator=positive"]}
KINDS = _kinds.attention(decoder=True)


def _cfg(kind, extra, L):
    return load_config(
        None,
        [
            "model.hidden_size=128",
            "model.num_heads=4",
            "model.num_layers=2",
            "model.ffn_hidden_size=512",
            f"model.schedule=uniform:{kind}",
            f"model.max_position_embeddings={L + 8}",
            f"model.attention.options.fixed_seq_length={L}",
            f"data.seq_length={L}",
            *extra,
        ],
    )


def _models(cfg, L):
    from megahash.models.attention import fixed_qk
    from megahash.models.megatron_model import build_model

    out = []
    for dtype in (torch.float32, torch.float64):
        rng.seed_all(0)
        m = build_model(cfg, VOCAB, dtype=dtype).train()
        if getattr(m, "fixed_qk", None) is not None and m.fixed_qk.source == "text":
            fixed_qk.set_fixed_tokens(m, [(31 * i + 7) % VOCAB for i in range(L)])
        out.append(m)
    out[1].load_state_dict(out[0].state_dict())  # the same weights in fp64
    return out


def _step(model, tok, autocast: bool):
    from megatron.core import tensor_parallel

    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        logits = model.logits(model.hidden_states(tok))
    out = logits.detach().double().clone()  # megatron's cross-entropy shifts fp32 logits in place
    loss = tensor_parallel.vocab_parallel_cross_entropy(
        logits.double() if not autocast else logits.float(), tok.roll(-1, 1).t().contiguous()
    ).mean()
    loss.backward()
    grads = torch.cat([p.grad.double().flatten() for p in model.parameters() if p.grad is not None])
    return out, grads


@functools.cache
def _errors(kind, extra=(), L=512) -> dict:
    m32, m64 = _models(_cfg(kind, extra, L), L)
    tok = torch.randint(0, VOCAB, (1, L), generator=torch.Generator().manual_seed(0))
    lo, go = _step(m32, tok, True)
    lr, gr = _step(m64, tok, False)

    def rel(a, b):
        return float((a - b).norm() / b.norm())

    return {
        "logits": rel(lo, lr),
        "grads": rel(go, gr),
        "finite": bool(torch.isfinite(lo).all() and torch.isfinite(go).all()),
    }


@pytest.mark.parametrize("L", LENGTHS)
@pytest.mark.parametrize("kind", KINDS)
def test_whole_model_bf16_autocast_error_within_2x_mha(kind, L):
    """Logits and gradients of every kind under bf16 autocast: within 2x mha's relative error against
    fp64 (bf16 has 8 significant bits: mha's own error, ~5e-3 here, is the scale of what bf16 GEMMs
    cost; 2x is the issue's bound), all finite. approx and approx-thesis failed before issue 33 (a
    dtype error in the feature GEMM's backward; approx-thesis's kernel at 1.7e3 relative error)."""
    e, mha_errors = _errors(kind, tuple(STABILISED.get(kind, ())), L), _errors("mha", (), L)
    assert e["finite"], e
    assert e["logits"] <= 2 * mha_errors["logits"], (e, mha_errors)
    assert e["grads"] <= 2 * mha_errors["grads"], (e, mha_errors)


@pytest.mark.xfail(strict=True, reason="eq. 4.16 literally: a signless denominator (docs/attention.md Numerics)")
def test_literal_eq_4_16_is_not_within_2x_mha():
    """The known limit the stabilised option exists for: the literal form misses the bound."""
    e, mha_errors = _errors("approx-thesis", ("model.attention.options.denominator=literal",)), _errors("mha")
    assert e["logits"] <= 2 * mha_errors["logits"], (e, mha_errors)


# ----------------------------------------------------------------------------- the kernels inside autocast


def _thesis64(q, k, v, positive=False):
    """Eq. 4.14-4.17 in fp64 as masked matrices (written from the equations, not megahash.ops)."""
    q, k, v = (t.double() for t in (q, k, v))
    s = q.shape[-1] ** -0.25
    q, k = q * s, k * s
    phi = (lambda x: torch.where(x > 0, x + 1, torch.exp(x))) if positive else (lambda x: x)
    n = q.shape[-2]
    mask = torch.ones(n, n, dtype=torch.bool).tril()
    a0 = mask / mask.sum(-1, keepdim=True).double()  # (4.15)
    a1 = (phi(q) @ phi(k).transpose(-1, -2)) * mask  # (4.16)
    a2 = ((q * q / math.sqrt(2)) @ (k * k / math.sqrt(2)).transpose(-1, -2)) * mask  # (4.17)
    return (a0 + a1 / a1.sum(-1, keepdim=True) + a2 / a2.sum(-1, keepdim=True)) @ v  # (4.14)


def _taylor64(q, k, v):
    """Based's 2nd-order Taylor attention ([Xue25] eq. 4.6) in fp64: A = tril(1 + s + s^2/2), A V / A 1."""
    q, k, v = (t.double() for t in (q, k, v))
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    a = (1 + s + s * s / 2).tril()
    return (a @ v) / a.sum(-1, keepdim=True)


KERNELS = {
    "approx-thesis literal": (
        lambda q, k, v: __import__("megahash.ops.orders.chunk", fromlist=["x"]).orders_causal(q, k, v, 64)[0],
        _thesis64,
    ),
    "approx-thesis positive": (
        lambda q, k, v: __import__("megahash.ops.orders.chunk", fromlist=["x"]).orders_causal(
            q, k, v, 64, positive=True
        )[0],
        lambda q, k, v: _thesis64(q, k, v, True),
    ),
    "approx": (
        lambda q, k, v: __import__("megahash.ops.taylor.chunk", fromlist=["x"]).taylor_causal(q, k, v, 64)[0],
        _taylor64,
    ),
}


@pytest.mark.parametrize("name", list(KERNELS))
def test_kernels_accumulate_in_fp32_under_autocast(name):
    """Inside bf16 autocast a kernel fed fp32 is as accurate as in fp32 without autocast and returns fp32
    (before issue 33 autocast re-cast its GEMMs to bf16: approx-thesis 1.7e3 relative error at L=2048,
    approx 4.7e-3 and a bf16 result); fed bf16 it returns bf16 within bf16's output rounding (2^-8
    relative) of its fp32 result on the same values. References: fp64, from the equations."""
    run, ref = KERNELS[name]
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 1, 256, 16, generator=g) for _ in range(3))

    def rel(a, b):
        return float((a.double() - b).norm() / b.norm())

    want = ref(q, k, v)
    plain = run(q, k, v)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        auto = run(q, k, v)
        low = run(q.bfloat16(), k.bfloat16(), v.bfloat16())
    assert auto.dtype == torch.float32 and low.dtype == torch.bfloat16
    assert rel(auto, want) <= 2 * rel(plain, want) + 1e-6  # fp32 accumulation: fp32's error, not bf16's
    rounded = [t.bfloat16().float() for t in (q, k, v)]  # the same values as the bf16 inputs, in fp32
    assert rel(low, run(*rounded)) <= 2**-8  # bf16 inputs: fp32 arithmetic, then the output's rounding
