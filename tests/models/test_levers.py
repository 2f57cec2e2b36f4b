"""The compact-model levers (issue 44, docs/compact_models.md#levers), each against an independent form of what
it claims: the soft-capped, z-lossed chunked cross-entropy against autograd through the plain formula; the
embedding init std and learning rate; zero output projections (every layer the identity at init); the QK gain
(= the query norm's weight times the gain); ReLU squared against its formula. Export parity: tests/convert."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest
import torch

from conftest import MICRO
from megahash.accelerator import rng
from megahash.config import load_config
from megahash.errors import ConfigError

pytestmark = [pytest.mark.usefixtures("dist"), pytest.mark.numerics]
VOCAB = 256


def cfg_of(*extra):
    return load_config(
        None,
        [
            *MICRO,
            *extra,
        ],
    )


def build(*extra, seed: int = 0):
    from megahash.models.megatron_model import build_model

    rng.seed_all(seed)
    return build_model(cfg_of(*extra), VOCAB).eval()


def tokens(b: int = 2, s: int = 12, seed: int = 1):
    return torch.randint(5, VOCAB, (b, s), generator=torch.Generator().manual_seed(seed))


def reference_loss(hidden, weight, target, cap, z):
    """The plain formula on whole logits: CE of cap tanh(h W^T / cap) + z lse^2, differentiated by autograd."""
    logits = hidden @ weight.t()
    if cap:
        logits = cap * torch.tanh(logits / cap)
    lse = torch.logsumexp(logits, dim=-1)
    return torch.nn.functional.cross_entropy(logits, target, reduction="none") + z * lse**2


@pytest.mark.parametrize("cap,z", [(0.0, 0.0), (5.0, 0.0), (0.0, 1e-2), (3.0, 1e-1)])
def test_chunked_cross_entropy_with_softcap_and_z_loss_equals_autograd(cap, z):
    from megahash.models.chunked_ce import linear_cross_entropy

    g = torch.Generator().manual_seed(0)
    h = (torch.randn(37, 16, generator=g, dtype=torch.float64) * 2).requires_grad_()
    w = torch.randn(50, 16, generator=g, dtype=torch.float64).requires_grad_()
    y = torch.randint(0, 50, (37,), generator=g)
    up = torch.rand(37, generator=g, dtype=torch.float64)
    got = linear_cross_entropy(h, w, y, rows=8, cap=cap, z_coef=z)  # 5 chunks, the last one short
    dh, dw = torch.autograd.grad((got * up).sum(), (h, w))
    want = reference_loss(h, w, y, cap, z)
    rh, rw = torch.autograd.grad((want * up).sum(), (h, w))
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(dh, rh, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(dw, rw, rtol=1e-10, atol=1e-12)


def test_chunked_cross_entropy_levers_in_bf16_within_bf16_tolerance():
    from megahash.models.chunked_ce import linear_cross_entropy

    g = torch.Generator().manual_seed(0)
    h, w = torch.randn(40, 32, generator=g), torch.randn(64, 32, generator=g) * 0.3
    y = torch.randint(0, 64, (40,), generator=g)
    got = linear_cross_entropy(h.bfloat16(), w, y, rows=16, cap=4.0, z_coef=1e-3)
    torch.testing.assert_close(got, reference_loss(h, w, y, 4.0, 1e-3), rtol=3e-2, atol=3e-2)


def test_model_loss_and_logits_are_soft_capped_with_z_loss():
    """The model's training loss (chunked) = the CE of its (capped) logits + z lse^2, and |logits| < cap."""
    model = build("model.logit_softcap=2.0", "train.z_loss=0.01")
    model.output_weight().data.mul_(20)  # (tied) raw logits past the cap
    x = tokens()
    logits = model(x).float()
    assert 1.5 < logits.abs().max() <= 2.0
    loss = model(x, labels=x)
    lse = torch.logsumexp(logits, dim=-1)
    want = torch.nn.functional.cross_entropy(logits.transpose(1, 2), x, reduction="none") + 0.01 * lse**2
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-5)


