"""A new kind is one file (issue 19): a temporary attention kind and a temporary embedding kind,
each written as ONE file of a plugin package outside megahash and found through
``MEGAHASH_PLUGINS`` (megahash.models.catalog), pass `megahash params`, a 1-step `pretrain` on real
shards, TP=2 and TP=2+SP parity and incremental decoding, with no other edit. And no library file
other than a kind's own names it."""
from __future__ import annotations

import ast
import contextlib
import io
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from conftest import ROOT, child_env, pretrain, train_losses  # noqa: E402

PACKAGE = "megahash_toy_kinds"
ATTENTION, EMBEDDING = "tiedqk", "scaled-vocab"

ATTENTION_FILE = '''
"""Tied query-key attention ``tiedqk`` (a test kind): Q_i = K_i = X W_i^{QK}, V_i = X W_i^V, softmax
attention otherwise. Q/K/V parameters 2 d^2 n^2 (d = head dim, n = heads); decode cache K and V."""
# ---- plain-torch reference (the Hugging Face export's code of this kind)
import torch.nn as nn

from megahash.models.registry import register_reference
from megahash.models.torch_model import SoftmaxAttention
from megahash.models.torch_ops import split_heads


@register_reference("tiedqk")
class TiedQKReference(SoftmaxAttention):
    def __init__(self, config, spec):
        super().__init__(config, spec)
        self.linear_qk = nn.Linear(self.d_m, self.n * self.d, bias=self.qkv_bias)
        self.linear_v = nn.Linear(self.d_m, self.n * self.d, bias=self.qkv_bias)

    def project(self, x):
        qk = split_heads(self.linear_qk(x), self.n)
        return qk, qk, split_heads(self.linear_v(x), self.n)


# ---- megatron-core implementation
from megatron.core.transformer.spec_utils import ModuleSpec

from megahash.models.attention.base import column, heads
from megahash.models.attention.mha import SoftmaxAttentionBase
from megahash.models.costs import GeneralisedRow
from megahash.models.registry import AttentionCaps, mask_type, register_attention


class TiedQKAttention(SoftmaxAttentionBase):
    kind = "tiedqk"

    def __init__(self, config, layer_number, attn_mask_type, cfg=None, **kw):
        super().__init__(config, layer_number, attn_mask_type, cfg, **kw)
        self.linear_qk = column(self.d_m, self.n * self.d_h, config, self.qkv_bias)
        self.linear_v = column(self.d_m, self.n * self.d_h, config, self.qkv_bias)
        self.build_proj(self.n * self.d_h)

    def project(self, x):
        qk = heads(self.linear_qk(x)[0], self.n_local)
        return qk, qk, heads(self.linear_v(x)[0], self.n_local)


class TiedQKCosts(GeneralisedRow):
    """Q/K/V 2d^2n^2; the Standard row generalised by it; cache 2BLnd_h numbers."""

    @staticmethod
    def qkv_params(n, d, g):
        return 2 * d * d * n * n

    @staticmethod
    def kv_width(d, h, g):
        return d

    @staticmethod
    def cache_elements(B, L, n, d_h, g, **_):
        return 2 * B * L * n * d_h


@register_attention("tiedqk", costs=TiedQKCosts, caps=AttentionCaps(decodes=True, encoder=True))
def tiedqk_spec(cfg) -> ModuleSpec:
    return ModuleSpec(module=TiedQKAttention, params={"attn_mask_type": mask_type(cfg), "cfg": cfg})
'''

EMBEDDING_FILE = '''
"""Scaled vocabulary embedding ``scaled-vocab`` (a test kind): e = (1 + a) E[token], a learned gain a."""
# ---- plain-torch reference (the Hugging Face export's code of this kind)
import torch
import torch.nn as nn

from megahash.models.registry import register_reference


@register_reference("scaled-vocab")
class ScaledVocabReference(nn.Module):
    tieable = False

    def __init__(self, config):
        super().__init__()
        self.word_embeddings = nn.Embedding(config.padded_vocab_size, config.hidden_size)
        self.gain = nn.Parameter(torch.zeros(1))

    def forward(self, tokens, codes=None):
        return self.word_embeddings(tokens) * (1 + self.gain)


# ---- megatron-core implementation
import torch
from megatron.core import tensor_parallel

from megahash.models.embeddings.vocab import EmbeddingOutput
from megahash.models.registry import EmbeddingCaps, register_embedding


@register_embedding("scaled-vocab", caps=EmbeddingCaps(reads_hash_codes=False, sr_random="token"))
class ScaledVocabEmbedding(EmbeddingOutput):
    tieable = False

    def __init__(self, config, cfg, vocab_size: int):
        super().__init__(config=config)
        self.word_embeddings = tensor_parallel.VocabParallelEmbedding(
            num_embeddings=vocab_size, embedding_dim=config.hidden_size, init_method=config.init_method,
            config=config)
        self.gain = torch.nn.Parameter(torch.zeros(1, dtype=config.params_dtype))
        self.dropout = torch.nn.Dropout(config.hidden_dropout)

    def forward(self, tokens, hash_codes=None):
        return self.finish(self.word_embeddings(tokens) * (1 + self.gain))
'''


