"""Numerics of nonapprox's one-score-per-key scan and of the batch-shared map of rndembqk/fixedseqqk
(issue 33, items 2-4). References are float64 and written here from the equations ([Xue25] eq.
4.7-4.8, 4.18: o_i = sum_{j<=i} e^{s_j} v_j / sum_{j<=i} e^{s_j}; eq. 4.9-4.12: O = softmax(Q K^T
scale) V per sequence over its valid keys), not from the kernels' own oracles. Tolerances come
from the dtype (said at each assert). Each test failed before the fix it covers (figures in
docs/attention.md, "Numerics")."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest
import torch

from megahash.ops.cumsoftmax.chunk import cumsoftmax_bidirectional, cumsoftmax_causal
from megahash.ops.shared_map.parallel import shared_softmax

pytestmark = pytest.mark.numerics

EPS32 = torch.finfo(torch.float32).eps  # 1.19e-7
EPS_BF16 = torch.finfo(torch.bfloat16).eps  # 7.8e-3 (2^-7); a bf16 rounding is <= eps/2 relative


def gen(seed):
    return torch.Generator().manual_seed(seed)


# ------------------------------------------------------------------ references from the equations


def ref_cumsoftmax(s, v):
    """eq. 4.18 in fp64: o_i = sum_{j<=i} e^{s_j - c_i} v_j / sum_{j<=i} e^{s_j - c_i} (c_i any shift)."""
    s, v = s.double(), v.double()
    L = s.shape[-1]
    e = s.unsqueeze(-2).expand(*s.shape[:-1], L, L)  # [..., i, j] = s_j
    visible = torch.ones(L, L, dtype=torch.bool).tril()
    e = e.masked_fill(~visible, float("-inf"))
    w = torch.exp(e - e.amax(-1, keepdim=True))
    return (w @ v) / w.sum(-1, keepdim=True)


def shifted_cumsums(s, v):
    """eq. 4.18 in fp64 with one shift per sequence (c = max over its positions), O(L):
    o_i = cumsum(e^{s_j - c} v_j)_i / cumsum(e^{s_j - c})_i; no term underflows while the scores span < ~700."""
    s, v = s.double(), v.double().expand(*s.shape, v.shape[-1])
    e = torch.exp(s - s.amax(-1, keepdim=True))
    return (e.unsqueeze(-1) * v).cumsum(-2) / e.cumsum(-1).unsqueeze(-1)


def masked_softmax32(s, v):
    """The plain masked softmax in fp32 (the baseline the scan's error is held to)."""
    L = s.shape[-1]
    e = s.float().unsqueeze(-2).expand(*s.shape[:-1], L, L)
    e = e.masked_fill(~torch.ones(L, L, dtype=torch.bool).tril(), float("-inf"))
    return torch.softmax(e, -1) @ v.float()


def ref_shared_map(q, k, v, scale, causal, key_mask=None):
    """eq. 4.9-4.12 in fp64, per sequence b: softmax(Q K^T scale) over its valid (and visible) keys, times V_b."""
    q, k, v = q.double(), k.double(), v.double()  # q [g, rep, L, d], k [g, T, d], v [b, g, T, e]
    L, T = q.shape[-2], k.shape[-2]
    outs = []
    for b in range(v.shape[0]):
        keep = torch.ones(L, T, dtype=torch.bool)
        if causal:
            keep = keep.tril(T - L)
        if key_mask is not None:
            keep = keep & key_mask[b]
        s = torch.einsum("grld,gtd->grlt", q, k) * scale
        s = s.masked_fill(~keep, float("-inf"))
        w = torch.exp(s - s.amax(-1, keepdim=True))
        outs.append(torch.einsum("grlt,gte->grle", w / w.sum(-1, keepdim=True), v[b]))
    return torch.stack(outs)


def rel(got, want):
    return ((got.double() - want).abs().max() / want.abs().max()).item()


# ------------------------------------------------------------------ nonapprox: the scan in fp32


@pytest.mark.parametrize("scale", [10.0, 100.0, 1e3, 1e4])
def test_scan_fp32_large_scores_as_a_masked_softmax(scale):
    """|s| up to 1e4: fp32 error within 4x a plain masked softmax's (logcumsumexp form: 9e-6 .. 3.6e-3
    absolute, the masked softmax 1.1e-6 .. 1.2e-7). Floor: 8 fp32 roundings of the output."""
    s = torch.randn(2, 3, 256, generator=gen(1)) * scale
    v = torch.randn(2, 3, 256, 8, generator=gen(2))
    want = ref_cumsoftmax(s, v)
    err = (cumsoftmax_causal(s, v)[0].double() - want).abs().max().item()
    base = (masked_softmax32(s, v).double() - want).abs().max().item()
    assert err <= 4 * base + 8 * EPS32 * want.abs().max().item(), (err, base)


@pytest.mark.parametrize("vscale", [1e-2, 1e-4, 1e-6])
def test_scan_fp32_small_values_relative_error(vscale):
    """Values down to 1e-6: relative error within 4x the masked softmax's (the asinh form lost
    eps/|v|: 1e-5, 9e-4, 9e-2)."""
    s = torch.randn(2, 3, 256, generator=gen(3))
    v = torch.randn(2, 3, 256, 8, generator=gen(4)) * vscale
    want = ref_cumsoftmax(s, v)
    err = rel(cumsoftmax_causal(s, v)[0], want)
    base = rel(masked_softmax32(s, v), want)
    assert err <= 4 * base + 8 * EPS32, (err, base)


def test_scan_fp32_scaled_queries_and_keys():
    """q, k scaled by 1e4 (scores ~1e8/sqrt(d)): the old scan's relative error was 0.84."""
    q = torch.randn(2, 2, 64, 8, generator=gen(5)) * 1e4
    k = torch.randn(2, 2, 64, 8, generator=gen(6)) * 1e4
    v = torch.randn(2, 2, 64, 8, generator=gen(7))
    s = (q * k).sum(-1) / 8**0.5
    want = ref_cumsoftmax(s, v)
    err = rel(cumsoftmax_causal(s, v)[0], want)
    assert err <= 4 * rel(masked_softmax32(s, v), want) + 8 * EPS32, err


def test_scan_is_causal_by_perturbation_and_grads_match_fp64():
    """Changing scores and values after position t leaves outputs <= t bit-identical (no later key
    enters them; the chunk boundary 64 is crossed); fp64 gradients equal the reference's (1e-9)."""
    L, t = 150, 70
    s = torch.randn(2, 2, L, generator=gen(8), dtype=torch.float64) * 5
    v = torch.randn(2, 2, L, 4, generator=gen(9), dtype=torch.float64)
    s2, v2 = s.clone(), v.clone()
    s2[..., t + 1 :] += 300.0  # a later key that would dominate every sum
    v2[..., t + 1 :, :] *= -7
    a, b = cumsoftmax_causal(s, v)[0], cumsoftmax_causal(s2, v2)[0]
    # bit-exact: causality; the same ops on the same inputs for positions <= t, later keys never enter them
    assert torch.equal(a[..., : t + 1, :], b[..., : t + 1, :])
    assert (a[..., t + 1 :, :] - b[..., t + 1 :, :]).abs().max() > 1e-2
    w = torch.randn(2, 2, L, 4, generator=gen(10), dtype=torch.float64)
    got = torch.autograd.grad((cumsoftmax_causal(s.requires_grad_(), v.requires_grad_())[0] * w).sum(), (s, v))
    want = torch.autograd.grad((ref_cumsoftmax(s, v) * w).sum(), (s, v))
    for x, y in zip(got, want):
        torch.testing.assert_close(x, y, rtol=1e-9, atol=1e-11)  # fp64: ~1e-14 round-off, margin for L terms


def test_scan_decoding_4096_tokens_fp32():
    """fp32 decoding token by token (the carried state) stays within 1e-6 of the fp64 reference
    after 4,096 tokens (the log-space state drifted to 6e-5), and equals the parallel forward to
    the masked softmax's error; the final states agree."""
    n = 4096
    s = torch.randn(1, 2, n, generator=gen(11)) * 2
    v = torch.randn(1, 2, n, 4, generator=gen(12))
    par, pstate = cumsoftmax_causal(s, v, need_state=True)
    state, last = None, []
    for t in range(n):
        o, state = cumsoftmax_causal(s[..., t : t + 1], v[..., t : t + 1, :], state=state, need_state=True)
        last.append(o)
    dec = torch.cat(last, -2)
    want = shifted_cumsums(s, v)  # fp64 reference from eq. 4.18 directly (sums over all j <= i)
    assert (dec[..., -1, :].double() - want[..., -1, :]).abs().max() < 1e-6
    assert (dec.double() - want).abs().max() < 4e-6  # every position (fp32: ~ sqrt(n) eps)
    torch.testing.assert_close(dec, par, rtol=0, atol=4e-6)
    for a, b in zip(state, pstate):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_scan_chunked_recurrent_naive_agree_with_a_state():
    """The forms agree in fp64 (scan with a carried state at cuts that split chunks, the recurrent
    oracle token by token) with scores spanning +-1e3."""
    from megahash.ops.cumsoftmax.naive import naive_cumsoftmax
    from megahash.ops.cumsoftmax.recurrent import cumsoftmax_recurrent

    s = torch.randn(2, 3, 200, generator=gen(13), dtype=torch.float64) * 1e3
    v = torch.randn(2, 1, 200, 5, generator=gen(14), dtype=torch.float64)
    want = ref_cumsoftmax(s, v.expand(2, 3, 200, 5))
    torch.testing.assert_close(naive_cumsoftmax(s, v), want, rtol=0, atol=1e-12)
    rec, rstate = cumsoftmax_recurrent(s, v)
    torch.testing.assert_close(rec, want, rtol=0, atol=1e-12)
    for cut in (1, 63, 64, 130):
        o1, st = cumsoftmax_causal(s[..., :cut], v[..., :cut, :], need_state=True)
        o2, st = cumsoftmax_causal(s[..., cut:], v[..., cut:, :], state=st, need_state=True)
        torch.testing.assert_close(torch.cat([o1, o2], -2), want, rtol=0, atol=1e-12)
        for a, b in zip(st, rstate):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_scan_under_bf16_autocast_stays_fp32():
    """The module hands the scan fp32 scores and values; under bf16 autocast its products stay fp32
    (error as without autocast, fp32 level), and the output is fp32."""
    s = torch.randn(2, 2, 300, generator=gen(15)) * 30
    v = torch.randn(2, 2, 300, 8, generator=gen(16))
    want = ref_cumsoftmax(s, v)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = cumsoftmax_causal(s, v)[0]
        bi = cumsoftmax_bidirectional(s, v)
    assert got.dtype == torch.float32 and bi.dtype == torch.float32
    assert rel(got, want) < 64 * EPS32
    w = torch.softmax(s.double(), -1)
    assert rel(bi[..., 0, :], (w.unsqueeze(-2) @ v.double()).squeeze(-2)) < 64 * EPS32


# ------------------------------------------------------------------ the shared map (rndembqk/fixedseqqk)


@pytest.mark.parametrize("amp", [1.0, 4.0, 16.0, 60.0])
def test_shared_map_bf16_autocast_scores_in_fp32(amp):
    """bf16 inputs under autocast: scores in fp32, so the error is the output's and P's bf16 rounding
    (<= 2 eps_bf16 relative) at every score magnitude (max |q.k| ~30 .. 1,750); rounding the scores
    to bf16 gave 2.3e-2 .. 3.7e-1. The output has the input dtype."""
    g = gen(20)
    q = (torch.randn(2, 2, 64, 32, generator=g) * amp**0.5).bfloat16()
    k = (torch.randn(2, 64, 32, generator=g) * amp**0.5).bfloat16()
    v = torch.randn(3, 2, 64, 16, generator=g).bfloat16()
    want = ref_shared_map(q, k, v, 1.0, True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = shared_softmax(q, k, v, 1.0, True)
    assert got.dtype == torch.bfloat16
    assert rel(got, want) <= 2 * EPS_BF16


def test_shared_map_bf16_gradients_under_autocast():
    """Gradients of the flash-style backward under bf16 autocast against fp64 ones of the same
    (rounded) inputs: within a few bf16 roundings (dP in fp32, dS fp32)."""
    g = gen(21)
    q = (torch.randn(2, 2, 48, 16, generator=g) * 3).bfloat16()
    k = (torch.randn(2, 48, 16, generator=g) * 3).bfloat16()
    v = torch.randn(3, 2, 48, 8, generator=g).bfloat16()
    w = torch.randn(3, 2, 2, 48, 8, generator=g)
    qd, kd, vd = (t.double().requires_grad_() for t in (q, k, v))
    want = torch.autograd.grad((ref_shared_map(qd, kd, vd, 0.25, True) * w.double()).sum(), (qd, kd, vd))
    qb, kb, vb = (t.clone().requires_grad_() for t in (q, k, v))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = shared_softmax(qb, kb, vb, 0.25, True)
    got = torch.autograd.grad((out.float() * w).sum(), (qb, kb, vb))
    for a, b in zip(got, want):
        assert a.dtype == torch.bfloat16
        assert rel(a, b) <= 4 * EPS_BF16


@pytest.mark.parametrize("gap", [90.0, 110.0, 1e3, 1e4])
def test_shared_map_padding_masked_before_the_exponentials(gap):
    """Encoders: a padded key scoring `gap` above every valid key changes nothing (fp32, NaN before
    from a gap of ~104); a sequence with no valid key gives 0; fp32 error as an unpadded map's."""
    g = gen(22)
    u = torch.randn(2, 1, 1, 8, generator=g)
    q = u.expand(2, 2, 6, 8).contiguous()
    k = torch.randn(2, 6, 8, generator=g) * 0.1
    k[:, 4] = (u[:, 0, 0] / (u[:, 0, 0] ** 2).sum(-1, keepdim=True)) * gap  # q.k_4 = gap
    v = torch.randn(3, 2, 6, 4, generator=g)
    mask = torch.ones(3, 6, dtype=torch.bool)
    mask[0, 3:] = False  # key 4 is padding for sequence 0
    mask[2] = False  # nothing valid
    out = shared_softmax(q, k, v, 1.0, False, mask)
    assert torch.isfinite(out).all()
    # bit-exact: a row with no valid key is defined as exactly 0
    assert torch.equal(out[2], torch.zeros_like(out[2]))
    want = ref_shared_map(q, k, v[:2], 1.0, False, mask[:2])
    assert rel(out[:2], want) < 64 * EPS32
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    shared_softmax(qg, kg, vg, 1.0, False, mask).sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (qg, kg, vg))


def test_shared_map_padding_gradients_fp64():
    """With padding, the per-sequence maps' flash-style backward equals the fp64 reference's gradients."""
    g = gen(23)
    q = torch.randn(2, 3, 7, 6, dtype=torch.float64, generator=g)
    k = torch.randn(2, 7, 6, dtype=torch.float64, generator=g)
    v = torch.randn(3, 2, 7, 5, dtype=torch.float64, generator=g)
    mask = torch.rand(3, 7, generator=g) > 0.4
    mask[:, 0] = True
    w = torch.randn(3, 2, 3, 7, 5, dtype=torch.float64, generator=g)
    xs = [t.clone().requires_grad_() for t in (q, k, v)]
    got = torch.autograd.grad((shared_softmax(*xs, 0.4, False, mask) * w).sum(), xs)
    ys = [t.clone().requires_grad_() for t in (q, k, v)]
    want = torch.autograd.grad((ref_shared_map(*ys, 0.4, False, mask) * w).sum(), ys)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)  # fp64 round-off


