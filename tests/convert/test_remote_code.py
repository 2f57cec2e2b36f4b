"""The model exists once (issue 19, item 2): each kind's plain-torch reference lives in the kind's own
file, the HF remote-code folder is assembled from the library's torch-only code, and the references
are the TP=1 reference of the library model (embeddings and heads here; attention kinds in
tests/models/test_attention.py::test_tp2_parity_all_kinds, export + transformers reload in tests/convert/test_convert.py).
"""

from __future__ import annotations

import ast
import inspect
import os
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import _emb_helpers as H
import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.usefixtures("dist"), pytest.mark.numerics]  # one-rank world (conftest)


def _batch(cfg, kind):
    tok, codes = H.word_batches(H.KINDS[kind][0], 2, 17, 1, vocab_size=120)[0]
    tok, codes = tok[:, :16], codes[:, :16]
    padding = None
    if cfg.model.arch == "encoder":
        padding = torch.ones(tok.shape, dtype=torch.bool)
        padding[1, -5:] = False
    return tok, codes, padding


@pytest.mark.parametrize(
    "case", range(len(H.PARITY_CASES)), ids=[f"{k}{'+' + '+'.join(e) if e else ''}" for k, e in H.PARITY_CASES]
)
def test_reference_equals_library_at_tp1(case):
    """Every embedding kind and head (decoder and encoder; hash heads; Shuffle+Random): the plain-torch
    reference (the HF export's model, weights through the export's name map) gives the library's
    logits and the same gradient for every parameter, in float64."""
    from megahash.accelerator import rng
    from megahash.convert.reference import reference_model, reference_names
    from megahash.models.megatron_model import build_model

    kind, extra = H.PARITY_CASES[case]
    cfg = H.tiny_cfg(kind, list(extra), seq=16)
    rng.seed_all(1234)
    model = build_model(cfg, 200, dtype=torch.float64)
    with torch.no_grad():  # zero-initialised rows (word_row, special, biases) must matter too
        g = torch.Generator().manual_seed(5)
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.05)
    ref = reference_model(cfg, model)
    tok, codes, padding = _batch(cfg, kind)
    codes = codes if codes.dtype == torch.uint8 else codes.long()
    a = model(tok, hash_codes=codes, padding_mask=padding)
    b = ref(input_ids=tok, hash_codes=codes, attention_mask=None if padding is None else padding.long()).logits
    keep = padding if padding is not None else torch.ones(tok.shape, dtype=torch.bool)
    assert a.shape == b.shape
    assert (a - b)[keep].abs().max().item() < 1e-9
    w = torch.randn(a[keep].shape, generator=torch.Generator().manual_seed(9), dtype=a.dtype)
    (a[keep] * w).sum().backward()
    (b[keep] * w).sum().backward()
    params = dict(ref.named_parameters())
    names = reference_names(model, ref)
    checked = 0
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        q = params[names[name]]
        rel = ((q.grad - p.grad).abs().max() / p.grad.abs().max().clamp_min(1e-30)).item()
        assert rel < 1e-5, (name, rel)  # float64 models; proj/rolling compute their features in float32
        checked += 1
    assert checked == sum(1 for p in model.parameters() if p.grad is not None) > 0


def test_export_names_a_kind_without_reference_before_writing(tmp_path, monkeypatch):
    """A kind with no @register_reference: export-hf fails with one line naming the kind, and writes nothing."""
    from megahash.config import load_config
    from megahash.convert.export import export_model
    from megahash.errors import ConfigError
    from megahash.models import registry
    from megahash.models.megatron_model import build_model

    cfg = load_config(
        None,
        [
            "model.hidden_size=32",
            "model.num_layers=2",
            "model.num_heads=4",
            "model.ffn_hidden_size=64",
            "model.schedule=list:mha,nonapprox",
            "data.seq_length=16",
        ],
    )
    model = build_model(cfg, 200)
    monkeypatch.setattr(registry.spec("attention", "nonapprox"), "reference", None)
    out = tmp_path / "hf"
    with pytest.raises(ConfigError) as e:
        export_model(cfg, model, out, fmt="megahash")
    assert "nonapprox" in str(e.value) and "mha" not in str(e.value).replace("megahash", "")
    assert "\n" not in str(e.value)
    assert not out.exists()