def test_embed_init_std_draws_the_tables_only():
    plain, small = build(), build("model.embed_init_std=0.002")
    std = small.embedding.word_embeddings.weight.std().item()
    assert abs(std - 0.002) < 0.0002, std  # 8,192 draws: the std within 10%
    assert abs(plain.embedding.word_embeddings.weight.std().item() - 0.02) < 0.002
    rest = {k: v for k, v in small.state_dict().items() if not k.startswith("embedding.")}
    for k, v in plain.state_dict().items():  # the same draws for everything else
        if k in rest and v is not None and torch.is_tensor(v):
            torch.testing.assert_close(rest[k], v, rtol=0, atol=0)


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_embed_lr_gives_the_tables_their_own_peak(optimizer):
    """At the end of warmup the embedding table's group runs at train.embed_lr and every other at its own peak
    (train.lr, train.muon.lr); the table keeps its weight decay."""
    from megahash.training.lr_schedule import Schedule
    from megahash.training.muon import build_optimizer
    from megahash.training.param_groups import param_groups

    cfg = cfg_of("train.embed_lr=0.05", "train.lr=0.002", "train.warmup_steps=4", f"train.optimizer={optimizer}")
    model, t = build(), cfg.train
    opt = build_optimizer(model, t, param_groups(model, t), {})
    sched = Schedule(opt, t)
    sched.go_to(3)  # the last warmup step: every group at its peak
    table = model.embedding.word_embeddings.weight
    [group] = [g for g in opt.param_groups if any(p is table for p in g["params"])]
    assert group["lr"] == pytest.approx(0.05) and group["weight_decay"] == t.weight_decay
    assert len(group["params"]) == 1  # the tied table is the only embedding parameter of this model
    others = {round(g["lr"], 9) for g in opt.param_groups if g is not group}
    assert others == ({0.002, t.muon.lr} if optimizer == "muon" else {0.002})


def test_zero_init_proj_makes_every_layer_the_identity_at_init():
    """With the output projections at zero, the logits at init are final_norm(embedding) W^T."""
    model = build("model.zero_init_proj=true")
    names = [n for n, _ in model.named_parameters() if n.endswith(("linear_proj.weight", "linear_fc2.weight"))]
    assert len(names) == 4
    x = tokens()
    emb = model.embedding(x, None)
    want = model.logits(model.decoder.final_layernorm(emb)).transpose(0, 1)
    torch.testing.assert_close(model(x), want, rtol=1e-6, atol=1e-6)
    assert build().decoder.layers[0].mlp.linear_fc2.weight.abs().sum() > 0  # off by default


