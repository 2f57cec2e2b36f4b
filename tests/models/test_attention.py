"""Attention kinds ([Xue25] ch. 3-4): parameter counts, causality, decoding, linear forms, TP parity.

Single-rank checks run in-process on a 1-rank gloo group; the TP=1/TP=2/TP=2+SP parity of every
kind runs once as two gloo processes (tests/models/attention_tp_worker.py).
"""

from __future__ import annotations

import json
import math
import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")

import _kinds
import pytest
import torch
import torch.nn.functional as F

from megahash import catalog
from megahash.accelerator import rng
from megahash.config import load_config
from megahash.models.forward_state import ForwardState

# from the registry: every kind that decodes incrementally / mixes tokens (a new kind joins by registering), each
# with the per-layer option settings its options class lists (_kinds.variants: swa+window=4, mha+gated, ...)
DECODER_KINDS = _kinds.variants(decodes=True)
VOCAB = 128


pytestmark = [pytest.mark.usefixtures("dist"), pytest.mark.numerics]  # one-rank world (conftest)


def make_cfg(schedule="uniform:mha", *extra, hidden=32, heads=4, layers=2):
    if ":" not in schedule:
        schedule = f"uniform:{schedule}"
    return load_config(
        None,
        [
            f"model.hidden_size={hidden}",
            f"model.num_layers={layers}",
            f"model.num_heads={heads}",
            "model.ffn_hidden_size=64",
            f"model.schedule={schedule}",
            "data.seq_length=16",
            "model.max_position_embeddings=64",
            "model.attention.options.fixed_seq_length=64",
            *extra,
        ],
    )


def build(cfg, dtype=torch.float64, seed=0):
    from megahash.models.attention import fixed_qk
    from megahash.models.megatron_model import build_model

    rng.seed_all(seed)
    model = build_model(cfg, VOCAB, dtype=dtype)
    if getattr(model, "fixed_qk", None) is not None and model.fixed_qk.source == "text":
        fixed_qk.set_fixed_tokens(model, [(7 * i + 5) % VOCAB for i in range(64)])
    return model


def build_attention(cfg, layer_number=1):
    """One attention module of the config's first layer kind, built like TransformerLayer does."""
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.utils import init_method_normal, scaled_init_method_normal

    from megahash.models import registry
    from megahash.models.megatron_model import transformer_config

    registry.load_kinds()
    config = transformer_config(cfg)
    config.init_method = init_method_normal(cfg.model.init_std)
    config.output_layer_init_method = scaled_init_method_normal(cfg.model.init_std, cfg.model.num_layers)
    from megahash.models.schedules import layer_options

    kind, options = registry.schedule_kinds(cfg)[0], layer_options(cfg)[0]  # the layer's kind and its own options
    return build_module(registry.attention_spec(cfg, kind, options), config=config, layer_number=layer_number)


