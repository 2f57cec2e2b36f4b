"""``approx-thesis`` ([Xue25] Appendix I, eq. 4.14-4.17): parallel = chunked = recurrent = a naive
loop written here from the equations; decode state = Table 4.8; model-level decoding and TP parity
(the TP case runs in tests/models/test_attention.py::test_tp2_parity_all_kinds)."""

from __future__ import annotations

import math
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest
import torch

from conftest import MICRO
from megahash.accelerator import rng
from megahash.config import load_config

pytestmark = [pytest.mark.usefixtures("dist"), pytest.mark.numerics]
VOCAB = 128


def elu1(x):
    """[Katharopoulos20] eq. 7: elu(x) + 1 = x + 1 for x > 0, exp(x) otherwise."""
    return torch.where(x > 0, x + 1, torch.exp(x))


def naive_eq_4_14(q, k, v, phi=lambda x: x):
    """Eq. 4.14-4.17 for one head, literally: q, k [L, d] (already scaled), v [L, dv] -> [L, dv];
    ``phi`` the first order's feature map (identity: eq. 4.16; elu1: the positive denominator)."""
    L = q.shape[0]
    out = torch.zeros(L, v.shape[1], dtype=q.dtype)
    for i in range(L):
        o0 = sum(v[j] for j in range(i + 1)) / (i + 1)  # (4.15)
        num1 = phi(q[i]) @ sum(torch.outer(phi(k[j]), v[j]) for j in range(i + 1))  # (4.16)
        den1 = phi(q[i]) @ sum(phi(k[j]) for j in range(i + 1))
        q2 = q[i] ** 2 / math.sqrt(2)
        num2 = q2 @ sum(torch.outer(k[j] ** 2 / math.sqrt(2), v[j]) for j in range(i + 1))  # (4.17)
        den2 = q2 @ sum(k[j] ** 2 / math.sqrt(2) for j in range(i + 1))
        out[i] = o0 + num1 / den1 + num2 / den2  # (4.14)
    return out


def test_parallel_chunked_recurrent_equal_naive_loop():
    from megahash.ops.orders.chunk import orders_causal as thesis_causal
    from megahash.ops.orders.recurrent import orders_recurrent as thesis_recurrent

    g = torch.Generator().manual_seed(0)
    L, d, dv = 13, 6, 5
    q = torch.randn(2, 2, 3, L, d, dtype=torch.float64, generator=g)  # [b, groups, rep, L, d]
    k = torch.randn(2, 2, 1, L, d, dtype=torch.float64, generator=g)
    v = torch.randn(2, 2, 1, L, dv, dtype=torch.float64, generator=g)
    s = d**-0.25  # eq. 4.6: q.k / sqrt(d_h)
    want = torch.stack(
        [
            torch.stack(
                [
                    torch.stack([naive_eq_4_14(q[b, h, r] * s, k[b, h, 0] * s, v[b, h, 0]) for r in range(3)])
                    for h in range(2)
                ]
            )
            for b in range(2)
        ]
    )
    par, _ = thesis_causal(q, k, v, chunk=L)
    rec, rstate = thesis_recurrent(q, k, v)
    torch.testing.assert_close(par, want, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(rec, want, rtol=1e-10, atol=1e-10)
    for chunk in (1, 4, 5):
        out, state = thesis_causal(q, k, v, chunk=chunk, need_state=True)
        torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-10)
        for a, b in zip(state, rstate):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    # a carried state (prefill, then continue at an offset) gives the same outputs
    out1, st = thesis_causal(q[..., :7, :], k[..., :7, :], v[..., :7, :], 3, need_state=True)
    out2, _ = thesis_causal(q[..., 7:, :], k[..., 7:, :], v[..., 7:, :], 4, state=st, offset=7)
    torch.testing.assert_close(torch.cat([out1, out2], -2), want, rtol=1e-10, atol=1e-10)
    # gradients of the chunked form equal those of the recurrence
    qs, ks, vs = (t.clone().requires_grad_(True) for t in (q, k, v))
    thesis_causal(qs, ks, vs, chunk=4)[0].sum().backward()
    qr, kr, vr = (t.clone().requires_grad_(True) for t in (q, k, v))
    thesis_recurrent(qr, kr, vr)[0].sum().backward()
    for a, b in ((qs, qr), (ks, kr), (vs, vr)):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-9, atol=1e-10)


