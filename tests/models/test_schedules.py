"""Layer schedules ([Xue25] sec. 4.5-4.6, Table 4.11), `skip` mode, and the 500M hybrids' sizes."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest
import torch

from megahash.accelerator import rng
from megahash.config import load_config
from megahash.errors import ConfigError
from megahash.models.forward_state import ForwardState
from megahash.models.schedules import PRESETS, layer_kinds, skip_mask, standard_kind, standard_layers

# Table 4.11 verbatim (24 layers, 1-based ids of the layers that keep standard attention)
TABLE_4_11 = {
    "even": {2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24},
    "odd": {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23},
    "top": {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12},
    "middle": {1, 2, 3, 4, 5, 6, 19, 20, 21, 22, 23, 24},
    "bottom": {13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24},
    "25%": {4, 8, 12, 16, 20, 24},
    "first": {1},
    "last": {24},
    "bilateral": {1, 24},
}


pytestmark = pytest.mark.usefixtures("dist")  # one-rank world (conftest)


def test_presets_equal_table_4_11():
    assert set(PRESETS) == set(TABLE_4_11)
    for preset, ids in TABLE_4_11.items():
        assert standard_layers(preset, 24) == ids, preset


@pytest.mark.parametrize("L", [4, 6, 12, 28, 32])
def test_presets_generalise(L):
    """The same rules for other depths: halves, quarters, every fourth layer, the ends."""
    all_ids = set(range(1, L + 1))
    s = {p: standard_layers(p, L) for p in PRESETS}
    assert s["even"] | s["odd"] == all_ids and not s["even"] & s["odd"]
    assert s["top"] | s["bottom"] == all_ids and not s["top"] & s["bottom"]
    assert s["top"] == set(range(1, L // 2 + 1))
    q = L // 4
    assert s["middle"] == set(range(1, q + 1)) | set(range(L - q + 1, L + 1))  # the middle half is replaced
    assert s["25%"] == {i for i in all_ids if i % 4 == 0}
    assert s["first"] == {1} and s["last"] == {L} and s["bilateral"] == {1, L}
    assert standard_layers("middle", 12) == {1, 2, 3, 10, 11, 12} or L != 12


def test_layer_kinds_forms():
    assert layer_kinds("uniform:approx", 3) == ["approx"] * 3
    kinds = layer_kinds("hybrid:rndembqk:even", 24)  # the [Xue25] 500M hybrid: RndEmbQK in odd layers
    assert [i + 1 for i, k in enumerate(kinds) if k == "mha"] == sorted(TABLE_4_11["even"])
    assert all(k == "rndembqk" for i, k in enumerate(kinds) if (i + 1) % 2 == 1)
    assert layer_kinds("hybrid:mlp:1,3", 4) == ["mha", "mlp", "mha", "mlp"]
    assert layer_kinds("hybrid:nonapprox:last:gqa", 3) == ["nonapprox", "nonapprox", "gqa"]
    assert layer_kinds("list:mha*2,mlp,approx*1", 4) == ["mha", "mha", "mlp", "approx"]
    assert standard_kind("hybrid:nonapprox:last:gqa") == "gqa" and standard_kind("uniform:mlp") == "mha"
    assert skip_mask(["mha", "mlp", "mha"]) == [False, True, False]


@pytest.mark.parametrize(
    "bad,match",
    [
        ("hybrid:mlp:sideways", "unknown hybrid preset"),
        ("hybrid:mlp:0,3", "outside"),
        ("list:mha,mlp", "lists 2 layers"),
        ("uniform", "bad schedule"),
    ],
)
def test_schedule_errors(bad, match):
    with pytest.raises(ConfigError, match=match):
        layer_kinds(bad, 3)


def _cfg(schedule, *extra, layers=4):
    return load_config(
        None,
        [
            "model.hidden_size=32",
            f"model.num_layers={layers}",
            "model.num_heads=4",
            "model.ffn_hidden_size=64",
            f"model.schedule={schedule}",
            "data.seq_length=16",
            "model.max_position_embeddings=64",
            "model.attention.options.fixed_seq_length=64",
            *extra,
        ],
    )


def _build(cfg, seed=0):
    from megahash.models.megatron_model import build_model

    rng.seed_all(seed)
    return build_model(cfg, 128, dtype=torch.float64)


def test_skip_mode_drops_nonstandard_layers_whole():
    """skip_nonstandard: every non-standard layer is an identity (attention AND MLP, [Xue25] sec. 4.5 'we
    remove the odd-numbered layers'), parameters kept so hybrid checkpoints load; the output equals
    running only the standard layers."""
    from megahash.models.registry import SkippedLayer

    hybrid = _build(_cfg("hybrid:rndembqk:even"))
    skipped = _build(_cfg("hybrid:rndembqk:even", "model.attention.skip_nonstandard=true"))
    assert [isinstance(layer, SkippedLayer) for layer in skipped.decoder.layers] == [True, False, True, False]
    skipped.load_state_dict(hybrid.state_dict())  # same parameters
    assert not skipped.fixed_qk.active()  # no rndembqk layer runs, so no fixed input is carried
    tok = torch.randint(0, 128, (2, 10), generator=torch.Generator().manual_seed(0))
    h = skipped.hidden_states(tok)
    with torch.no_grad():
        x = hybrid.embedding(tok, None)
        rot = hybrid.rotary_pos_emb(10)
        state = ForwardState(embeddings=x, tokens=tok)
        for i in (1, 3):  # layers 2 and 4 keep standard attention
            x, _ = hybrid.decoder.layers[i](
                hidden_states=x, attention_mask=None, rotary_pos_emb=rot, inference_context=state
            )
        ref = hybrid.decoder.final_layernorm(x)
    torch.testing.assert_close(h.detach(), ref, rtol=0, atol=1e-12)
    h.pow(2).mean().backward()
    for i, layer in enumerate(skipped.decoder.layers):
        grads = [p.grad for p in layer.parameters()]
        assert all(g is None for g in grads) == (i in (0, 2))


@pytest.mark.parametrize("kind", ["mlp", "approx", "nonapprox", "rndembqk", "fixedseqqk", "staticembqk"])
def test_500m_config_under_every_hybrid_preset(kind):
    """The 24-layer 500M config of Table 4.10 (hidden 896, ffn 4864, 14 heads, vocab 50304) builds
    (on the meta device: shapes only) under every preset; its size stays within 1% of the standard
    model (436,037,504 parameters with the tied head). Only mlp differs at all: its width is
    rounded to a multiple of 14 (-12,852 parameters per replaced layer)."""
    from megahash.models.attention.mlp import mlp_param_residual
    from megahash.models.megatron_model import build_model

    def size(schedule):
        cfg = load_config(None, ["model.size=500m", f"model.schedule={schedule}"])
        with torch.device("meta"):
            model = build_model(cfg, 50304)
        assert len(model.decoder.layers) == 24
        return sum(p.numel() for p in model.parameters()), model.layer_kinds

    standard, _ = size("uniform:mha")
    assert standard == 436_037_504
    for preset in list(PRESETS) + ["uniform"]:
        schedule = f"uniform:{kind}" if preset == "uniform" else f"hybrid:{kind}:{preset}"
        total, kinds = size(schedule)
        replaced = sum(k == kind for k in kinds)
        assert replaced == (24 if preset == "uniform" else 24 - len(TABLE_4_11[preset]))
        expected_delta = replaced * mlp_param_residual(896, 14, 14, 64, True) if kind == "mlp" else 0
        assert total - standard == expected_delta
        assert abs(total - standard) < 0.01 * standard