@pytest.fixture(scope="module")
def plugin(tmp_path_factory):
    """The plugin package (two files, one per kind) on sys.path and in MEGAHASH_PLUGINS; afterwards
    the registry is as before."""
    from megahash.models import catalog, registry

    root = tmp_path_factory.mktemp("plugin")
    pkg = root / PACKAGE
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "tiedqk.py").write_text(textwrap.dedent(ATTENTION_FILE))
    (pkg / "scaled_vocab.py").write_text(textwrap.dedent(EMBEDDING_FILE))
    old_env = os.environ.get(catalog.PLUGINS_ENV)
    os.environ[catalog.PLUGINS_ENV] = PACKAGE
    sys.path.insert(0, str(root))
    catalog._scan.cache_clear()
    env = {catalog.PLUGINS_ENV: PACKAGE, "PYTHONPATH": f"{ROOT}{os.pathsep}{root}"}
    yield {"root": root, "env": env}
    sys.path.remove(str(root))
    if old_env is None:
        os.environ.pop(catalog.PLUGINS_ENV, None)
    else:
        os.environ[catalog.PLUGINS_ENV] = old_env
    for d in (registry.ATTENTION, registry.COSTS, registry.MAPS, registry.EXPORT_SPEC, registry.CAPS["attention"]):
        d.pop(ATTENTION, None)
    for d in (registry.EMBEDDINGS, registry.EXPORT_META, registry.CAPS["embedding"]):
        d.pop(EMBEDDING, None)
    for name in (ATTENTION, EMBEDDING):
        registry.REFERENCES.pop(name, None)
    for m in [m for m in sys.modules if m.split(".")[0] == PACKAGE]:
        del sys.modules[m]
    catalog._config_plugins.clear()
    catalog._scan.cache_clear()


def test_config_names_plugins_too(plugin, monkeypatch):
    """``model.plugins`` finds the same package without the environment variable (config checks,
    torch-free); an unknown plugin is a one-line ConfigError. (First in this file: once a process
    has imported a plugin its kinds stay registered there.)"""
    from megahash.config import load_config
    from megahash.errors import ConfigError
    from megahash.models import catalog
    from megahash.models.light import check_kinds

    monkeypatch.delenv(catalog.PLUGINS_ENV)
    catalog._scan.cache_clear()
    try:
        cfg = load_config(None, [f"model.schedule=uniform:{ATTENTION}", "model.num_layers=2"])
        with pytest.raises(ConfigError, match=f"unknown attention kind '{ATTENTION}'"):
            check_kinds(cfg)
        cfg = load_config(None, [f"model.plugins=[{PACKAGE}]", f"model.schedule=uniform:{ATTENTION}",
                                 "model.num_layers=2", f"model.embedding={EMBEDDING}"])
        assert check_kinds(cfg) == [ATTENTION, ATTENTION]
        with pytest.raises(ConfigError, match="plugin 'no_such_plugin_pkg' cannot be found"):
            check_kinds(load_config(None, ["model.plugins=[no_such_plugin_pkg]"]))
    finally:
        catalog._config_plugins.clear()
        catalog._scan.cache_clear()


def test_registry_discovers_the_plugin_kinds(plugin, dist):
    from megahash.models import catalog, registry

    assert catalog.source_file("attention", ATTENTION).startswith(str(plugin["root"]))
    assert catalog.source_file("embedding", EMBEDDING).startswith(str(plugin["root"]))
    registry._load_variants()
    assert ATTENTION in registry.ATTENTION and EMBEDDING in registry.EMBEDDINGS
    assert catalog.caps("attention", ATTENTION).decodes and not catalog.caps("embedding", EMBEDDING).reads_hash_codes


def _params(argv) -> dict:
    from megahash.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["params", "--config", "configs/quickstart.yaml", *argv]) == 0
    return out.getvalue()