def test_qk_gain_equals_the_query_norm_weight_times_the_gain():
    gained = build("model.qk_norm=true", "model.qkv_bias=false", "model.qk_gain=1.7")
    plain = build("model.qk_norm=true", "model.qkv_bias=false")
    gains = [layer.self_attention.q_gain.weight for layer in gained.decoder.layers]
    assert all(g.shape == (4,) and torch.all(g == 1.7) for g in gains)  # one per head, 1-D: AdamW, no decay
    state = {k: v for k, v in gained.state_dict().items() if "q_gain" not in k}
    for k in state:
        if k.endswith("q_layernorm.weight"):
            state[k] = state[k] * 1.7
    plain.load_state_dict(state, strict=False)
    x = tokens()
    torch.testing.assert_close(gained(x), plain(x), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(gained(x), build("model.qk_norm=true", "model.qkv_bias=false")(x), atol=1e-3)


def test_relu2_mlp_is_relu_squared_with_two_matrices():
    model = build("model.mlp_activation=relu2")
    mlp = model.decoder.layers[0].mlp
    assert mlp.linear_fc1.weight.shape == (64, 32) and mlp.linear_fc1.bias is None
    x = torch.randn(5, 2, 32, generator=torch.Generator().manual_seed(0))
    want = torch.relu(x @ mlp.linear_fc1.weight.t()).square() @ mlp.linear_fc2.weight.t()
    torch.testing.assert_close(mlp(x)[0], want, rtol=1e-5, atol=1e-6)


def test_x0_mix_starts_as_the_plain_model():
    """(a_i, b_i) = (1, 0): the logits of the model without the lever, from the same draws."""
    mixed, plain = build("model.x0_mix=true"), build()
    assert torch.equal(mixed.decoder.residual.resid_lambdas, torch.ones(2))  # bit-exact: initial constants
    assert torch.equal(mixed.decoder.residual.x0_lambdas, torch.zeros(2))  # bit-exact: initial constants
    x = tokens()
    torch.testing.assert_close(mixed(x), plain(x), rtol=1e-6, atol=1e-6)


def test_x0_mix_and_unet_skips_equal_their_formula():
    """Five layers (two skips, the middle layer none), random scalars: the block's output against the mixing
    written out layer by layer ([Jordan24b] modded-nanogpt: the skip added before the x0 mix)."""
    from megahash.models.forward_state import ForwardState

    model = build("model.x0_mix=true", "model.unet_skips=true", "model.num_layers=5")
    mix = model.decoder.residual
    assert mix.skip_weights.shape == (2,) and torch.equal(
        mix.skip_weights, torch.ones(2)
    )  # bit-exact: initial constants
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for p in mix.parameters():
            p.copy_(torch.rand(p.shape, generator=g) + 0.5)
    a, b, w = mix.resid_lambdas, mix.x0_lambdas, mix.skip_weights
    x = tokens()
    emb = model.embedding(x, None)
    x0 = emb * torch.rsqrt(emb.pow(2).mean(-1, keepdim=True) + 1e-6)  # RMSNorm without a weight
    rotary = model.rotary_pos_emb(x.shape[1])

    def f(i, h):
        state = ForwardState(offset=0, tokens=x, document_ids=None, position_ids=None, decode=None)
        state.embeddings = emb
        return model.decoder.layers[i](
            hidden_states=h, attention_mask=None, rotary_pos_emb=rotary, inference_context=state
        )[0]

    o0 = f(0, a[0] * emb + b[0] * x0)
    o1 = f(1, a[1] * o0 + b[1] * x0)
    o2 = f(2, a[2] * o1 + b[2] * x0)
    o3 = f(3, a[3] * (o2 + w[0] * o1) + b[3] * x0)
    o4 = f(4, a[4] * (o3 + w[1] * o0) + b[4] * x0)
    want = model.decoder.final_layernorm(o4)
    torch.testing.assert_close(model.hidden_states(x), want, rtol=1e-5, atol=1e-6)


def test_residual_levers_under_full_recompute_give_the_same_gradients():
    """train.recompute=full re-runs each layer in backward: the mixing's scalars and every weight get the
    gradients of the plain pass."""

    def grads(recompute):
        model = build(
            "model.x0_mix=true", "model.unet_skips=true", "model.num_layers=4", f"train.recompute={recompute}"
        )
        with torch.no_grad():
            model.decoder.residual.x0_lambdas.fill_(0.3)
        model.train()
        model.hidden_states(tokens()).pow(2).mean().backward()
        return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}

    a, b = grads("none"), grads("full")
    assert a.keys() == b.keys() and {"decoder.residual.x0_lambdas", "decoder.residual.skip_weights"} <= a.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=1e-12)


def test_residual_levers_parameters_counted_in_closed_form_as_the_model_does():
    """`megahash params`: 2L scalars for the x0 mix, L // 2 for the skips (L = 5: 10 + 2), closed form = meta model."""
    from megahash.models.accounting import count_parameters
    from megahash.models.closed_form import closed_form_report

    over = ["model.num_layers=5"]
    plain = closed_form_report(cfg_of(*over), VOCAB)
    cfg = cfg_of(*over, "model.x0_mix=true", "model.unet_skips=true")
    closed, measured = closed_form_report(cfg, VOCAB), count_parameters(cfg, VOCAB)
    assert closed["residual_mix"] == measured["residual_mix"] == 12
    assert closed["total"] == measured["total"] == plain["total"] + 12


@pytest.mark.parametrize(
    "overrides,match",
    [
        (["model.qk_gain=1.5"], "qk_norm"),
        (["model.mlp_activation=gelu2"], "mlp_activation"),
        (["model.logit_softcap=-1"], "logit_softcap"),
        (["train.z_loss=1e-4", "model.head=hash-bits"], "vocabulary head"),
        (["train.embed_lr=-0.1"], "embed_lr"),
        (["model.embed_init_std=-1"], "embed_init_std"),
        (["model.mlp_activation=relu2", "model.layout=roberta", "model.arch=encoder"], "pre-norm"),
        (["model.x0_mix=true", "model.layout=roberta", "model.arch=encoder"], "x0_mix.*pre-norm"),
        (["model.unet_skips=true", "model.layout=roberta", "model.arch=encoder"], "unet_skips.*pre-norm"),
        (["model.unet_skips=true", "model.num_layers=1"], "num_layers >= 2"),
    ],
)
def test_lever_config_errors_name_the_key(overrides, match):
    with pytest.raises(ConfigError, match=match):
        cfg_of(*overrides)