def test_bidirectional_form_is_the_sum_over_all_valid_keys():
    from megahash.ops.orders.chunk import orders_bidirectional as thesis_bidirectional
    from megahash.ops.orders.chunk import orders_causal as thesis_causal

    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 1, 2, 9, 4, dtype=torch.float64, generator=g)
    k = torch.randn(1, 1, 1, 9, 4, dtype=torch.float64, generator=g)
    v = torch.randn(1, 1, 1, 9, 3, dtype=torch.float64, generator=g)
    mask = torch.ones(1, 1, 1, 9, dtype=torch.bool)
    mask[..., 6:] = False
    got = thesis_bidirectional(q, k, v, mask)
    # the last causal position over the 6 valid keys sees exactly all of them: query the last one
    for i in range(9):
        qq = torch.cat([q[..., :5, :], q[..., i : i + 1, :]], -2)
        want = thesis_causal(qq, k[..., :6, :], v[..., :6, :], chunk=6)[0][..., -1, :]
        torch.testing.assert_close(got[..., i, :], want, rtol=1e-10, atol=1e-12)


def make_cfg(*extra):
    return load_config(
        None,
        [
            *MICRO,
            "model.schedule=uniform:approx-thesis",
            *extra,
        ],
    )


@pytest.mark.parametrize("extra", [(), ("model.num_query_groups=2",)])
def test_decode_state_is_table_4_8(extra):
    """Decoding (prefill 5 tokens, then one at a time) equals the full forward (chunks of 4), and
    the decode state per layer is 2 bytes x (3Bd + 2Bd^2/h) = Table 4.8's 6Bd + 4Bd^2/h for MHA
    (g/h of it with g key/value groups), independent of the context length."""
    from megahash.models import costs
    from megahash.models.megatron_model import DecodeState, build_model

    cfg = make_cfg("model.attention.options.chunk_size=4", *extra)
    rng.seed_all(0)
    model = build_model(cfg, VOCAB, dtype=torch.float64).eval()
    tok = torch.randint(0, VOCAB, (3, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = model.hidden_states(tok)
        state = DecodeState(2)
        parts = [model.hidden_states(tok[:, :5], decode_state=state)]
        parts += [model.hidden_states(tok[:, i : i + 1], decode_state=state) for i in range(5, 12)]
    torch.testing.assert_close(torch.cat(parts), full, rtol=0, atol=1e-10)
    B, L, n, d = 3, 12, 4, 32
    g = cfg.model.num_query_groups or n
    for c in state.caches:
        numbers = sum(t.numel() for t in c.values())
        assert 2 * numbers * n == g * costs.cache_bytes("approx", B, L, d, n)  # Table 4.8 "Approx."
        assert numbers == costs.cache_elements("approx-thesis", B, L, n, d // n, g)
    assert costs.cache_bytes("approx", B, L, d, n) == 6 * B * d + 4 * B * d * d / n


def test_parameters_equal_mha():
    from megahash.models.megatron_model import build_model

    rng.seed_all(0)
    a = sum(p.numel() for p in build_model(make_cfg(), VOCAB).parameters())
    b = sum(p.numel() for p in build_model(make_cfg("model.schedule=uniform:mha"), VOCAB).parameters())
    assert a == b


def test_approx_projected_feature_dim():
    """``approx`` with Based's feature_dim d' = 4 (< d_h = 8): q, k have d' dims per head, chunked =
    parallel = incremental decoding, state (1 + d' + d'(d'+1)/2)(d_h + 1) per head, and the sublayer has
    (n + g)(d_h - d')(d_m + 1) fewer parameters than mha (weights and q/k biases)."""
    from megahash.models import costs
    from megahash.models.megatron_model import DecodeState, build_model

    def model(*extra):
        rng.seed_all(0)
        return build_model(make_cfg("model.schedule=uniform:approx", *extra), VOCAB, dtype=torch.float64).eval()

    tok = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    a, b = (
        model("model.attention.options.feature_dim=4"),
        model("model.attention.options.feature_dim=4", "model.attention.options.chunk_size=5"),
    )
    att = a.attention_modules()[0]
    assert att.linear_q.weight.shape == (4 * 4, 32) and att.linear_kv.weight.shape == (4 * (4 + 8), 32)
    with torch.no_grad():
        full = a.hidden_states(tok)
        torch.testing.assert_close(b.hidden_states(tok), full, rtol=0, atol=1e-10)
        state = DecodeState(2)
        parts = [a.hidden_states(tok[:, :5], decode_state=state)]
        parts += [a.hidden_states(tok[:, i : i + 1], decode_state=state) for i in range(5, 12)]
    torch.testing.assert_close(torch.cat(parts), full, rtol=0, atol=1e-10)
    numbers = sum(t.numel() for t in state.caches[0].values())
    assert numbers == 2 * 4 * (1 + 4 + 10) * (8 + 1) == costs.cache_elements("approx", 2, 12, 4, 8, feature_dim=4)
    ref = sum(p.numel() for p in model().attention_modules()[0].parameters())
    assert ref - sum(p.numel() for p in att.parameters()) == (4 + 4) * (8 - 4) * (32 + 1)


# ----------------------------------------------------------------------------- the positive denominator (issue 33)


@pytest.mark.numerics
def test_positive_denominator_equals_its_loop_in_every_form():
    """``denominator=positive``: chunked (with a carried state), recurrent, naive and bidirectional
    forms equal the loop written from eq. 4.14-4.17 with elu(x) + 1 first-order features (fp64)."""
    from megahash.ops.orders.chunk import orders_bidirectional, orders_causal
    from megahash.ops.orders.naive import naive_orders
    from megahash.ops.orders.recurrent import orders_recurrent

    g = torch.Generator().manual_seed(2)
    L, d, dv = 11, 6, 5
    q = torch.randn(1, 2, 2, L, d, dtype=torch.float64, generator=g)
    k = torch.randn(1, 2, 1, L, d, dtype=torch.float64, generator=g)
    v = torch.randn(1, 2, 1, L, dv, dtype=torch.float64, generator=g)
    s = d**-0.25
    want = torch.stack(
        [
            torch.stack([naive_eq_4_14(q[0, h, r] * s, k[0, h, 0] * s, v[0, h, 0], elu1) for r in range(2)])
            for h in range(2)
        ]
    ).unsqueeze(0)
    tol = dict(rtol=1e-10, atol=1e-10)  # fp64: only reassociation differs
    for chunk in (1, 4, L):
        torch.testing.assert_close(orders_causal(q, k, v, chunk, positive=True)[0], want, **tol)
    out1, st = orders_causal(q[..., :6, :], k[..., :6, :], v[..., :6, :], 4, need_state=True, positive=True)
    out2, _ = orders_causal(q[..., 6:, :], k[..., 6:, :], v[..., 6:, :], 4, state=st, offset=6, positive=True)
    torch.testing.assert_close(torch.cat([out1, out2], -2), want, **tol)
    torch.testing.assert_close(orders_recurrent(q, k, v, positive=True)[0], want, **tol)
    torch.testing.assert_close(naive_orders(q, k, v, positive=True), want, **tol)
    # bidirectional with padding: the last query of the causal form over the 7 valid keys
    mask = torch.ones(1, 1, 1, L, dtype=torch.bool)
    mask[..., 7:] = False
    bi = orders_bidirectional(q, k, v, mask, positive=True)
    for i in (0, 4, 10):
        want_i = torch.stack(
            [
                torch.stack(
                    [
                        naive_eq_4_14(
                            torch.cat([k[0, h, 0, :6], q[0, h, r, i : i + 1]]) * s,
                            k[0, h, 0, :7] * s,
                            v[0, h, 0, :7],
                            elu1,
                        )[-1]
                        for r in range(2)
                    ]
                )
                for h in range(2)
            ]
        )
        torch.testing.assert_close(bi[0, :, :, i], want_i, **tol)


@pytest.mark.numerics
def test_positive_denominator_is_bounded_where_the_literal_is_not():
    """Random unit-variance q, k, v at L=4096 (the issue's case): eq. 4.16 literally gives outputs
    hundreds of times the values' scale (its denominator crosses 0); the positive denominator keeps
    each order a convex combination of the values, |o_i| <= 3 max_j |v_j|."""
    from megahash.ops.orders.chunk import orders_causal

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 1, 4096, 32, dtype=torch.float64, generator=g) for _ in range(3))
    lit = orders_causal(q, k, v)[0]
    pos = orders_causal(q, k, v, positive=True)[0]
    bound = 3 * v.abs().amax(-2, keepdim=True)
    assert lit.abs().max() > 100 * v.abs().max()  # the conditioning docs/attention.md documents
    assert (pos.abs() <= bound * (1 + 1e-12)).all()


def test_positive_denominator_model_is_causal_and_decodes():
    """Whole model with ``denominator=positive`` (fp64): changing token 7 leaves every earlier
    position's hidden state unchanged (causal mask by perturbation), and decoding (prefill 5, then one
    token at a time) equals the full forward; a wrong option value is one ConfigError."""
    from megahash.errors import ConfigError
    from megahash.models.megatron_model import DecodeState, build_model

    cfg = make_cfg("model.attention.options.chunk_size=4", "model.attention.options.denominator=positive")
    rng.seed_all(0)
    model = build_model(cfg, VOCAB, dtype=torch.float64).eval()
    tok = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    bumped = tok.clone()
    bumped[:, 7] = (bumped[:, 7] + 1) % VOCAB
    with torch.no_grad():
        full, other = model.hidden_states(tok), model.hidden_states(bumped)
        state = DecodeState(2)
        parts = [model.hidden_states(tok[:, :5], decode_state=state)]
        parts += [model.hidden_states(tok[:, i : i + 1], decode_state=state) for i in range(5, 12)]
    torch.testing.assert_close(other[:7], full[:7], rtol=0, atol=1e-12)  # fp64 round-off only
    assert (other[7:] - full[7:]).abs().max() > 1e-6
    torch.testing.assert_close(torch.cat(parts), full, rtol=0, atol=1e-10)
    with pytest.raises(ConfigError, match="denominator"):
        build_model(make_cfg("model.attention.options.denominator=abs"), VOCAB)


def test_positive_denominator_reaches_the_export():
    """The HF export's plain-torch reference reads ``denominator`` from the kind's export spec: its
    logits equal the library's (fp64) for ``positive``, and differ from a literal model's."""
    from megahash.convert.reference import reference_model
    from megahash.models.megatron_model import build_model

    tok = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    out = {}
    for den in ("literal", "positive"):
        cfg = make_cfg("model.attention.options.chunk_size=4", f"model.attention.options.denominator={den}")
        rng.seed_all(0)
        model = build_model(cfg, VOCAB, dtype=torch.float64).eval()
        with torch.no_grad():
            a = model(tok)
            b = reference_model(cfg, model)(input_ids=tok).logits
        torch.testing.assert_close(b, a, rtol=0, atol=1e-9)  # fp64, the same kernels
        out[den] = a
    assert (out["literal"] - out["positive"]).abs().max() > 1e-3