class _BackToLibraryImports(ast.NodeTransformer):
    """The folder's imports mapped back to the library's: ``from .file import y`` -> ``from megahash.x
    import y``; a deferred ``y = __import__("importlib").import_module(".file", __package__).y`` (one
    statement per name, on one line) -> ``from megahash.x import y``; the entry modules' closing list of
    ``from .file import __name__ as _folder_file`` lines dropped."""

    def __init__(self, back):
        self.back = back

    def visit_ImportFrom(self, node):
        if node.level == 1:
            if [a.name for a in node.names] == ["__name__"]:
                return None
            node.module, node.level = self.back[node.module], 0
        return node

    def _deferred(self, node):
        v = node.value if isinstance(node, ast.Assign) and len(node.targets) == 1 else None
        call = getattr(v, "value", None)
        if (
            isinstance(v, ast.Attribute)
            and isinstance(call, ast.Call)
            and ast.unparse(call.func).endswith("import_module")
            and isinstance(call.args[0], ast.Constant)
            and call.args[0].value.startswith(".")
        ):
            return self.back[call.args[0].value[1:]], v.attr, node.targets[0].id
        return None

    def generic_visit(self, node):
        super().generic_visit(node)
        for field in ("body", "orelse", "finalbody"):
            stmts = getattr(node, field, None)
            if not isinstance(stmts, list):
                continue
            out = []
            for st in stmts:
                d = self._deferred(st)
                if d is None:
                    out.append(st)
                    continue
                module, name, asname = d
                alias = ast.alias(name=name, asname=None if asname == name else asname)
                prev = out[-1] if out else None
                if isinstance(prev, ast.ImportFrom) and prev.module == module and prev.lineno == st.lineno:
                    prev.names.append(alias)
                else:
                    out.append(ast.ImportFrom(module=module, names=[alias], level=0, lineno=st.lineno))
            setattr(node, field, out)
        return node