def test_params_counts_and_costs_the_new_kinds(plugin, dist):
    """`megahash params`: the new attention layer's Q/K/V count is its own formula (2 d^2 n^2) and its
    cost rows are its own formulas; a kind without a cost model (mha-megatron: costs=None, nothing
    measurable) shows one "n/a" line and no MFU FLOPs, never an error."""
    from megahash.config import load_config

    over = [f"model.schedule=list:{ATTENTION},mha", "model.num_layers=2", f"model.embedding={EMBEDDING}"]
    r = json.loads(_params(["--json", *over]))
    cfg = load_config("configs/quickstart.yaml", over)
    n, h = cfg.model.num_heads, cfg.model.hidden_size
    d = h // n
    layer = r["layers"][0]
    assert layer["kind"] == ATTENTION
    assert layer["attention"]["qkv"] == 2 * d * d * n * n + 2 * n * d  # + the two projections' biases
    assert r["embedding"] == r["vocab_size"] * h + 1  # table + gain
    row = next(L for L in r["costs"]["layers"] if L["kind"] == ATTENTION)
    L = cfg.data.seq_length
    p = 2 * d * d * n * n
    assert row["prefill_flops"] == 2 * L * p + 4 * L * L * h  # GeneralisedRow with its own qkv_params, B = 1
    assert row["cache_bytes"] == row["impl_cache_bytes"] == 4 * L * h  # keys and values of n heads, 16-bit
    assert isinstance(r["costs"]["train_flops_per_token"], float)
    text = _params(["model.schedule=list:mha-megatron,mha", "model.num_layers=2"])
    assert "n/a FLOPs/token (MFU n/a)" in text
    assert sum("mha-megatron: no cost model" in line for line in text.splitlines()) == 1


def test_decoding_with_the_new_kinds_equals_the_full_forward(plugin, dist):
    from megahash import accelerator
    from megahash.config import load_config
    from megahash.models import costs
    from megahash.models.model import DecodeState, build_model

    cfg = load_config(None, ["model.hidden_size=32", "model.num_layers=2", "model.num_heads=4", "model.ffn_hidden_size=64",
                             f"model.schedule=uniform:{ATTENTION}", f"model.embedding={EMBEDDING}", "data.seq_length=16"])
    accelerator.seed_all(0)
    model = build_model(cfg, 128, dtype=torch.float64).eval()
    tok = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = model.hidden_states(tok)
        state = DecodeState(2)
        parts = [model.hidden_states(tok[:, :5], decode_state=state)]
        parts += [model.hidden_states(tok[:, i:i + 1], decode_state=state) for i in range(5, 12)]
    torch.testing.assert_close(torch.cat(parts), full, rtol=0, atol=1e-10)
    expected = costs.cache_elements(ATTENTION, 2, 12, 4, 8)  # the kind's own formula
    assert all(sum(v.numel() for v in c.values()) == expected for c in state.caches)


