"""The registry: every kind describes itself in its own file, both readers of those declarations
agree, and every registered kind gets the 1-step training check (the other per-kind checks are
parametrized from the registry in their own files: Table 3.4 counts, decoding and encoders in
tests/models/test_attention.py, TP parity of every kind in one 2-rank launch there, indicators in
tests/eval/test_indicators.py, embeddings in tests/models/test_embeddings.py, export in tests/convert/test_convert.py).
A kind that lacks something fails a test whose message names what is missing."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import _kinds
import pytest
import torch

from megahash import catalog
from megahash.config import load_config

TABLE_FORMULAS = ("time_complexity", "flops", "activation_bytes", "cache_bytes")
SAMPLE = {
    "qkv_params": (4, 8, 2),
    "time_complexity": (2, 16, 32),
    "flops": ("prefill", 2, 16, 32, 4, 2, False),
    "activation_bytes": (2, 16, 32, 4, 2),
    "cache_bytes": (2, 16, 32, 4, 2),
    "cache_elements": (2, 16, 4, 8, 2),
    "groups": (4, 0),
}
ALL = [(g, n) for g in catalog.GROUPS for n in sorted(catalog.names(g))]


def _registry():
    from megahash.models import registry

    registry.load_kinds()
    return registry


@pytest.mark.parametrize("group,name", ALL, ids=[f"{g}:{n}" for g, n in ALL])
def test_every_kind_describes_itself(group, name):
    """One file registers the kind, with a capability record; attention kinds name their cost
    formulas (or costs=None, "measured only"): a kind listed in the [Xue25] tables has every table
    formula, and a kind that decodes has its decode-cache formula."""
    reg = _registry()
    files = [e.file for g in catalog.GROUPS for n, e in catalog.entries(g).items() if g == group and n == name]
    assert len(files) == 1, f"{group} kind {name!r} must be registered by exactly one file, found {files}"
    kind = reg.kinds(group).get(name)
    caps = kind.caps if kind is not None else None
    assert isinstance(caps, catalog.CAPS[group]), f"{group} kind {name!r} registers no {catalog.CAPS[group].__name__}"
    if group != "attention":
        return
    own = kind.costs
    if own is None:
        assert not caps.chapters, (
            f"attention kind {name!r} is listed in thesis chapters {caps.chapters} but registers costs=None"
        )
        return
    if caps.chapters:
        missing = [f for f in TABLE_FORMULAS if getattr(own, f, None) is None]
        assert not missing, f"attention kind {name!r} (thesis chapters {caps.chapters}) lacks the formulas {missing}"
    if caps.decodes:
        assert getattr(own, "cache_elements", None) is not None, (
            f"attention kind {name!r} decodes but its cost class {own.__name__} has no cache_elements formula"
        )


def test_source_reader_agrees_with_the_imported_registry():
    """megahash.catalog reads the kind files' source (no torch: config checks, `megahash
    params` of a Qwen2 config); it must see exactly what importing them registers: names, caps,
    and cost formulas giving the same numbers."""
    reg = _registry()
    live = {g: reg.kinds(g) for g in catalog.GROUPS}
    for group, entries in ((g, catalog.entries(g)) for g in catalog.GROUPS):
        assert set(entries) == set(live[group]), f"{group}: source {sorted(entries)} vs imported {sorted(live[group])}"
        for name, e in entries.items():
            assert e.caps == live[group][name].caps, f"{group} kind {name!r}: caps read from source differ"
    for name, e in catalog.entries("attention").items():
        own = live["attention"][name].costs
        assert (e.costs is None) == (own is None), f"attention kind {name!r}: costs= not readable from its source"
        if own is None:
            continue
        from pathlib import Path

        light = catalog._exec_class(Path(e.file), e.costs)
        for formula, args in SAMPLE.items():
            fn = getattr(own, formula, None)
            if fn is not None:
                assert getattr(light, formula)(*args) == fn(*args), f"{name}.{formula}: source reading differs"


def test_reads_hash_codes_has_one_owner():
    """Data loading, evaluation and export ask the same capability (item 6: bert-hash reads token ids)."""
    from megahash.eval.text import needs_codes

    for emb in _kinds.embeddings():
        for head in _kinds.heads(selectable=True):
            cfg = load_config(None, [f"model.embedding={emb}", f"model.head={head}"])
            want = catalog.caps("embedding", emb).reads_hash_codes or catalog.caps("head", head).reads_hash_codes
            assert needs_codes(cfg) == catalog.reads_hash_codes(cfg) == want, (emb, head)
    assert not catalog.caps("embedding", "bert-hash").reads_hash_codes  # [NeuML25] indexes token ids


def _one_step(overrides, vocab=96, seed=0):
    """Build a tiny model, take one (normalised) gradient step on one batch; return (loss before, loss after, names of
    parameters that got no gradient)."""
    import _emb_helpers as H

    from megahash.accelerator import rng
    from megahash.models.megatron_model import build_model

    cfg = load_config(
        None,
        [
            "model.hidden_size=32",
            "model.num_heads=4",
            "model.ffn_hidden_size=64",
            "data.seq_length=16",
            "model.max_position_embeddings=64",
            "model.attention.options.fixed_seq_length=64",
            *overrides,
        ],
    )
    rng.seed_all(seed)
    model = build_model(cfg, vocab, dtype=torch.float64)
    if getattr(model, "fixed_qk", None) is not None and model.fixed_qk.source == "text":
        from megahash.models.attention import fixed_qk

        fixed_qk.set_fixed_tokens(model, [(7 * i + 5) % vocab for i in range(64)])
    b, s = 2, 16
    codes = label_codes = None
    if catalog.reads_hash_codes(cfg):
        tok, codes = H.word_batches(cfg.model.embed.hash_spec, b, s + 1, 1, vocab_size=vocab)[0]
        tok, codes, label_codes = tok[:, :s], codes[:, :s], codes[:, 1:]
    else:
        tok = torch.randint(5, vocab, (b, s + 1), generator=torch.Generator().manual_seed(seed))[:, :s]
    tok = tok.clone()
    tok[:, 0] = 0  # <s>: the special-token table of hash embeddings is trained too
    classes = 3 if cfg.train.objective == "sr" else vocab
    labels = torch.randint(0, classes, (b, s), generator=torch.Generator().manual_seed(seed + 1))
    pad = torch.ones(b, s, dtype=torch.bool)

    def loss():
        out = model(
            tok,
            hash_codes=codes,
            labels=labels,
            label_codes=label_codes,
            padding_mask=None if model.decoder_only else pad,
        )
        return out.mean()

    model.train()
    first = loss()
    first.backward()
    no_grad = [
        n for n, p in model.named_parameters() if p.requires_grad and (p.grad is None or not p.grad.abs().sum() > 0)
    ]
    with torch.no_grad():  # a small normalised gradient step (approx-thesis's denominators make raw steps explode)
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        norm = torch.sqrt(sum(g.pow(2).sum() for g in grads))
        for p in model.parameters():
            if p.grad is not None:
                p -= 1e-3 * p.grad / norm
    return float(first), float(loss()), no_grad


def _train_cases():
    cases = [("attention", k, [f"model.schedule=list:{k},{k}", "model.num_layers=2"]) for k in _kinds.attention()]
    cases += [
        (
            "attention",
            k,
            [f"model.schedule=list:{k},{k}", "model.num_layers=2", "model.arch=encoder", "train.objective=mlm"],
        )
        for k in _kinds.attention(encoder=True)
    ]
    for e in _kinds.embeddings():
        cases.append(
            (
                "embedding",
                e,
                [f"model.embedding={e}", f"model.embed.hash_spec={catalog.caps('embedding', e).example_hash_spec}"],
            )
        )
    from megahash.objective_spec import names, objective_spec, standard

    for h in _kinds.heads():
        caps = catalog.caps("head", h)
        spec = "md5-bucket64" if h == "hash-bucket" else "md5"  # a bucket spec for a bucket head
        objective = next((n for n in names() if objective_spec(n).head == h), standard())  # the objective training it
        over = [f"model.embed.hash_spec={spec}", f"train.objective={objective}"]
        over += [f"model.head={h}"] if caps.selectable else []
        if objective_spec(objective).arch != "decoder":
            over += [f"model.arch={objective_spec(objective).arch}"]
        cases.append(("head", h, over))
    return cases


TRAIN_CASES = _train_cases()


@pytest.mark.parametrize(
    "group,name,overrides",
    TRAIN_CASES,
    ids=[f"{g}:{n}{':encoder' if 'model.arch=encoder' in o else ''}" for g, n, o in TRAIN_CASES],
)
def test_one_training_step_of_every_kind(dist, group, name, overrides):
    """Every registered attention kind (decoder and, where it runs in one, encoder), embedding and
    head: one gradient step on a batch gives every parameter a gradient and lowers that batch's loss."""
    before, after, no_grad = _one_step(overrides)
    assert torch.isfinite(torch.tensor(before)), f"{group} kind {name!r}: loss {before}"
    own = [n for n in no_grad if "fixed" not in n]  # the fixed input's random buffer is not trained
    assert not own, f"{group} kind {name!r}: parameters without gradient {own}"
    assert after < before, f"{group} kind {name!r}: one step did not lower the loss ({before} -> {after})"


OWN_HELPERS = '''"""A kind file whose cost class and caps use helpers and constants of its own file."""
from __future__ import annotations

import torch

from megahash.models.cost_formulas import GeneralisedRow
from megahash.models.registry import AttentionCaps, register_attention

DEFAULT_GROUPS = 3
CAPS = AttentionCaps(decodes=False, thesis_name="Half")


def _half(n):
    return n // 2


class HalfCosts(GeneralisedRow):
    @staticmethod
    def groups(n, g):
        return g or _half(n) or DEFAULT_GROUPS


class TorchCosts:
    @staticmethod
    def groups(n, g):
        return int(torch.tensor(n))


@register_attention("tmp-half", costs=HalfCosts, caps=CAPS)
def half_spec(cfg):
    return None
'''


def test_source_reader_runs_cost_classes_with_their_own_files_helpers(tmp_path):
    """megahash.kind_source executes a cost class with the helpers, constants and bases of its file (not
    the file's torch part); caps may be any expression of the file; a cost class that uses torch is a
    one-line error naming it."""
    from megahash import kind_source
    from megahash.errors import ConfigError

    path = tmp_path / "tmp_half_kind.py"
    path.write_text(OWN_HELPERS)
    f = kind_source.read(path)
    assert kind_source.read(path) is f  # parsed once
    costs = f.value("HalfCosts")
    assert costs.groups(8, 0) == 4 and costs.groups(1, 0) == 3 and costs.groups(8, 2) == 2
    assert costs.qkv_params(4, 8, 2) == 8 * 8 * 4 * 4 + 2 * 8 * 8 * 4 * 2  # GeneralisedRow: d^2n^2 + 2d^2ng
    [reg] = f.registrations()
    assert (reg.group, reg.name) == ("attention", "tmp-half")
    assert f.evaluate(reg.keyword("caps")) == catalog.AttentionCaps(decodes=False, thesis_name="Half")
    with pytest.raises(ConfigError, match="torch"):
        f.value("TorchCosts")


def test_references_live_in_the_kind_specs():
    """Each @register_reference class sits in its kind's KindSpec (heads, the inputs kinds add, the head of an
    objective too); registry.unregister forgets a kind in one call."""
    reg = _registry()
    table = reg.references()
    assert table["mha"] is table["gqa"] is reg.spec("attention", "mha").reference is reg.reference("mqa") is not None
    assert table["input:rndembqk"] is reg.spec("attention", "rndembqk").input_reference is not None
    from megahash.objective_spec import objective_spec

    sr = reg.spec("head", objective_spec("sr").head)  # the objective's own head (selectable=False)
    assert reg.reference(f"head:{sr.name}") is sr.reference is not None and not sr.caps.selectable
    assert all(reg.reference(f"head:{h}") is reg.spec("head", h).reference for h in _kinds.heads(selectable=True))

    @reg.register_embedding("tmp-unregistered")
    class Tmp:
        pass

    assert "tmp-unregistered" in reg.names("embedding")
    reg.unregister("embedding", "tmp-unregistered")
    assert "tmp-unregistered" not in reg.names("embedding")


def test_kind_files_are_ordinary_python():
    """A kind file imports at the top (no import below its first definition, ruff E402) and marks no
    section with a comment (the HF export finds its reference by the @register_reference definitions)."""
    import ast

    from megahash import kind_source

    files = sorted({e.file for g in catalog.GROUPS for e in catalog.entries(g).values()})
    assert files
    for path in files:
        f = kind_source.read(path)
        code = [
            n
            for n in f.tree.body
            if not isinstance(n, (ast.Import, ast.ImportFrom))
            and not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))
        ]  # the docstring
        late = [
            n.lineno
            for n in f.tree.body
            if isinstance(n, (ast.Import, ast.ImportFrom)) and code and n.lineno > code[0].lineno
        ]
        assert not late, f"{path}: imports below the first definition, lines {late}"
        assert "# ---- megatron-core implementation" not in f.source, path