def tokens(b=2, s=12, seed=0):
    return torch.randint(0, VOCAB, (b, s), generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------------ parameter counts


@pytest.mark.parametrize("n,d", [(4, 8), (2, 16), (8, 4), (12, 4)])
@pytest.mark.parametrize("kind", [v for v in _kinds.variants() if _kinds.kind(v) in _kinds.with_formula("qkv_params")])
def test_table_3_4_parameter_counts(kind, n, d):
    """Q/K/V parameters of the built module (everything but linear_proj, no biases) = the kind's own
    Table 3.4 formula (registered in its file; every kind with a ``qkv_params`` formula, with its options)."""
    from megahash.models.costs import attention_param_count

    cfg = make_cfg(kind, "model.qkv_bias=false", hidden=n * d, heads=n)
    module = build_attention(cfg)
    assert module.num_qkv_parameters() == attention_param_count(_kinds.kind(kind), n, d, **_kinds.options(kind)), kind
    names = {name.split(".")[0] for name, _ in module.named_parameters()}
    assert "linear_proj" in names  # the excluded output projection exists, d_m x (heads * d)
    assert module.linear_proj.weight.shape[0] == n * d


def test_table_3_4_counts_with_bias_and_gqa():
    from megahash.models.costs import attention_param_count

    n, d = 4, 8
    module = build_attention(make_cfg("mha", "model.num_query_groups=2", hidden=n * d, heads=n))
    assert module.num_qkv_parameters() == attention_param_count("gqa", n, d, 2) + (n + 2 * 2) * d  # + q/k/v biases
    mhe = build_attention(make_cfg("mhe-mul", hidden=n * d, heads=n))
    assert mhe.num_qkv_parameters() == attention_param_count("mhe-mul", n, d) + 3 * d  # + seed biases


@pytest.mark.parametrize(
    "extra", [(), ("model.qkv_bias=false",), ("model.num_query_groups=2",), ("model.arch=encoder",)]
)
def test_deconstructed_kinds_parameter_matched(extra):
    """Chapter-4 kinds have exactly the standard sublayer's parameters, except mlp whose residual
    is mlp_param_residual (|r| <= (3 d_m + 2) n / 2 from rounding its width to a multiple of n)."""
    from megahash.models.attention.mlp import mlp_param_residual

    def total(kind):
        return sum(p.numel() for p in build_attention(make_cfg(kind, *extra, hidden=48, heads=4)).parameters())

    ref = total("mha")
    for kind in ("approx", "nonapprox", "rndembqk", "fixedseqqk", "staticembqk"):
        assert total(kind) == ref, kind
    cfg = make_cfg("mlp", *extra, hidden=48, heads=4)
    g = cfg.model.num_query_groups or 4
    residual = mlp_param_residual(48, 4, g, 12, cfg.model.qkv_bias)
    assert total("mlp") - ref == residual
    assert abs(residual) <= (3 * 48 + 2) * 4 / 2
    # the 500M config (d_m 896, 14 heads, q/k/v biases): width 1190, residual -12,852 per sublayer (-0.40%)
    assert mlp_param_residual(896, 14, 14, 64, True) == -12852


# ------------------------------------------------------------------------ causality & decoding


@pytest.mark.parametrize("schedule", DECODER_KINDS + ["hybrid:rndembqk:even", "list:nonapprox,staticembqk"])
def test_no_future_leakage_and_incremental_decoding(schedule):
    """Through the whole MegahashLM: changing tokens t+1.. leaves positions <= t unchanged; decoding
    (prefill 5 tokens, then one at a time) equals the full forward; caches have the documented size."""
    from megahash.models import costs
    from megahash.models.megatron_model import DecodeState

    model = build(make_cfg(schedule)).eval()
    tok = tokens()
    t = 6
    changed = tok.clone()
    changed[:, t + 1 :] = (changed[:, t + 1 :] + 1) % VOCAB
    with torch.no_grad():
        full = model.hidden_states(tok)
        other = model.hidden_states(changed)
        # bit-exact: one path (same kernels and shapes); masked future positions add exact zeros
        assert torch.equal(full[: t + 1], other[: t + 1])
        if ":" in schedule or catalog.caps("attention", _kinds.kind(schedule)).mixes_tokens:
            assert (full[t + 1 :] - other[t + 1 :]).abs().max() > 1e-3
        state = DecodeState(len(model.decoder.layers))
        parts = [model.hidden_states(tok[:, :5], decode_state=state)]
        parts += [model.hidden_states(tok[:, i : i + 1], decode_state=state) for i in range(5, tok.shape[1])]
    torch.testing.assert_close(torch.cat(parts), full, rtol=0, atol=1e-10)
    if ":" not in schedule and not catalog.caps("attention", _kinds.kind(schedule)).fixed_input:
        n, d_h, b, L = 4, 8, tok.shape[0], tok.shape[1]
        # the kind's own formula (groups: its own; the layer's options: a window bounds the cache)
        expected = costs.cache_elements(_kinds.kind(schedule), b, L, n, d_h, **_kinds.options(schedule))
        assert all(sum(v.numel() for v in c.values()) == expected for c in state.caches)


@pytest.mark.parametrize("kind", ["rndembqk", "fixedseqqk"])
def test_fixed_maps_frozen(kind):
    """Frozen maps (FixedInput.freeze) give the same outputs without carrying the fixed sequence, and
    the decode cache is the values plus one set of fixed keys shared by the batch: (B + 1) L d, as
    Table 4.8."""
    from megahash.models import costs
    from megahash.models.megatron_model import DecodeState

    model = build(make_cfg(kind)).eval()
    tok = tokens()
    with torch.no_grad():
        ref = model.hidden_states(tok)
        model.fixed_qk.freeze(model, 32)
        assert model.fixed_qk.frozen()
        frozen = model.hidden_states(tok)
        state = DecodeState(2)
        parts = [model.hidden_states(tok[:, :5], decode_state=state)]
        parts += [model.hidden_states(tok[:, i : i + 1], decode_state=state) for i in range(5, tok.shape[1])]
    torch.testing.assert_close(frozen, ref, rtol=0, atol=1e-10)
    torch.testing.assert_close(torch.cat(parts), ref, rtol=0, atol=1e-10)
    b, L = tok.shape
    assert state.caches[0]["k"].shape[1] == 1  # one set of fixed keys shared by the batch
    cache = sum(v.numel() for v in state.caches[0].values())
    assert cache == costs.cache_elements(kind, b, L, 4, 8, frozen=True)
    model.train()
    assert not model.fixed_qk.frozen()  # training drops the frozen maps


def test_fixed_input_is_deterministic_and_stored():
    a, b = build(make_cfg("rndembqk"), seed=1), build(make_cfg("rndembqk"), seed=2)
    assert torch.equal(
        a.fixed_qk.epsilon, b.fixed_qk.epsilon
    )  # bit-exact: the same seeded draws, stored (copied, not computed); from model.attention.options.random_seed
    assert "fixed_qk.epsilon" in a.state_dict()
    assert abs(a.fixed_qk.epsilon.std().item() - 0.02) < 2e-3  # std = model.init_std
    c = build(make_cfg("fixedseqqk"))
    assert "fixed_qk.tokens" in c.state_dict() and c.fixed_qk.length() == 64


def test_fixed_qk_gets_gradients_through_the_fixed_pass():
    """W^Q, W^K of rndembqk are trained only through the fixed input's pass (eq. 4.10)."""
    model = build(make_cfg("rndembqk"), dtype=torch.float32)
    model.hidden_states(tokens()).pow(2).mean().backward()
    for module in model.attention_modules():
        for lin in (module.linear_q, module.linear_k, module.linear_v):
            assert lin.weight.grad is not None and lin.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("schedule", ["uniform:rndembqk", "list:fixedseqqk,mha"])
def test_separate_fixed_pass_equals_the_fixed_sequence_in_the_batch(schedule, monkeypatch):
    """Training runs the fixed sequence as its own checkpointed pass (FixedInput.run_alone): loss and
    every gradient equal those of the fixed sequence riding as one more batch element (fp64)."""
    from megahash.models.attention.fixed_qk import FixedInput

    results = []
    for separate in (True, False):
        model = build(make_cfg(schedule))
        model.train()
        if not separate:
            monkeypatch.setattr(FixedInput, "separate", lambda self, model: False)
        assert model.fixed_qk.separate(model) is separate
        out = model.hidden_states(tokens())
        out.pow(2).mean().backward()
        results.append((out.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
    (o1, g1), (o2, g2) = results
    torch.testing.assert_close(o1, o2, rtol=0, atol=1e-12)
    assert sorted(g1) == sorted(g2)
    for n in g1:
        torch.testing.assert_close(g1[n], g2[n], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("kind", _kinds.variants(encoder=True, decodes=True))
def test_encoder_padding_and_bidirectional(kind):
    """Encoders: padded tokens do not change valid positions; mixing kinds see later tokens."""
    model = build(make_cfg(kind, "model.arch=encoder")).eval()
    tok = tokens()
    pad = torch.ones_like(tok, dtype=torch.bool)
    pad[1, 8:] = False
    other = tok.clone()
    other[1, 8:] = (other[1, 8:] + 3) % VOCAB
    later = tok.clone()
    later[:, 7] = (later[:, 7] + 3) % VOCAB
    with torch.no_grad():
        h = model.hidden_states(tok, padding_mask=pad)
        h_pad = model.hidden_states(other, padding_mask=pad)
        h_later = model.hidden_states(later, padding_mask=pad)
    torch.testing.assert_close(h_pad[:8, 1], h[:8, 1], rtol=0, atol=1e-10)
    torch.testing.assert_close(h_pad[:, 0], h[:, 0], rtol=0, atol=1e-10)
    if catalog.caps("attention", _kinds.kind(kind)).mixes_tokens:
        assert (h_later[6] - h[6]).abs().max() > 1e-4  # position 6 sees position 7
        if not _kinds.options(kind):  # (a window of a few keys: not position 0)
            assert (h_later[0] - h[0]).abs().max() > 1e-4  # position 0 sees position 7


# ------------------------------------------------------------------------ formulas


@pytest.mark.parametrize("mup", [(), ("model.mup_base_hidden_size=8",)], ids=["standard", "mup"])
def test_mha_matches_megatron_self_attention(mup):
    """megahash mha = megatron-core SelfAttention with the same weights (fused QKV layout converted); under muP
    (m = 4) both take the score scale sqrt(d_0)/d_h (megatron's through ``TransformerConfig.softmax_scale``)."""
    cfg = make_cfg("mha", "model.num_query_groups=2", *mup)
    ours = build_attention(cfg)
    ref = build_attention(make_cfg("mha-megatron", "model.num_query_groups=2", *mup))
    n, g, d = 4, 2, 8
    rep = n // g
    wq = ours.linear_q.weight.view(g, rep * d, -1)
    wkv = ours.linear_kv.weight.view(g, 2 * d, -1)
    bq = ours.linear_q.bias.view(g, rep * d)
    bkv = ours.linear_kv.bias.view(g, 2 * d)
    with torch.no_grad():
        ref.linear_qkv.weight.copy_(torch.cat([wq, wkv], 1).reshape(-1, wq.shape[-1]))
        ref.linear_qkv.bias.copy_(torch.cat([bq, bkv], 1).reshape(-1))
        ref.linear_proj.weight.copy_(ours.linear_proj.weight)
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    rot = RotaryEmbedding(kv_channels=d, rotary_percent=1.0, use_cpu_initialization=True)(10)
    x = torch.randn(10, 2, 32)
    torch.testing.assert_close(
        ours(x, None, rotary_pos_emb=rot)[0], ref(x, None, rotary_pos_emb=rot)[0], rtol=1e-5, atol=1e-6
    )


def _sdpa(q, k, v, causal=True):
    """q, k, v [s, b, h, d] -> [s, b, h*d] (plain softmax attention reference)."""
    q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    o = torch.softmax(s, -1) @ v
    return o.permute(2, 0, 1, 3).reshape(o.shape[2], o.shape[0], -1)


@pytest.mark.parametrize("kind", ["mhe-add", "mhe-mul", "el-att", "skv", "sha", "nonapprox", "approx"])
def test_module_matches_formula(kind):
    """Each module's output before linear_proj equals its equation written out directly
    (eq. 3.5 MHE-ADD/MUL, EL-ATT, SKV, SHA, eq. 4.7-4.8 Non-approximate, eq. 4.6 Taylor)."""
    cfg = make_cfg(kind, "model.qkv_bias=false")
    m = build_attention(cfg).double()
    x = torch.randn(9, 2, 32, dtype=torch.float64)
    n, d = 4, 8
    got = m.mix(x, None, None, ForwardState())
    if kind in ("mhe-add", "mhe-mul"):
        q, k, v = (x @ w.T for w in m.linear_qkv.weight.chunk(3, 0))
        es = [m.emb_q.weight, m.emb_k.weight, m.emb_v.weight]
        psi = (lambda a, e: a[:, :, None] + e) if kind == "mhe-add" else (lambda a, e: a[:, :, None] * (e + 1))
        want = _sdpa(*(psi(a, e) for a, e in zip((q, k, v), es)))
    elif kind == "el-att":
        q = (x @ m.linear_q.weight.T).view(9, 2, n, d)
        kv = x.view(9, 2, n, d)
        want = _sdpa(q, kv, kv)
    elif kind == "skv":
        q = (x @ m.linear_q.weight.T).view(9, 2, n, d)
        kv = (x @ m.linear_kv.weight.T).view(9, 2, n, d)
        want = _sdpa(q, kv, kv)
    elif kind == "sha":
        q, k, v = ((x @ w.T).view(9, 2, 1, d) for w in m.linear_qkv.weight.chunk(3, 0))
        want = _sdpa(q, k, v)
    else:
        q = (x @ m.linear_q.weight.T).view(9, 2, n, d)
        kv = (x @ m.linear_kv.weight.T).view(9, 2, n, 2, d)
        k, v = kv[..., 0, :], kv[..., 1, :]
        if kind == "nonapprox":
            q = torch.nn.functional.silu(q)
            s = (q * k).sum(-1) / math.sqrt(d)  # [s, b, h], one score per key position
            w = torch.exp(s)
            want = (torch.cumsum(w[..., None] * v, 0) / torch.cumsum(w, 0)[..., None]).reshape(9, 2, n * d)
        else:  # approx without RoPE (rotary_pos_emb=None here)
            a = (q.permute(1, 2, 0, 3) @ k.permute(1, 2, 3, 0)) / math.sqrt(d)
            a = (1 + a + a * a / 2) * torch.ones(9, 9, dtype=torch.bool).tril()
            o = (a @ v.permute(1, 2, 0, 3)) / a.sum(-1, keepdim=True)
            want = o.permute(2, 0, 1, 3).reshape(9, 2, n * d)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


GDN_OPTIONS = [  # value heads twice as wide, 2 convolution taps, chunks of 4 (the loop over chunks in a model)
    "model.attention.options.expand_v=2",
    "model.attention.options.conv_size=2",
    "model.attention.options.chunk_size=4",
]


@pytest.mark.parametrize(
    "options", [[], GDN_OPTIONS, ["model.attention.options.conv_size=0"]], ids=["default", "options", "no-conv"]
)
def test_gated_deltanet_matches_its_equations(options):
    """gated-deltanet's output before linear_proj = fla's / megatron-core's GatedDeltaNet layer written out:
    the projections, the short causal convolution (torch's conv1d) and SiLU, L2-normalised q, k,
    g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b), the gated delta rule by megatron-core's
    plain-torch ``torch_chunk_gated_delta_rule`` (fp32: 2e-5 of the scale), RMSNorm(o) * SiLU(z); and its
    parameters are that layer's: d_m n (2 d_k + 2 d_v + 2) + n (2 d_k + d_v) K + 2n + d_v."""
    from megatron.core.ssm.gated_delta_net import torch_chunk_gated_delta_rule

    from megahash.ops.gated_delta.chunk import l2norm

    m = build_attention(make_cfg("gated-deltanet", "model.qkv_bias=false", *options)).double()
    n, dk, dv, K, s = 4, 8, m.d_v, m.conv_size, 11
    assert dv == (16 if options == GDN_OPTIONS else 8) and K == (2 if options == GDN_OPTIONS else 4 * bool(K))
    assert m.num_qkv_parameters() == 32 * n * (2 * dk + 2 * dv + 2) + n * (2 * dk + dv) * K + 2 * n + dv
    x = torch.randn(s, 2, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        got = m.mix(x, None, None, ForwardState())
        proj = (x @ m.linear_in.weight.T).view(s, 2, n, -1)
        qkv, z, a, b = proj.split([2 * dk + dv, dv, 1, 1], dim=-1)
        qkv = qkv.reshape(s, 2, -1)
        if K:
            w = m.conv.weight.view(-1, 1, K)
            qkv = F.conv1d(F.pad(qkv.permute(1, 2, 0), (K - 1, 0)), w, groups=w.shape[0]).permute(2, 0, 1)
        q, k, v = F.silu(qkv).view(s, 2, n, -1).split([dk, dk, dv], dim=-1)
        g = -m.A_log.weight.exp() * F.softplus(a.squeeze(-1) + m.dt_bias.weight)
        beta = torch.sigmoid(b.squeeze(-1))
        o, _ = torch_chunk_gated_delta_rule(*(t.transpose(0, 1) for t in (l2norm(q), l2norm(k), v, g, beta)))
        o = o.transpose(0, 1).double()
        want = F.rms_norm(o, (dv,), m.o_norm.weight, m.o_norm.eps) * F.silu(z)
    torch.testing.assert_close(got, want.reshape(s, 2, n * dv), rtol=0, atol=2e-5 * want.abs().max().item())


def test_gated_deltanet_options_decode_and_keep_documents_apart():
    """With value heads twice as wide, 2 taps and chunks of 4: decoding (prefill 5 tokens, then one at a
    time: the state and the convolution's inputs carried) = the full forward, and a packed row = each
    document alone (the state and the convolution window restart at each document start), fp64."""
    from megahash.data import documents
    from megahash.models.megatron_model import DecodeState

    model = build(make_cfg("gated-deltanet", *GDN_OPTIONS)).eval()
    tok = tokens(s=14)
    with torch.no_grad():
        full = model.hidden_states(tok)
        state = DecodeState(len(model.decoder.layers))
        parts = [model.hidden_states(tok[:, :5], decode_state=state)]
        parts += [model.hidden_states(tok[:, i : i + 1], decode_state=state) for i in range(5, tok.shape[1])]
        torch.testing.assert_close(torch.cat(parts), full, rtol=0, atol=1e-10)
        doc = torch.tensor([[0] * 3 + [1] * 6 + [2] * 5, [0] * 9 + [1] * 5])
        packed = model.hidden_states(tok, document_ids=doc, position_ids=documents.position_ids(doc))
        for row, bounds in ((0, (0, 3, 9, 14)), (1, (0, 9, 14))):
            for a, b in zip(bounds[:-1], bounds[1:]):
                alone = model.hidden_states(tok[row : row + 1, a:b])
                torch.testing.assert_close(packed[a:b, row : row + 1], alone, rtol=0, atol=1e-10)


def test_gated_deltanet_refuses_what_it_cannot_do():
    """One-line errors: an encoder (causal only), a value width expand_v x d_h that is not an integer, a
    non-positive expand_v."""
    from megahash.errors import ConfigError
    from megahash.models.schedules import check_kinds

    with pytest.raises(ConfigError, match="causal only"):  # the config check, before torch
        check_kinds(make_cfg("hybrid:gated-deltanet:even", "model.arch=encoder"))
    with pytest.raises(ConfigError, match="causal only"):  # and the kind itself
        build(make_cfg("hybrid:gated-deltanet:even", "model.arch=encoder"))
    with pytest.raises(ConfigError, match="expand_v=1.3"):
        build_attention(make_cfg("gated-deltanet", "model.attention.options.expand_v=1.3"))
    with pytest.raises(ConfigError, match="expand_v"):
        make_cfg("gated-deltanet", "model.attention.options.expand_v=0")


def test_approx_chunk_gradients_equal_autograd_of_recurrent_form():
    """approx's chunked kernel (batched GEMMs, state carried by a cumulative sum over chunks): its
    gradients w.r.t. q, k, v (GQA broadcast, one chunk, several, a padded last chunk) equal plain
    autograd through the token-by-token recurrence (fp64), and torch.autograd.gradcheck passes."""
    from megahash.ops.taylor.chunk import taylor_causal
    from megahash.ops.taylor.recurrent import taylor_recurrent

    g = torch.Generator().manual_seed(1)
    q0 = torch.randn(2, 2, 3, 12, 4, dtype=torch.float64, generator=g)
    k0 = torch.randn(2, 2, 1, 12, 4, dtype=torch.float64, generator=g)
    v0 = torch.randn(2, 2, 1, 12, 5, dtype=torch.float64, generator=g)
    w = torch.randn(2, 2, 3, 12, 5, dtype=torch.float64, generator=g)

    def grads(fn):
        q, k, v = (t.clone().requires_grad_(True) for t in (q0, k0, v0))
        (fn(q, k, v) * w).sum().backward()
        return q.grad, k.grad, v.grad

    want = grads(lambda q, k, v: taylor_recurrent(q, k, v)[0])
    for chunk in (12, 5, 4):
        got = grads(lambda q, k, v: taylor_causal(q, k, v, chunk)[0])
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)
    args = tuple(t[:1, :1, :, :6].clone().requires_grad_(True) for t in (q0, k0, v0))
    assert torch.autograd.gradcheck(lambda q, k, v: taylor_causal(q, k, v, 4)[0], args)


def test_linear_forms_parallel_equals_recurrent():
    """approx and nonapprox: parallel (masked matrix), chunked/scan and recurrent forms agree (fp64),
    including GQA broadcasting and a carried state; nonapprox stays finite for huge scores."""
    from megahash.ops.cumsoftmax.chunk import cumsoftmax_causal
    from megahash.ops.cumsoftmax.naive import naive_cumsoftmax
    from megahash.ops.cumsoftmax.recurrent import cumsoftmax_recurrent
    from megahash.ops.taylor.chunk import taylor_causal
    from megahash.ops.taylor.feature_map import taylor_features, taylor_kernel
    from megahash.ops.taylor.recurrent import taylor_recurrent

    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 2, 3, 20, 6, dtype=torch.float64, generator=g)  # [b, groups, rep, L, d]
    k = torch.randn(2, 2, 1, 20, 6, dtype=torch.float64, generator=g)
    v = torch.randn(2, 2, 1, 20, 5, dtype=torch.float64, generator=g)
    # the feature map realises the kernel 1 + s + s^2/2
    torch.testing.assert_close(taylor_features(q) @ taylor_features(k).transpose(-1, -2), taylor_kernel(q, k))
    par, _ = taylor_causal(q, k, v, chunk=20)
    rec, rstate = taylor_recurrent(q, k, v)
    for chunk in (1, 3, 7):
        out, state = taylor_causal(q, k, v, chunk=chunk, need_state=True)
        torch.testing.assert_close(out, par, rtol=0, atol=1e-10)
        torch.testing.assert_close(state[0], rstate[0], rtol=0, atol=1e-10)
    torch.testing.assert_close(rec, par, rtol=0, atol=1e-10)
    out1, st = taylor_causal(q[..., :11, :], k[..., :11, :], v[..., :11, :], 4, need_state=True)
    out2, _ = taylor_causal(q[..., 11:, :], k[..., 11:, :], v[..., 11:, :], 4, state=st)
    torch.testing.assert_close(torch.cat([out1, out2], -2), par, rtol=0, atol=1e-10)

    s = (q * k).sum(-1) / math.sqrt(6)
    par = naive_cumsoftmax(s, v)
    rec, rstate = cumsoftmax_recurrent(s, v)
    torch.testing.assert_close(rec, par, rtol=0, atol=1e-10)
    out, state = cumsoftmax_causal(s, v, need_state=True)
    torch.testing.assert_close(out, par, rtol=0, atol=1e-10)
    for a, b in zip(state, rstate):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-10)
    for cut in (1, 7, 19):  # a carried state (prefill, then continue) gives the same outputs and state
        out1, st = cumsoftmax_causal(s[..., :cut], v[..., :cut, :], need_state=True)
        out2, st = cumsoftmax_causal(s[..., cut:], v[..., cut:, :], state=st, need_state=True)
        torch.testing.assert_close(torch.cat([out1, out2], -2), par, rtol=0, atol=1e-10)
        for a, b in zip(st, rstate):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-10)
    big = s * 400  # e^{s} overflows fp64 without the running maximum
    out, _ = cumsoftmax_causal(big, v)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, naive_cumsoftmax(big, v), rtol=0, atol=1e-10)
    out32, _ = cumsoftmax_causal(big.float(), v.float())
    assert torch.isfinite(out32).all()


