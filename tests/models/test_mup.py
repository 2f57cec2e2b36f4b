"""muP (``model.mup_base_hidden_size``, megahash/models/mup.py; issue 48 item 2): the coordinate check of
[Yang22] (Microsoft ``mup``'s ``get_coord_data``): after a few optimizer steps the RMS of every layer's activations
and of their change since initialisation stays flat over widths 64..512 under muP and grows without it; the
export's plain-torch model (the HF remote code) carries the readout multiplier and the attention scale; the base
model is the standard one; a kind that cannot take muP's attention scale is refused in one line."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest
import torch

from megahash.accelerator import rng
from megahash.config import load_config

pytestmark = [pytest.mark.usefixtures("dist")]  # one-rank world (conftest)

VOCAB = 64
WIDTHS = (64, 128, 256, 512)
# measured (2026-11-27): muP spreads 1.0-1.4x; without muP the changes grow 3.3-130x (blocks) and 3.4-4.0x (logits)
FLAT = 1.6  # muP: max/min over the widths of every layer's RMS (activation and its change)
GROWS = 3.0  # without muP: the largest change of each block's output and of the logits over widths > 64, / width 64


def _cfg(width: int, base: int, optimizer: str, *extra):
    return load_config(
        None,
        [
            f"model.hidden_size={width}",
            "model.num_layers=2",
            "model.num_heads=4",
            f"model.ffn_hidden_size={4 * width}",
            f"model.mup_base_hidden_size={base}",
            "data.seq_length=16",
            f"train.optimizer={optimizer}",
            "train.lr=0.01",
            "train.muon.lr=0.02",
            "train.weight_decay=0.0",
            *extra,
        ],
    )


def _coords(cfg, steps: int = 3) -> dict[str, tuple[float, float]]:
    """Layer -> (RMS of its output after ``steps`` steps, RMS of the output's change since step 0), on one fixed
    batch (the embedding, each transformer layer, the logits), trained with the run's optimizer and groups."""
    from megahash.models.megatron_model import build_model
    from megahash.training.muon import build_optimizer
    from megahash.training.param_groups import param_groups

    rng.seed_all(1234)
    model = build_model(cfg, VOCAB)
    t = cfg.train
    opt = build_optimizer(model, t, param_groups(model, t), {})
    g = torch.Generator().manual_seed(0)
    tok = torch.randint(0, VOCAB, (8, 16), generator=g)
    labels = torch.randint(0, VOCAB, (8, 16), generator=g)
    outs: dict[str, torch.Tensor] = {}

    def keep(name):
        return lambda _m, _i, out: outs.__setitem__(name, (out[0] if isinstance(out, tuple) else out).detach())

    model.embedding.register_forward_hook(keep("embedding"))
    for i, layer in enumerate(model.decoder.layers):
        layer.register_forward_hook(keep(f"layer{i}"))

    def probe():
        with torch.no_grad():
            outs["logits"] = model(tok).detach()
        return dict(outs)

    first = probe()
    for _ in range(steps):
        opt.zero_grad()
        model(tok, labels=labels).mean().backward()
        opt.step()
    last = probe()
    rms = lambda x: x.float().pow(2).mean().sqrt().item()  # noqa: E731
    return {k: (rms(last[k]), rms(last[k] - first[k])) for k in first}


def _spread(coords: dict[int, dict], layer: str, which: int) -> float:
    vals = [coords[w][layer][which] for w in WIDTHS]
    return max(vals) / min(vals)


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_coordinate_check(optimizer):
    """[Yang22]'s coordinate check, widths 64..512 (m = 1..8 over base 64), 3 steps at one learning rate: under
    muP every layer's activation RMS and the RMS of its change stay within a factor FLAT over the widths; without
    muP the change of every block's output and of the logits grows by GROWS or more (AdamW: hidden-matrix updates
    grow with the fan-in; Muon's are spectrally normalised, [Yang23], but the readout and attention are not)."""
    mup = {w: _coords(_cfg(w, 64, optimizer)) for w in WIDTHS}
    sp = {w: _coords(_cfg(w, 0, optimizer)) for w in WIDTHS}
    for layer in mup[WIDTHS[0]]:
        for which in (0, 1):
            assert _spread(mup, layer, which) < FLAT, (layer, which, [mup[w][layer] for w in WIDTHS])
    for layer in ("layer0", "layer1", "logits"):
        grow = max(sp[w][layer][1] for w in WIDTHS[1:]) / sp[WIDTHS[0]][layer][1]
        assert grow > GROWS, (layer, [sp[w][layer] for w in WIDTHS])


def test_compact_recipe_at_two_widths_shares_its_learning_rates():
    """configs/compact.yaml (muP over its own width, model.mup_base_hidden_size=128) at its width and at 4x: with
    the recipe's own ``train.lr`` and ``train.muon.lr`` (Muon), every layer's activations and their change after 3
    steps agree within FLAT, so one learning rate serves both widths; without muP they do not (the logits' change
    more than doubles: measured 2.6x at 4x the width)."""
    recipe = load_config("configs/compact.yaml")
    assert recipe.model.mup_base_hidden_size == recipe.model.hidden_size == 128 and recipe.train.optimizer == "muon"

    def at(width, *extra):
        return load_config(
            "configs/compact.yaml",
            [f"model.hidden_size={width}", f"model.ffn_hidden_size={4 * width}", "data.seq_length=16", *extra],
        )

    mup = {w: _coords(at(w)) for w in (128, 512)}
    sp = {w: _coords(at(w, "model.mup_base_hidden_size=0")) for w in (128, 512)}
    for layer in mup[128]:
        for which in (0, 1):
            vals = [mup[w][layer][which] for w in (128, 512)]
            assert max(vals) / min(vals) < FLAT, (layer, which, vals)
    assert sp[512]["logits"][1] / sp[128]["logits"][1] > 2.0, [sp[w]["logits"] for w in (128, 512)]


def test_base_width_is_the_standard_model():
    """muP at its base width (m = 1) is the standard model: the same initial weights, logits, and the same
    learning rate and Adam epsilon for every parameter (so the base model's tuned settings are the standard ones)."""
    from megahash.models.megatron_model import build_model
    from megahash.training.param_groups import param_groups

    def built(base):
        cfg = _cfg(64, base, "adamw")
        rng.seed_all(7)
        model = build_model(cfg, VOCAB)
        settings = {
            id(p): (g.get("lr", cfg.train.lr), g.get("eps", cfg.train.eps), g["weight_decay"])
            for g in param_groups(model, cfg.train)
            for p in g["params"]
        }
        return model, {n: settings[id(p)] for n, p in model.named_parameters()}

    (std, std_set), (mup, mup_set) = built(0), built(64)
    assert std_set == mup_set
    for (n, a), (_, b) in zip(std.named_parameters(), mup.named_parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=n)  # the same draws, unscaled at m = 1
    tok = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(std(tok), mup(tok))


def test_export_reference_carries_the_readout_multiplier_and_attention_scale():
    """The HF export's plain-torch model (megahash/models/hf_model.py + the kinds' references, the remote code)
    of a muP model at m = 4 gives the library's logits in float64, for every exportable attention kind (one layer
    each; the fixed-input kinds in a hybrid) with hash embeddings (the library's attention scale is megatron's:
    tests/models/test_attention.py::test_mha_matches_megatron_self_attention); the same weights without muP give
    other logits."""
    import _emb_helpers as H

    from megahash import catalog
    from megahash.convert.reference import reference_model
    from megahash.models.megatron_model import build_model

    caps = {k: catalog.caps("attention", k) for k in catalog.names("attention")}
    kinds = sorted(k for k, c in caps.items() if c.exportable and not c.fixed_input and c.mup)
    for schedule, layers in ((f"list:{','.join(kinds)}", len(kinds)), ("hybrid:rndembqk:even", 2)):
        extra = [
            f"model.schedule={schedule}",
            "model.max_position_embeddings=64",
            "model.attention.options.fixed_seq_length=64",
        ]
        cfg = H.tiny_cfg("hash-emb", [*extra, "model.mup_base_hidden_size=16"], hidden=64, layers=layers, seq=16)
        rng.seed_all(3)
        model = build_model(cfg, 200, dtype=torch.float64)
        with torch.no_grad():  # weights away from muP's small init, so every scale shows in the logits
            g = torch.Generator().manual_seed(5)
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.2)
        tok, codes = H.word_batches(H.KINDS["hash-emb"][0], 2, 17, 1, vocab_size=120)[0]
        tok, codes = tok[:, :16], codes[:, :16].long()
        a = model(tok, hash_codes=codes)
        b = reference_model(cfg, model)(input_ids=tok, hash_codes=codes).logits
        assert (a - b).abs().max().item() < 1e-9, schedule
        std = reference_model(H.tiny_cfg("hash-emb", extra, hidden=64, layers=layers, seq=16), model)
        assert (std(input_ids=tok, hash_codes=codes).logits - a).abs().max().item() > 1e-3, schedule


def test_a_kind_without_the_attention_scale_is_refused_in_one_line():
    """``model.mup_base_hidden_size`` with a layer kind whose caps say ``mup=False``: one line naming the kind and
    the fix (megahash.config_checks.check_mup, called by the schedule check of every run)."""
    import dataclasses

    from megahash import catalog
    from megahash.config_checks import check_mup
    from megahash.errors import ConfigError

    cfg = _cfg(64, 32, "adamw")
    no = dataclasses.replace(catalog.caps("attention", "mha"), mup=False)
    with pytest.raises(ConfigError) as err:
        check_mup(cfg, ["mha", "approx"], lambda k: no if k == "approx" else catalog.caps("attention", k))
    msg = str(err.value)
    assert "\n" not in msg and "'approx'" in msg and "model.mup_base_hidden_size=0" in msg
    check_mup(cfg, ["mha", "approx"], lambda k: catalog.caps("attention", k))
    check_mup(cfg, catalog.names("attention"), lambda k: catalog.caps("attention", k))  # every registered kind can
    check_mup(_cfg(64, 0, "adamw"), ["approx"], lambda k: no)  # off: nothing to check
