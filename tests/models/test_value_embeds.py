"""``model.value_embeds`` (issue 44, docs/compact_models.md#levers; megahash/models/value_embeds.py): modded-nanogpt's
value embeddings against independent facts. A sequence of one repeated token adds the same row c to every value,
and softmax attention's rows sum to one, so each fed layer's mixing output moves by exactly c = lambda_i E_k[t]
(per value head) and the others not at all; gains at zero give the plain model (the tables drawn on a forked RNG);
full recompute, the optimizer groups, the parameter count and the refusals. TP/SP parity: tests/models/test_attention.py
(cases ``@vemb``); export: tests/convert/test_convert.py; bf16, resume: tests/training/test_bf16.py (``levers``)."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import subprocess
import sys

import pytest
import torch

from conftest import MICRO
from megahash.accelerator import rng
from megahash.config import load_config
from megahash.errors import ConfigError

pytestmark = [pytest.mark.usefixtures("dist"), pytest.mark.numerics]
VOCAB = 256
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def cfg_of(*extra):
    return load_config(None, [*MICRO, *extra])


def build(*extra, seed: int = 0):
    from megahash.models.megatron_model import build_model

    rng.seed_all(seed)
    return build_model(cfg_of(*extra), VOCAB).eval()


def tokens(b: int = 2, s: int = 12, seed: int = 1):
    return torch.randint(5, VOCAB, (b, s), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(
    "kind,extra",
    [("mha", []), ("gqa", ["model.num_query_groups=2"]), ("mqa", []), ("mhe-add", []), ("mhe-mul", [])],
)
def test_a_repeated_token_moves_each_fed_layer_by_its_gain_times_the_row(kind, extra):
    """Four layers, one table (layers 0 and 3), gains 0.7 and -1.3: attention(q, k, v + c) = attention(q, k, v) + c
    for a row c shared by every position (softmax rows sum to 1), c the table's row of the token, per value head
    (a query head reads its key/value group's); layers 1 and 2 unchanged."""
    from megahash.models.forward_state import ForwardState

    model = build("model.num_layers=4", "model.value_embeds=1", f"model.schedule=uniform:{kind}", *extra)
    ve = model.value_embeds
    with torch.no_grad():
        ve.gains.copy_(torch.tensor([0.7, -1.3]))
    t = torch.full((2, 12), 17)
    x = torch.randn(12, 2, 32, generator=torch.Generator().manual_seed(2))
    rotary = model.rotary_pos_emb(12)
    n, d_h = 4, 8
    groups = {"mha": 4, "gqa": 2, "mqa": 1}.get(kind, 4)  # MHE: every head has its own values
    row = ve.tables[0].weight[17].detach().view(groups, d_h)
    per_head = row[torch.arange(n) // (n // groups)].reshape(n * d_h)  # query head h reads group h // (n / g)
    for i, layer in enumerate(model.decoder.layers):
        attn = layer.self_attention
        plain = attn.mix(x, None, rotary, ForwardState(tokens=t))
        fed = attn.mix(x, None, rotary, ForwardState(tokens=t, value_embeds=ve))
        gain = {0: 0.7, 3: -1.3}.get(i, 0.0)
        torch.testing.assert_close(fed - plain, (gain * per_head).expand_as(plain), rtol=1e-5, atol=1e-6)


def test_gains_at_zero_are_the_plain_model_and_the_other_weights_its_draws():
    """The tables are drawn on a forked RNG: every other weight is the plain model's; with the gains at zero the
    logits are the plain model's too."""
    fed, plain = build("model.value_embeds=1"), build()
    weights = dict(plain.named_parameters())
    for name, p in fed.named_parameters():
        if not name.startswith("value_embeds."):
            torch.testing.assert_close(p, weights[name], rtol=0, atol=0)
    torch.testing.assert_close(fed.value_embeds.gains, torch.full((2,), 0.5))  # modded-nanogpt's initial lambda
    x = tokens()
    assert (fed(x) - plain(x)).abs().max() > 1e-4  # on at init
    with torch.no_grad():
        fed.value_embeds.gains.zero_()
    torch.testing.assert_close(fed(x), plain(x), rtol=1e-6, atol=1e-6)


def test_value_embeds_under_full_recompute_give_the_same_gradients():
    """train.recompute=full re-runs each layer in backward, looking the rows up again: the tables, the gains
    and every weight get the gradients of the plain pass."""

    def grads(recompute):
        model = build("model.value_embeds=2", "model.num_layers=4", f"train.recompute={recompute}")
        model.train()
        model.hidden_states(tokens()).pow(2).mean().backward()
        return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}

    a, b = grads("none"), grads("full")
    assert a.keys() == b.keys() and {"value_embeds.gains", "value_embeds.tables.0.weight"} <= a.keys()
    assert a["value_embeds.tables.1.weight"].abs().sum() > 0
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=1e-12)


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_the_tables_train_at_embed_lr_with_decay_and_the_gains_without(optimizer):
    """The tables are embedding tables: AdamW at train.embed_lr with weight decay, never Muon; the gains 1-D:
    AdamW at train.lr without decay."""
    from megahash.training.lr_schedule import Schedule
    from megahash.training.muon import build_optimizer
    from megahash.training.param_groups import param_groups

    cfg = cfg_of(
        "model.value_embeds=1",
        "train.embed_lr=0.05",
        "train.lr=0.002",
        "train.warmup_steps=4",
        f"train.optimizer={optimizer}",
    )
    model, t = build("model.value_embeds=1"), cfg.train
    opt = build_optimizer(model, t, param_groups(model, t), {})
    Schedule(opt, t).go_to(3)  # the last warmup step: every group at its peak

    def group_of(p):
        [g] = [g for g in opt.param_groups if any(q is p for q in g["params"])]
        return g

    table, gains = model.value_embeds.tables[0].weight, model.value_embeds.gains
    assert group_of(table) is group_of(model.embedding.word_embeddings.weight)
    assert group_of(table)["lr"] == pytest.approx(0.05) and group_of(table)["weight_decay"] == t.weight_decay > 0
    assert group_of(gains)["lr"] == pytest.approx(0.002) and group_of(gains)["weight_decay"] == 0.0
    assert not group_of(table).get("use_muon", False) and not group_of(gains).get("use_muon", False)