def test_approx_chunked_module_matches_parallel():
    """model.attention.options.chunk_size switches approx to the chunked linear form: same outputs."""
    tok = tokens(s=16)
    with torch.no_grad():
        a = build(make_cfg("approx")).eval().hidden_states(tok)
        b = build(make_cfg("approx", "model.attention.options.chunk_size=4")).eval().hidden_states(tok)
        c = build(make_cfg("nonapprox", "model.attention.options.chunk_size=16")).eval().hidden_states(tok)
        d = build(make_cfg("nonapprox", "model.attention.options.chunk_size=3")).eval().hidden_states(tok)
    torch.testing.assert_close(a, b, rtol=0, atol=1e-10)
    torch.testing.assert_close(c, d, rtol=0, atol=1e-10)


def test_staticembqk_uses_layer0_embeddings():
    """Q, K come from the layer-0 embeddings, not from the layer input: with V reading only the first
    8 input dims, changing the other dims of the layer input leaves the output unchanged."""
    cfg = make_cfg("staticembqk", "model.qkv_bias=false")
    m = build_attention(cfg).double()
    e = torch.randn(7, 2, 32, dtype=torch.float64)
    x = torch.randn(7, 2, 32, dtype=torch.float64)
    state = ForwardState(embeddings=e)
    with torch.no_grad():
        m.linear_v.weight.zero_()
        m.linear_v.weight[:, :8] = torch.eye(8).repeat(4, 1)  # V = first 8 input dims per head
        a = m.mix(x, None, None, state)
        b = m.mix(torch.cat([x[..., :8], torch.randn(7, 2, 24, dtype=torch.float64)], -1), None, None, state)
    torch.testing.assert_close(a, b)