# ------------------------------------------------------------------ encoders: a row does not see the padding


@pytest.mark.usefixtures("dist")
@pytest.mark.parametrize("kind", ["rndembqk", "fixedseqqk"])
@pytest.mark.parametrize("training", [False, True])
def test_encoder_row_independent_of_batch_padding(kind, training):
    """A 20-token row padded to 37 gives the outputs of the same row run alone (library model and
    its plain-torch reference, fp64, train and eval): the fixed input's bidirectional pass runs
    over the whole fixed input, not the batch's length (before: differences 1.1-1.7)."""
    from megahash.accelerator import rng
    from megahash.config import load_config
    from megahash.convert.reference import reference_model
    from megahash.models.attention import fixed_qk
    from megahash.models.megatron_model import build_model

    cfg = load_config(
        None,
        [
            "model.hidden_size=32",
            "model.num_layers=2",
            "model.num_heads=4",
            "model.ffn_hidden_size=64",
            f"model.schedule=list:mha,{kind}",
            "data.seq_length=48",
            "model.max_position_embeddings=48",
            "model.attention.options.fixed_seq_length=48",
            "model.arch=encoder",
            "train.objective=mlm",
            "model.hidden_dropout=0.0",
            "model.attention_dropout=0.0",
        ],
    )
    rng.seed_all(0)
    model = build_model(cfg, 128, dtype=torch.float64)
    if kind == "fixedseqqk":
        fixed_qk.set_fixed_tokens(model, [(7 * i + 5) % 128 for i in range(48)])
    with torch.no_grad():  # weights of a trained scale (init std 0.02 hides the effect: 2e-5)
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen(29), dtype=p.dtype) * 0.1)
    model.train(training)
    ref = reference_model(cfg, model)
    ref.train(training)
    row = torch.randint(0, 128, (1, 20), generator=gen(30))
    other = torch.randint(0, 128, (1, 37), generator=gen(31))
    batch = torch.cat([torch.cat([row, torch.zeros(1, 17, dtype=torch.long)], 1), other])
    pad = torch.ones(2, 37, dtype=torch.bool)
    pad[0, 20:] = False
    with torch.set_grad_enabled(training):
        alone = model(row, padding_mask=torch.ones(1, 20, dtype=torch.bool))
        padded = model(batch, padding_mask=pad)
        r_alone = ref(input_ids=row, attention_mask=torch.ones(1, 20, dtype=torch.long)).logits
        r_padded = ref(input_ids=batch, attention_mask=pad.long()).logits
    torch.testing.assert_close(padded[:1, :20], alone, rtol=0, atol=1e-10)  # fp64, same operations
    torch.testing.assert_close(r_padded[:1, :20], r_alone, rtol=0, atol=1e-10)
    torch.testing.assert_close(r_alone, alone, rtol=0, atol=1e-9)  # reference = library


