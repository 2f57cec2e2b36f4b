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


# ------------------------------------------------------------------------ presets of current hybrids (issue 45 item 3)


def _documented_hybrids() -> list[tuple[str, str, str]]:
    """(hybrid, schedule, the same as a list) rows of docs/attention.md's table of current hybrids."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "attention.md").read_text()
    table = text.split("## Hybrid presets", 1)[1].split("\n\n| hybrid |", 1)[1].split("\n\n", 1)[0]
    rows = [re.findall(r"`([^`]+)`", line) for line in table.splitlines()[2:]]
    names = [line.split("|")[1].split("[")[0].split(":")[0].strip() for line in table.splitlines()[2:]]
    return [(name, row[-2], row[-1]) for name, row in zip(names, rows)]


HYBRIDS = _documented_hybrids()


def test_the_documented_table_lists_every_new_preset():
    presets = {schedule.split(":")[2] for _, schedule, _ in HYBRIDS if schedule.startswith("hybrid:")}
    assert {"3to1", "5to1", "1to1", "nanogpt"} <= presets and len(HYBRIDS) >= 8


@pytest.mark.parametrize("name,schedule,listed", HYBRIDS, ids=[h[1] for h in HYBRIDS])
def test_every_documented_hybrid_is_its_list_and_builds(name, schedule, listed):
    """Each schedule of docs/attention.md's table: the same layers and per-layer options as the list beside it (8
    layers); built, every layer is its kind with its options (a gate where ``+gated``, the window it names) and a
    forward runs. A row naming a kind that is not registered is the one-line unknown-kind error (and skips)."""
    from megahash import catalog
    from megahash.models.schedules import check_kinds, layer_items, layer_options

    assert layer_items(schedule, 8) == layer_items(listed, 8)
    cfg = _cfg(schedule, "model.attention.options.window=16", layers=8)
    missing = sorted(set(layer_kinds(schedule, 8)) - set(catalog.names("attention")))
    if missing:
        with pytest.raises(ConfigError, match=f"^unknown attention kind {missing[0]!r} in schedule"):
            check_kinds(cfg)
        pytest.skip(f"{missing[0]} not registered")
    model = _build(cfg)
    assert model.layer_kinds == layer_kinds(listed, 8)
    for module, own in zip(model.attention_modules(), layer_options(cfg)):
        assert hasattr(module, "linear_output_gate") == bool(own.get("gated"))
        if "window" in own or getattr(module, "window", None) is not None:
            assert module.window == own.get("window", 16)
    with torch.no_grad():
        assert torch.isfinite(model.hidden_states(torch.randint(0, 128, (2, 20)))).all()


@pytest.mark.parametrize("L", [4, 6, 8, 12, 26])
def test_ratio_presets_equal_the_configs_of_the_models_they_name(L):
    """NtoM against the layer patterns others publish: transformers' Gemma 3 (sliding_window_pattern 6: 5to1),
    Gemma 2 (alternating: 1to1) and Qwen3-Next (full attention every fourth layer: 3to1) configs' layer_types, and
    megatron-core's window_attn_skip_freq=N (is_layer_window_attention: (N-1)to1); 1to1 is Table 4.11's even,
    3to1 its 25%."""
    from megatron.core.transformer.utils import is_layer_window_attention
    from transformers import Gemma2Config, Gemma3TextConfig, Qwen3NextConfig

    def full(config):  # 1-based layers of full (global) attention
        return {i + 1 for i, t in enumerate(config(num_hidden_layers=L).layer_types) if t == "full_attention"}

    assert standard_layers("5to1", L) == full(Gemma3TextConfig)
    assert standard_layers("1to1", L) == full(Gemma2Config) == standard_layers("even", L)
    assert standard_layers("3to1", L) == full(Qwen3NextConfig) == standard_layers("25%", L)
    for n in range(2, 7):
        windowed = {i for i in range(1, L + 1) if is_layer_window_attention((7, 0), n, i)}
        assert standard_layers(f"{n - 1}to1", L) == set(range(1, L + 1)) - windowed
    assert standard_layers("2to3", 10) == {3, 4, 5, 8, 9, 10}


def test_nanogpt_preset_is_modded_nanogpts_long_window_layers():
    """modded-nanogpt's block masks: [long, short, short, short, long, short, short, long, short, short, short, long]
    for its 12 layers and long at 1, 5, 12, 16 of its 16 (1-based): {1, 5, L-4, L}."""
    pattern12 = "LSSSLSSLSSSL"
    pattern16 = "LSSSLSSSSSSLSSSL"
    for pattern in (pattern12, pattern16):
        assert standard_layers("nanogpt", len(pattern)) == {i + 1 for i, c in enumerate(pattern) if c == "L"}
    assert standard_layers("nanogpt", 4) == {1, 4}


@pytest.mark.parametrize(
    "schedule,match",
    [
        ("uniform:mha+window=4", r"attention kind 'mha' has no option 'window' in .* \(valid: gated\)"),
        ("uniform:mha+gatd", r"has no option 'gatd' in schedule item 'mha\+gatd' \(did you mean 'gated'\?\)"),
        ("uniform:mlp+gated", r"attention kind 'mlp' has no option 'gated' .*\(it declares no options\)"),
        ("hybrid:swa:5to1:mha+window=8", "attention kind 'mha' has no option 'window'"),  # unused at 4 layers
        ("uniform:swa+window", r"option 'window' of 'swa' needs a value: swa\+window=VALUE"),
        ("uniform:swa+window=0", r"'swa\+window \(model.schedule\)' must be >= 1"),
        ("uniform:swa+window=wide", r"'swa\+window \(model.schedule\)' must be an integer, got 'wide'"),
        ("uniform:swa+gated=maybe", r"must be true/false, got 'maybe'"),
        ("uniform:swa+", r"bad option '' in schedule item 'swa\+'"),
        ("hybrid:swa:0to1", "unknown hybrid preset '0to1'"),
        ("list:swa*x,mha", "bad repeat 'swa\\*x'"),
        ("hybrid:not-a-kind:3to1:mha+gated", "unknown attention kind 'not-a-kind' in schedule"),
    ],
)
def test_per_layer_option_and_preset_errors_are_one_line(schedule, match):
    """Bad per-layer options and presets: a one-line ConfigError naming the item and the fix (the config check
    before torch, megahash.models.schedules.check_kinds)."""
    from megahash.models.schedules import check_kinds

    with pytest.raises(ConfigError, match=match) as e:
        check_kinds(_cfg(schedule, layers=4))
    assert "\n" not in str(e.value)


def test_per_layer_options_override_the_global_ones_for_their_layers_only():
    """model.attention.options.window=6 with one layer's swa+window=2: that layer sees 2 keys, the others 6;
    a layer's own gate leaves the others ungated; the export carries them per layer (its plain-torch model gives
    the same logits)."""
    from megahash.convert.reference import reference_model

    cfg = _cfg("list:swa,swa+window=2+gated,swa,mha+gated", "model.attention.options.window=6")
    model = _build(cfg).eval()
    assert [m.window for m in model.attention_modules()] == [6, 2, 6, None]
    assert [hasattr(m, "linear_output_gate") for m in model.attention_modules()] == [False, True, False, True]
    tok = torch.randint(5, 128, (2, 14), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ours = model(tok)[..., :128]
        theirs = reference_model(model.cfg, model).eval()(input_ids=tok).logits
    torch.testing.assert_close(theirs, ours, rtol=0, atol=1e-10)


def test_a_misspelt_head_is_refused_by_the_torch_free_check():
    """Before: model.head=vocabb passed --check config (exit 0) and failed only once the model was built, after
    torch and megatron-core. Now the check refuses it with the closest name, and accepts exactly the heads the
    registry (the torch side, the independent fact) builds when selected."""
    from megahash.models import registry
    from megahash.models.schedules import check_kinds

    built = sorted(n for n, h in registry.kinds("head").items() if h.caps.selectable)
    for head in built:
        check_kinds(load_config("configs/quickstart.yaml", [f"model.head={head}"]))
    for head in ["vocabb", *sorted(set(registry.kinds("head")) - set(built))]:
        with pytest.raises(ConfigError, match=rf"^unknown model.head '{head}' \((did you mean|valid)"):
            check_kinds(load_config("configs/quickstart.yaml", [f"model.head={head}"]))