def test_unknown_kind_error_names_the_close_match():
    from megahash.errors import ConfigError
    from megahash.models import registry

    registry.load_kinds()
    with pytest.raises(ConfigError, match="rndembqk"):
        registry.schedule_kinds(make_cfg("hybrid:rndemqk:even"))


# ------------------------------------------------------------------------ tensor parallel


TP_CASES = DECODER_KINDS + [
    "mha@g2",
    "gated-deltanet@chunk",
    "approx@chunk",
    "approx-thesis@chunk",
    "approx@f4",
    "mha@qknorm",
    "nonapprox@qknorm",
    "hybrid:rndembqk:even",
    "mha@encoder",
    "approx@encoder",
    "approx-thesis@encoder",
    "nonapprox@encoder",
    "rndembqk@encoder",
    "mha@roberta",
    "mhe-mul@roberta",
    "approx-thesis@roberta",
    "mha@ngram",
    "mha@resid",  # model.x0_mix + model.unet_skips: scalars replicated over TP, summed under SP
    "mhe-mul@resid",
    "approx@encoder@resid",
    "mha@vemb",  # model.value_embeds: tables and gains replicated over TP, each rank adding its heads' columns
    "mha@g2@vemb",  # GQA: the two key/value groups split over TP
    "mqa@vemb",  # MQA: the one group replicated over TP
    "mhe-add@vemb",
    "mha@encoder@vemb",
]