@pytest.mark.usefixtures("dist")
def test_encoder_fixed_pass_with_activation_recompute_same_gradients():
    """Encoders run the fixed input's pass by itself; with train.recompute=full or selective it runs
    un-checkpointed (recompute off for that pass): the same loss and gradients as without recompute
    (W^Q, W^K of the fixed kind included; fp64)."""
    from megahash.accelerator import rng
    from megahash.config import load_config
    from megahash.models.megatron_model import build_model

    def grads(recompute):
        cfg = load_config(
            None,
            [
                "model.hidden_size=32",
                "model.num_layers=2",
                "model.num_heads=4",
                "model.ffn_hidden_size=64",
                "model.schedule=list:mha,rndembqk",
                "data.seq_length=24",
                "model.max_position_embeddings=24",
                "model.attention.options.fixed_seq_length=24",
                "model.arch=encoder",
                "train.objective=mlm",
                f"train.recompute={recompute}",
            ],
        )
        rng.seed_all(0)
        model = build_model(cfg, 128, dtype=torch.float64).train()
        tok = torch.randint(0, 128, (2, 16), generator=gen(40))
        pad = torch.ones(2, 16, dtype=torch.bool)
        pad[1, 9:] = False
        model.hidden_states(tok, padding_mask=pad).pow(2).mean().backward()
        return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}

    a = grads("none")
    assert any("linear_q" in n and a[n].abs().sum() > 0 for n in a)  # W^Q of the fixed kind trains
    for other in ("full", "selective"):
        b = grads(other)
        assert a.keys() == b.keys(), other
        for name in a:
            torch.testing.assert_close(a[name], b[name], rtol=0, atol=1e-12)  # fp64, same operations