def test_parameters_counted_by_megahash_params():
    """N tables of V' x (G d_h) (V' the padded vocabulary, G the key/value groups) and 2N gains."""
    from megahash.models.accounting import count_parameters, format_report

    over = ["model.num_layers=4", "model.num_query_groups=2"]
    plain = count_parameters(cfg_of(*over), VOCAB)
    r = count_parameters(cfg_of(*over, "model.value_embeds=2"), VOCAB)
    want = 2 * plain["vocab_size"] * (2 * 8) + 4
    assert r["value_embeds"] == want and r["total"] == plain["total"] + want
    assert f"value embeddings   {want:>15,}" in format_report(r)


@pytest.mark.parametrize(
    "overrides,match",
    [
        (["model.value_embeds=2"], r"value_embeds=2 .* at most model.num_layers // 2 = 1"),
        (["model.value_embeds=-1"], r"model.value_embeds. must be >= 0"),
    ],
)
def test_config_errors_name_the_key(overrides, match):
    with pytest.raises(ConfigError, match=match):
        cfg_of(*overrides)


@pytest.mark.parametrize("schedule", ["uniform:gated-deltanet", "uniform:mha-megatron", "list:mha,approx"])
def test_a_kind_without_a_value_stream_is_refused_in_one_line(schedule):
    from megahash.models.schedules import check_kinds

    with pytest.raises(ConfigError) as err:
        check_kinds(cfg_of("model.value_embeds=1", f"model.schedule={schedule}"))
    msg = str(err.value)
    assert "\n" not in msg and "has no value stream" in msg and "model.value_embeds=0" in msg
    for kind in ("mha", "gqa", "mqa", "mhe-add", "mhe-mul"):
        check_kinds(cfg_of("model.value_embeds=1", f"model.schedule=uniform:{kind}"))


def test_pretrain_refuses_a_kind_without_a_value_stream_with_exit_2(tmp_path):
    """At config load, before anything is imported or written: one line, exit 2."""
    r = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "megahash", "pretrain.py"),
            "--config",
            os.path.join(ROOT, "configs", "quickstart.yaml"),
            "model.value_embeds=1",
            "model.schedule=uniform:approx",
            f"train.save_dir={tmp_path / 'run'}",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2, r.stderr[-2000:]
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "model.value_embeds=1" in lines[0] and "'approx'" in lines[0], r.stderr
    assert not (tmp_path / "run").exists()


def test_layers_of_two_value_widths_are_a_config_error():
    """value embeddings over layers whose value widths differ (MHE-mul beside GQA with 2 value heads): a ConfigError
    (one line, exit 2 from pretrain.py). Before: a ValueError, a traceback on every rank."""
    with pytest.raises(ConfigError, match="need one value width"):
        build(
            "model.value_embeds=1",
            "model.num_layers=4",
            "model.schedule=list:mhe-mul,mha,mha,gqa",
            "model.num_query_groups=2",
        )