@pytest.mark.multiprocess
def test_tp2_parity_all_kinds(tmp_path):
    """TP=1 vs TP=2 vs TP=2+SP, same seed (megatron's CPU init draws the master weight, ours too):
    equal loss and global gradient norm for every kind (fp64), encoders included (megatron's MLP
    linear_fc2 bias under SP gets its gradient summed over TP by the model). The TP=1 model equals
    the kinds' plain-torch references (the code of the HF export): logits and every gradient."""
    from conftest import local_world

    out = tmp_path / "tp.json"
    worker = os.path.join(os.path.dirname(__file__), "attention_tp_worker.py")
    done = local_world([sys.executable, worker, str(out), ",".join(TP_CASES)], 2, timeout=300)
    assert all(status == 0 for status, _ in done), "\n".join(log[-3000:] for _, log in done)
    results = json.loads(out.read_text())
    for case, r in results.items():
        ref = r["tp1"]
        for setting in ("tp2", "tp2sp"):
            got = r[setting]
            # megatron's vocab_parallel_cross_entropy computes in fp32: allow one fp32 ulp
            assert abs(got["loss"] - ref["loss"]) <= 1.2e-7 * abs(ref["loss"]), (case, setting, got, ref)
            # the last two 0 without residual mixing, value embeddings
            for key in ("grad_sq", "attn_grad_sq", "resid_grad_sq", "vemb_grad_sq"):
                assert abs(got[key] - ref[key]) <= 1e-7 * ref[key], (case, setting, key, got, ref)
        assert (r["tp1"]["resid_grad_sq"] > 0) == case.endswith("@resid"), (case, r["tp1"])
        assert (r["tp1"]["vemb_grad_sq"] > 0) == case.endswith("@vemb"), (case, r["tp1"])
        plain = r["reference"]
        assert plain["params"] > 0 and plain["logit_diff"] < 1e-10 and plain["grad_rel"] < 1e-8, (case, plain)