def test_tp2_parity_of_the_new_kinds(plugin, tmp_path):
    """TP=1 vs TP=2 vs TP=2+SP (tests/attention_tp_worker.py, one 2-rank launch): equal loss and
    gradient norms for the new attention kind (decoder, encoder) with the new embedding."""
    from megahash.launching.env import free_port

    out = tmp_path / "tp.json"
    cases = [f"{ATTENTION}@emb={EMBEDDING}", f"{ATTENTION}@encoder@emb={EMBEDDING}"]
    port = free_port()
    procs = []
    for rank in range(2):
        env = child_env(RANK=rank, WORLD_SIZE=2, LOCAL_RANK=rank, MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
                        **plugin["env"])
        procs.append(subprocess.Popen([sys.executable, str(ROOT / "tests" / "attention_tp_worker.py"), str(out),
                                       ",".join(cases)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))
    logs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(log[-3000:] for log in logs)
    results = json.loads(out.read_text())
    assert set(results) == set(cases)
    for case, r in results.items():
        ref = r["tp1"]
        for setting in ("tp2", "tp2sp"):
            got = r[setting]
            # the loss is megatron's fp32 vocab-parallel cross-entropy of fp64 logits: two fp32 ulps
            assert abs(got["loss"] - ref["loss"]) <= 2.4e-7 * abs(ref["loss"]), (case, setting, got, ref)
            for key in ("grad_sq", "attn_grad_sq"):
                assert abs(got[key] - ref[key]) < 1e-7 * ref[key], (case, setting, key, got, ref)


def test_one_step_pretrain_with_the_new_kinds(plugin, shakespeare_shards, tmp_path):
    """`pretrain` (the real entry point, real shards) runs a step with both new kinds and a layer
    without a cost model: MFU is reported as n/a in one line instead of a crash."""
    run_dir = tmp_path / "run"
    r = pretrain([f"data.prefix=[{shakespeare_shards['prefix']}]", f"data.tokenizer={shakespeare_shards['tokenizer']}",
                  f"model.schedule=list:{ATTENTION},mha-megatron", "model.num_layers=2", f"model.embedding={EMBEDDING}",
                  "train.steps=1", f"train.save_dir={run_dir}", "train.eval_interval=1", "train.save_interval=0",
                  "data.valid_samples=4", "data.valid_micro_batch=2",
                  "data.seq_length=32", "train.micro_batch_size=2", "train.global_batch_size=2"],
                 config="configs/quickstart.yaml", **plugin["env"])
    assert r.returncode == 0, r.stderr[-3000:]
    losses = train_losses(run_dir)
    assert list(losses) == [1] and losses[1] == losses[1] and losses[1] > 0
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    valid = [rec for rec in records if rec["split"] == "valid"]
    assert valid and "ppl" in valid[-1], records  # the vocabulary head's loss is nats per token
    assert (r.stdout + r.stderr).count("MFU n/a") == 1


def test_export_and_transformers_reload_of_the_new_kinds(plugin, dist, tmp_path):
    """export-hf assembles the new kinds' plain-torch sections from their own files: transformers
    (trust_remote_code, offline) loads the folder and its logits equal megahash's."""
    from megahash import accelerator
    from megahash.config import load_config
    from megahash.convert.export import export_model
    from megahash.convert.verify import load_hf
    from megahash.models.model import build_model

    cfg = load_config(None, ["model.hidden_size=32", "model.num_layers=2", "model.num_heads=4", "model.ffn_hidden_size=64",
                             f"model.schedule=list:{ATTENTION},mha", f"model.embedding={EMBEDDING}",
                             "data.seq_length=16", "model.tie_embeddings=false"])
    accelerator.seed_all(0)
    model = build_model(cfg, 120).eval()
    with torch.no_grad():
        model.embedding.gain.fill_(0.5)  # the gain must reach the export
    export_model(cfg, model, tmp_path / "hf", vocab_size=120)
    code = [f.read_text() for f in (tmp_path / "hf").glob("*tiedqk.py")]
    assert len(code) == 1 and "TiedQKReference" in code[0] and "megatron" not in code[0]  # its file's torch-only section, nothing else
    hf = load_hf(tmp_path / "hf")
    tok = torch.randint(0, 120, (2, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = model(tok)[..., :120].float()
        theirs = hf(input_ids=tok).logits.float()
    torch.testing.assert_close(theirs, ours, rtol=1e-4, atol=1e-4)


# -------------------------------------------------------------------------- no other file names a kind

# (name, path prefix): string constants that are a different thing of the same spelling
HOMONYMS = {
    ("mlp", "megahash/models/accounting.py"): "the MLP sublayer's parameter count in `megahash params`",
    ("mlp", "megahash/models/light.py"): "the MLP sublayer's parameter count (closed form)",
    ("rolling", "megahash/hashing/"): "the rolling hash-spec family (hashing knows no model kinds)",
    ("add", "megahash/models/attention/mhe.py"): "MHE's add/mul head-embedding mode (eq. 3.5)",
}


def _constants(path: Path):
    tree = ast.parse(path.read_text())
    docs = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
            docs.add(id(body[0].value))
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            yield node


def test_no_library_file_but_its_own_names_a_kind():
    """For every registered attention kind, embedding kind and head: the library files (megahash/,
    code, not docstrings) other than the kind's own that use its name as a string: 0."""
    from megahash.models import catalog

    own: dict[str, set] = {}
    for group in catalog.GROUPS:
        for name, e in catalog.entries(group).items():
            own.setdefault(name, set()).add(Path(e.file).resolve())
    found: dict[str, set] = {name: set() for name in own}
    for path in sorted((ROOT / "megahash").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        for node in _constants(path):
            if node.value in own and path.resolve() not in own[node.value]:
                if not any(node.value == n and rel.startswith(p) for n, p in HOMONYMS):
                    found[node.value].add(f"{rel}:{node.lineno}")
    assert len(found) >= 20  # every kind was checked (16 attention, 7 embeddings, 4 heads; names may coincide)
    assert {k: sorted(v) for k, v in found.items() if v} == {}
