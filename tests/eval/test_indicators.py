"""Attention indicators ([Xue25] sec. 4.4.4) on hand-made matrices, and the capture of attention
maps from every attention kind (captured A times V reproduces each module's output)."""

import math

import pytest
import torch

from megahash.eval import indicator_formulas as ind
from megahash.eval.attention_capture import AttentionCapture
from megahash.eval.indicators import layer_records

pytestmark = pytest.mark.numerics  # compares floating-point results (see tests/numerics.py)

# two heads, L = 3: head 1 attends to itself only, head 2 is uniform over the causal prefix
EYE = torch.eye(3, dtype=torch.float64)
UNI = torch.tensor([[1, 0, 0], [1 / 2, 1 / 2, 0], [1 / 3, 1 / 3, 1 / 3]], dtype=torch.float64)


def test_indicators_of_hand_made_maps():
    A = torch.stack([EYE, UNI])
    h = ind.head_indicators(A)
    # Entropy H = -sum a log a: 0 for the identity; rows of the uniform map give 0 + ln 2 + ln 3
    assert h["entropy"] == pytest.approx([0.0, math.log(6)])
    # Conc = Frobenius norm
    assert h["conc"] == pytest.approx([math.sqrt(3), math.sqrt(1 + 1 / 2 + 1 / 3)])
    # Sink = sum of the first column / L
    assert h["sink"] == pytest.approx([1 / 3, (1 + 1 / 2 + 1 / 3) / 3])
    # LocFoc_N = sum of the N-th sub-diagonal / (L - N)
    assert h["locfoc_0"] == pytest.approx([1.0, (1 + 1 / 2 + 1 / 3) / 3])
    assert h["locfoc_1"] == pytest.approx([0.0, (1 / 2 + 1 / 3) / 2])
    assert h["locfoc_2"] == pytest.approx([0.0, 1 / 3])
    assert h["locfoc_3"] == pytest.approx([0.0, 0.0])  # N >= L: no such distance
    # HeadDiv = 2/(L(1+L)) * sum over j <= i of std over heads (population std = |a - b| / 2)
    stds = [0, 1 / 4, 1 / 4, 1 / 6, 1 / 6, 1 / 3]
    assert ind.head_diversity(A) == pytest.approx(2 / (3 * 4) * sum(stds))
    assert ind.head_diversity(torch.stack([UNI, UNI])) == 0.0
    # single-matrix forms
    assert float(ind.entropy(UNI)) == pytest.approx(math.log(6))
    assert float(ind.local_focus(EYE, 0)) == 1.0


def test_indicator_extremes_of_a_uniform_and_a_sink_map():
    L = 16
    causal = torch.tril(torch.ones(L, L, dtype=torch.float64))
    mean_pool = causal / causal.sum(-1, keepdim=True)
    sink_map = torch.zeros(L, L, dtype=torch.float64)
    sink_map[:, 0] = 1
    assert float(ind.sink(sink_map)) == 1.0 and float(ind.entropy(sink_map)) == 0.0
    assert float(ind.entropy(mean_pool)) == pytest.approx(sum(math.log(i) for i in range(1, L + 1)))
    assert float(ind.concentration(mean_pool)) < float(ind.concentration(sink_map)) == pytest.approx(math.sqrt(L))


def _kinds():
    from megahash.models import registry

    return registry.names("attention")


def _tiny_model(schedule: str):
    """A 2-layer, 4-head, h32 decoder of ``schedule`` (seed 0), in eval mode."""
    from megahash.accelerator import rng
    from megahash.config import load_config
    from megahash.models.megatron_model import build_model

    cfg = load_config(
        None,
        [
            "model.hidden_size=32",
            "model.num_layers=2",
            "model.num_heads=4",
            "model.ffn_hidden_size=64",
            f"model.schedule={schedule}",
            "model.max_position_embeddings=64",
            "data.seq_length=32",
            "model.attention.options.fixed_seq_length=64",
        ],
    )
    rng.seed_all(0)
    return build_model(cfg, 100).eval()


@pytest.mark.parametrize("kind", _kinds())
def test_capture_reproduces_every_kinds_attention(dist, kind):
    """For every kind the captured (equivalent) map is a causal row-stochastic matrix and A V equals
    the attention output of the module; the model output is unchanged by capturing."""
    model = _tiny_model("uniform:mha" if kind == "mha" else f"hybrid:{kind}:even")
    if kind == "fixedseqqk":
        from megahash.models.attention.fixed_qk import set_fixed_tokens

        set_fixed_tokens(model, list(range(5, 69)))
    tok = torch.randint(5, 100, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(tok)
        with AttentionCapture(model, batch=2, verify=True) as cap:
            out = model(tok)
        again = model(tok)
    # bit-exact: the capture only observes: the model runs its own path
    assert torch.equal(out, ref) and torch.equal(again, ref)
    assert not any("attend" in m.__dict__ for m in model.attention_modules())  # patches removed
    for i, rec in enumerate(cap.layers):
        assert rec is not None and rec["probs"] is not None, (kind, i)
        P = rec["probs"]
        assert P.shape[0] == 2 and P.shape[-2:] == (12, 12)
        assert torch.allclose(P.sum(-1), torch.ones_like(P.sum(-1)), atol=1e-9)
        assert float(P.triu(1).abs().max()) == 0.0
        if rec["kind"] != "mlp":
            assert rec["check_err"] < 1e-5, (kind, rec["kind"], rec["check_err"])
            assert rec["logits"] is not None and rec["logits"].numel() > 0
        else:
            assert torch.equal(
                P[0, 0], torch.eye(12, dtype=P.dtype)
            )  # bit-exact: mlp mixes no tokens: exactly the identity map
    recs = layer_records(cap.layers, model.layer_kinds)
    assert [r["kind"] for r in recs] == model.layer_kinds
    assert all(0 <= r["head_div"] <= 1 for r in recs)


def test_capture_goes_through_each_kinds_registered_maps_hook(dist, monkeypatch):
    """The kind's ``maps`` hook in the registry decides how its layers are captured: mha's hook replaced by
    one that reports a marker is what the capture stores, and with no hook its layers are "unavailable"
    (nothing guessed from the modules' attributes); the other kind of the hybrid is captured as before."""
    from megahash.models import registry

    model = _tiny_model("hybrid:approx:even")  # layers: approx, mha
    tok = torch.randint(5, 100, (2, 12), generator=torch.Generator().manual_seed(1))

    def marker(layer, record):
        eye = torch.eye(tok.shape[1], dtype=torch.float64)[None, None]
        return [layer.register_forward_hook(lambda *_: record({"source": "marker", "probs": eye, "causal": True}))]

    mha = registry.spec("attention", "mha")
    for hook, source in ((marker, "marker"), (None, "unavailable")):
        monkeypatch.setattr(mha, "maps", hook)
        with torch.no_grad(), AttentionCapture(model, batch=2) as cap:
            model(tok)
        assert [rec["kind"] for rec in cap.layers] == model.layer_kinds == ["approx", "mha"]
        assert cap.layers[1]["source"] == source, cap.layers[1]
        assert cap.layers[0]["source"].startswith("normalised Taylor kernel")