@pytest.mark.parametrize(
    "schedule",
    ["list:rndembqk,approx,nonapprox,mhe-mul", "list:mqa,sha,el-att,mlp", "list:staticembqk,approx-thesis,skv,mhe-add"],
)
def test_full_recompute_gives_the_same_gradients(schedule):
    """train.recompute=full re-runs each layer in backward and train.recompute=selective each layer's
    token mixing (the forward's state handed back to it): gradients are unchanged."""

    def grads(recompute):
        model = build(make_cfg(schedule, f"train.recompute={recompute}", layers=4))
        model.hidden_states(tokens()).pow(2).mean().backward()
        return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}

    a = grads("none")
    # staticembqk refuses full recompute (one-line ConfigError): its layer-0 embeddings come from the context
    for other in ("selective",) if "staticembqk" in schedule else ("full", "selective"):
        b = grads(other)
        assert a.keys() == b.keys()
        for name in a:
            torch.testing.assert_close(a[name], b[name], rtol=0, atol=1e-12)


def test_recompute_under_bf16_autocast_gives_the_same_gradients():
    """train.precision=bf16 (fp32 weights, compute under autocast) with train.recompute: megatron's checkpoint recomputes
    in backward, outside the forward's autocast, and the recomputed layer raised (bf16 activations, fp32 weights:
    "expected m1 and m2 to have the same dtype"). Now it recomputes in the forward's autocast: the gradients of the
    plain pass within bf16's tolerance (policy.compute_tolerance, of each gradient's scale: the recomputed pass sums
    the bf16 gradients of the residual stream in another order)."""
    from megahash.accelerator import policy

    def grads(recompute):
        model = build(make_cfg("list:mha,rndembqk", f"train.recompute={recompute}"), dtype=torch.float32)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model.hidden_states(tokens()).float().pow(2).mean()
        loss.backward()
        return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}

    a = grads("none")
    for other in ("full", "selective"):
        b = grads(other)
        assert a.keys() == b.keys()
        for name in a:
            scale = a[name].abs().max().item()
            torch.testing.assert_close(a[name], b[name], rtol=0, atol=policy.compute_tolerance("bf16") * scale)


def test_selective_recompute_keeps_less_for_backward():
    """train.recompute=selective: the attention sublayers' projections, scores and kernels are not kept
    for backward (bytes saved by autograd, distinct storages, fall)."""

    def saved_bytes(recompute):
        model = build(make_cfg("uniform:mha", f"train.recompute={recompute}", layers=2))
        seen = {}

        def pack(t):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model.hidden_states(tokens()).pow(2).mean()
        return sum(seen.values()), loss

    none, _ = saved_bytes("none")
    selective, _ = saved_bytes("selective")
    assert selective < 0.8 * none, (selective, none)