def test_folder_is_assembled_from_the_library_code():
    """The remote code is the library's: the shell/wrapper/ops modules verbatim up to import lines, and
    each kind's reference class exactly its source in the kind's own file (decorators stripped);
    nothing under megahash/convert/ defines a model module of its own."""
    from megahash.convert import remote_code

    table = remote_code.references()
    folder = remote_code.assemble(sorted(table))
    back = {f: m for m, f in remote_code.LIBRARY_FILES.items()} | {
        "megahash_references": "megahash.models.reference_table"
    }
    for module, name in remote_code.LIBRARY_FILES.items():
        lib = ast.parse(Path(inspect.getsourcefile(__import__(module, fromlist=["x"]))).read_text())
        got = _BackToLibraryImports(back).visit(ast.parse(folder[name + ".py"]))
        assert ast.dump(got) == ast.dump(lib), name  # the same module, statement for statement
    for kind, cls in table.items():
        text = folder[remote_code.kind_module_file(cls.__module__) + ".py"]
        src = inspect.getsource(cls).split("\n")
        body = "\n".join(line for line in src if not line.startswith("@register_reference"))
        assert body in text, kind
        assert "megatron" not in text and "register_reference" not in text
    assert "megahash_references.py" in folder and all(f"{k!r}:" in folder["megahash_references.py"] for k in table)
    for f in sorted((ROOT / "megahash" / "convert").rglob("*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ClassDef):
                bases = {ast.unparse(b) for b in node.bases}
                assert not bases & {"nn.Module", "torch.nn.Module", "PreTrainedModel"}, (f, node.name)


PLUGIN = '''"""A test kind outside the package: mha with doubled queries (a subclass of mha's kind)."""
from __future__ import annotations

from megatron.core import parallel_state  # noqa: F401  (not torch-only: never copied)

from megahash.models.attention.mha import GroupedQuery
from megahash.models.registry import register_attention

SCALE = 2  # a constant of the file the kind uses: copied with it


class DoubledQuery(GroupedQuery):
    """softmax(2 Q K^T / sqrt(d_h)) V."""

    def project(self, x):
        q, k, v = super().project(x)
        return SCALE * q, k, v


register_attention("tmp-doubled-q", DoubledQuery)
'''

BAD_PLUGIN = """from __future__ import annotations

from megatron.core import parallel_state

from megahash.models.attention.mha import GroupedQuery
from megahash.models.registry import register_attention


class Bad(GroupedQuery):
    def project(self, x):
        return helper(super().project(x))


def helper(t):
    return t if parallel_state.get_tensor_model_parallel_world_size() == 1 else None


register_attention("tmp-bad", Bad)
"""


def test_plugin_kind_outside_the_package_is_assembled(tmp_path, monkeypatch):
    """A kind file outside megahash whose reference subclasses another kind's: the folder gets both
    modules (relative imports, the file's constant it uses), loads as a package and computes what the
    library's reference does; a reference that uses, through a helper of its file, a name that is not
    torch-only is refused, naming the helper."""
    import importlib
    import sys

    from megahash.convert import remote_code
    from megahash.errors import ConfigError
    from megahash.models import hf_model, registry
    from megahash.models.hf_config import MegahashConfig

    monkeypatch.setitem(registry.KINDS, "attention", registry.kinds("attention"))  # restored afterwards
    (tmp_path / "tmp_plugin_kind.py").write_text(PLUGIN)
    (tmp_path / "tmp_bad_plugin_kind.py").write_text(BAD_PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.import_module("tmp_plugin_kind")
    importlib.import_module("tmp_bad_plugin_kind")
    with pytest.raises(ConfigError, match="helper"):
        remote_code.assemble(["tmp-bad"])
    files = remote_code.assemble(["tmp-doubled-q", "vocab"])
    assert {"megahash_tmp_plugin_kind.py", "megahash_attention_mha.py"} <= set(files)
    assert "megatron" not in files["megahash_tmp_plugin_kind.py"] and "tmp-bad" not in files["megahash_references.py"]
    pkg = tmp_path / "exported_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    for name, text in files.items():
        (pkg / name).write_text(text)
    folder = importlib.import_module("exported_pkg.modeling_megahash")
    fields = dict(
        vocab_size=50,
        padded_vocab_size=64,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        embedding="vocab",
        head="vocab",
        qkv_bias=True,
        layer_specs=[{"kind": "tmp-doubled-q", "groups": 4}, {"kind": "tmp-doubled-q", "groups": 2}],
    )
    config_cls = importlib.import_module("exported_pkg.configuration_megahash").MegahashConfig
    torch.manual_seed(0)
    a = folder.MegahashForCausalLM(config_cls(**fields)).eval()
    b = hf_model.MegahashForCausalLM(MegahashConfig(**fields)).eval()
    b.load_state_dict(a.state_dict())
    ids = torch.randint(0, 50, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        # bit-exact: the exported file is the same code with the same weights: one path
        assert torch.equal(a(input_ids=ids).logits, b(input_ids=ids).logits)
    assert type(a.model.decoder.layers[0].self_attention).__module__ == "exported_pkg.megahash_tmp_plugin_kind"
    for name in [m for m in sys.modules if m.startswith(("exported_pkg", "tmp_plugin_kind", "tmp_bad_plugin_kind"))]:
        del sys.modules[name]


@pytest.mark.parametrize("schedule", ["list:mha,approx,rndembqk", "list:mqa,nonapprox,staticembqk"])
def test_beam_search_with_the_cache_equals_without(schedule):
    """The plain-torch model's cache reorders its rows for beam search along each tensor's batch dimension
    (the layers' sequence-first keys and values, the recurrent kinds' batch-first states, the fixed keys the
    batch shares): beam search with the cache gives the tokens it gives without one."""
    from test_attention import build, make_cfg

    from megahash.convert.reference import reference_model

    model = build(make_cfg(schedule, "model.init_std=0.3", layers=3)).eval()  # a random model whose beams differ
    hf = reference_model(model.cfg, model).eval()
    ids = torch.randint(5, 128, (2, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        cached = hf.generate(ids, max_new_tokens=8, do_sample=False, num_beams=3, use_cache=True, pad_token_id=1)
        uncached = hf.generate(ids, max_new_tokens=8, do_sample=False, num_beams=3, use_cache=False, pad_token_id=1)
    # bit-exact: greedy token ids (fp64, fixed seed, no near-tie)
    assert torch.equal(cached, uncached)
