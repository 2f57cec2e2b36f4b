"""A new kind is one file (issue 19): a temporary attention kind and a temporary embedding kind,
each written as ONE file of a plugin package outside megahash and found through
``MEGAHASH_PLUGINS`` (megahash.catalog), pass `megahash params`, a 1-step `pretrain` on real
shards, TP=2 and TP=2+SP parity and incremental decoding, with no other edit. And no library file
other than a kind's own names it."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import subprocess
import sys
import textwrap

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest
import torch

from conftest import ROOT, child_env, doc_block, megahash_here, pretrain_here, train_losses

PACKAGE = "megahash_toy_kinds"
SMALL = ["model.hidden_size=32", "model.num_layers=2", "model.num_heads=4", "model.ffn_hidden_size=64"]
ATTENTION, EMBEDDING = "tiedqk", "scaled-vocab"

# the worked example of docs/architecture.md, as a reader copies it
ATTENTION_FILE = doc_block("docs/architecture.md", "## Worked example: add an attention kind")

# the worked example of docs/embeddings.md, as a reader copies it
EMBEDDING_FILE = doc_block("docs/embeddings.md", "## Adding an embedding kind or a head")

ANCHOR, ANCHOR_FILE = (
    "anchorqk",
    """
\"\"\"Anchored query-key attention ``anchorqk`` (a test kind with an option and a model input): Q, K from
a fixed random input A [L, h] that the kind adds to the model (``model.anchor.rows``, seeded by the
kind's option ``model.attention.options.anchor_seed``), V from the hidden states; causal softmax, ONE
map shared by the batch. Decode cache: the values only.\"\"\"
import math
from dataclasses import dataclass

import torch
import torch.nn as nn

from megahash.errors import ConfigError
from megahash.models.kind_input import KindInput
from megahash.models.mixing import Mixing, append_cache, heads
from megahash.models.registry import AttentionCaps, register_attention, register_reference


class AnchorQK(Mixing):
    def build(self, parts):
        if self.setup.sequence_parallel:
            raise ConfigError("anchorqk: no sequence parallelism (a test kind)")
        self.linear_q = parts.column(self.d_m, self.n * self.d_h, self.qkv_bias)
        self.linear_k = parts.column(self.d_m, self.n * self.d_h, self.qkv_bias)
        self.linear_v = parts.column(self.d_m, self.n * self.d_h, self.qkv_bias)

    def mix(self, x, attention_mask, rotary_pos_emb, state):
        s, b = x.shape[:2]
        off = state.offset
        rows = state.inputs["anchor"][:off + s].unsqueeze(1).to(x.dtype)  # [off+s, 1, h]
        q = heads(self.linear_q(rows[off:]), self.n_local).permute(1, 2, 0, 3)  # [1, n, s, d]
        k = heads(self.linear_k(rows), self.n_local).permute(1, 2, 0, 3)  # [1, n, off+s, d]
        v = append_cache(state.cache(self.layer_number), "v", heads(self.linear_v(x), self.n_local)).permute(1, 2, 0, 3)
        scores = q @ k.transpose(-1, -2) / math.sqrt(self.d_h)
        future = torch.ones(s, off + s, dtype=torch.bool, device=x.device).triu(off + 1)
        out = scores.masked_fill(future, float("-inf")).softmax(-1) @ v  # [b, n, s, d]
        return out.permute(2, 0, 1, 3).reshape(s, b, -1)


@register_reference("input:anchorqk")
class AnchorInputReference(nn.Module):
    def __init__(self, config, meta):
        super().__init__()
        self.register_buffer("rows", torch.zeros(int(meta["length"]), config.hidden_size))

    def reset(self):
        pass

    def context(self, model, needed):
        return {"anchor": self.rows}


@dataclass(frozen=True)
class AnchorOptions:
    \"\"\"``model.attention.options`` of anchorqk.\"\"\"

    anchor_seed: int = 7  # seed of the anchor rows
    anchor_length: int = 256  # rows of the anchor (longest sequence)
    RANGES = {"anchor_length": (1, None, False, False, "anchor rows")}


class AnchorInput(KindInput):
    \"\"\"The anchor rows, a buffer of the model (checkpointed and exported under ``anchor.``), handed to the
    layers in the forward's state.\"\"\"

    attr = "anchor"

    def __init__(self, cfg, config):
        super().__init__()
        o = cfg.model.attention.options
        g = torch.Generator().manual_seed(o.anchor_seed)
        rows = torch.randn(o.anchor_length, config.hidden_size, generator=g) * cfg.model.init_std
        self.register_buffer("rows", rows.to(config.params_dtype))

    def enter(self, model, state, emb, mask, seq_len, rotary):
        state.inputs["anchor"] = self.rows
        return emb, mask

    def export_meta(self):
        return {"kind": "anchorqk", "length": int(self.rows.shape[0])}


register_attention("anchorqk", AnchorQK, options=AnchorOptions, model_input=lambda model, cfg: AnchorInput(cfg, model.config),
                   caps=AttentionCaps(encoder=False, decodes=True))
""",
)

# a kind that computes a non-persistent buffer in ``build`` (ALiBi slopes, RoPE tables are such) and a head over
# the vocabulary whose loss is not nats per token (label smoothing): both must export like any other kind
BUFFER, BUFFER_FILE = (
    "gainqk",
    """
\"\"\"Per-head query gains ``gainqk`` (a test kind): tied QK with q_i scaled by a fixed g_i = 1 + i / n, a
buffer computed in build (not saved: the export must rebuild it).\"\"\"
import torch

from megahash.models.attention.softmax_base import SoftmaxAttention
from megahash.models.mixing import heads
from megahash.models.registry import AttentionCaps, register_attention


class GainQK(SoftmaxAttention):
    def build(self, parts):
        self.linear_qkv = parts.column(self.d_m, 3 * self.n * self.d_h, self.qkv_bias)
        first = self.tp_rank * self.n_local
        gains = [1.0 + (first + i) / self.n for i in range(self.n_local)]
        self.register_buffer("gains", torch.tensor(gains), persistent=False)

    def project(self, x):
        q, k, v = heads(self.linear_qkv(x), 3 * self.n_local).chunk(3, dim=2)
        return q * self.gains[:, None].to(q.dtype), k, v


register_attention("gainqk", GainQK, caps=AttentionCaps(decodes=True, encoder=True))
""",
)

SMOOTHED, SMOOTHED_FILE = (
    "vocab-ls",
    """
\"\"\"Label-smoothed vocabulary head ``vocab-ls`` (a test kind): the output layer's logits, cross-entropy
with label smoothing 0.1 (not nats per token: ``token_loss=False``).\"\"\"
import torch
from megatron.core import tensor_parallel

from megahash.models.registry import HeadCaps, register_head


@register_head("vocab-ls", caps=HeadCaps(token_loss=False))
class SmoothedVocabHead(torch.nn.Module):
    uses_output_layer = True

    def __init__(self, config=None, cfg=None, vocab_size=None):
        super().__init__()

    def forward(self, model, hidden, labels=None, label_codes=None, hash_codes=None):
        logits = model.logits(hidden)
        if labels is None:
            return logits.transpose(0, 1).contiguous()
        lab = labels.transpose(0, 1).contiguous()
        loss = tensor_parallel.vocab_parallel_cross_entropy(logits.float(), lab.clamp(min=0), 0.1)
        return loss.masked_fill(lab < 0, 0.0).transpose(0, 1).contiguous()
""",
)


@pytest.fixture(scope="module")
def plugin(tmp_path_factory):
    """The plugin package (two files, one per kind) on sys.path and in MEGAHASH_PLUGINS; afterwards
    the registry is as before."""
    from megahash import catalog
    from megahash.models import registry

    root = tmp_path_factory.mktemp("plugin")
    pkg = root / PACKAGE
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "tiedqk.py").write_text(textwrap.dedent(ATTENTION_FILE))
    (pkg / "scaled_vocab.py").write_text(textwrap.dedent(EMBEDDING_FILE))
    (pkg / "anchorqk.py").write_text(textwrap.dedent(ANCHOR_FILE))
    (pkg / "gainqk.py").write_text(textwrap.dedent(BUFFER_FILE))
    (pkg / "vocab_ls.py").write_text(textwrap.dedent(SMOOTHED_FILE))
    old_env = os.environ.get(catalog.PLUGINS_ENV)
    os.environ[catalog.PLUGINS_ENV] = PACKAGE
    sys.path.insert(0, str(root))
    catalog._scan.cache_clear()
    catalog._option_specs.cache_clear()
    env = {catalog.PLUGINS_ENV: PACKAGE, "PYTHONPATH": f"{ROOT}{os.pathsep}{root}"}
    yield {"root": root, "env": env}
    sys.path.remove(str(root))
    if old_env is None:
        os.environ.pop(catalog.PLUGINS_ENV, None)
    else:
        os.environ[catalog.PLUGINS_ENV] = old_env
    for group, name in (
        ("attention", ATTENTION),
        ("attention", ANCHOR),
        ("attention", BUFFER),
        ("embedding", EMBEDDING),
        ("head", SMOOTHED),
    ):
        registry.unregister(group, name)
    for m in [m for m in sys.modules if m.split(".")[0] == PACKAGE]:
        del sys.modules[m]
    catalog._config_plugins.clear()
    catalog._scan.cache_clear()
    catalog._option_specs.cache_clear()


def test_config_names_plugins_too(plugin, monkeypatch):
    """``model.plugins`` finds the same package without the environment variable (config checks,
    torch-free); an unknown plugin, or a built-in or frozen module, is a one-line ConfigError. (First in this file: once a process
    has imported a plugin its kinds stay registered there.)"""
    from megahash import catalog
    from megahash.config import load_config
    from megahash.errors import ConfigError
    from megahash.models.schedules import check_kinds

    monkeypatch.delenv(catalog.PLUGINS_ENV)
    catalog._scan.cache_clear()
    try:
        cfg = load_config(None, [f"model.schedule=uniform:{ATTENTION}", "model.num_layers=2"])
        with pytest.raises(ConfigError, match=f"unknown attention kind '{ATTENTION}'"):
            check_kinds(cfg)
        cfg = load_config(
            None,
            [
                f"model.plugins=[{PACKAGE}]",
                f"model.schedule=uniform:{ATTENTION}",
                "model.num_layers=2",
                f"model.embedding={EMBEDDING}",
            ],
        )
        assert check_kinds(cfg) == [ATTENTION, ATTENTION]
        with pytest.raises(ConfigError, match="plugin 'no_such_plugin_pkg' cannot be found"):
            check_kinds(load_config(None, ["model.plugins=[no_such_plugin_pkg]"]))
        for name, origin in (("abc", "frozen"), ("sys", "built-in")):  # "No such file or directory: frozen" before
            catalog._config_plugins.clear()
            catalog._scan.cache_clear()
            with pytest.raises(ConfigError, match=f"plugin '{name}' is '{origin}', not a Python source file"):
                check_kinds(load_config(None, [f"model.plugins=[{name}]"]))
    finally:
        catalog._config_plugins.clear()
        catalog._scan.cache_clear()


def test_registry_discovers_the_plugin_kinds(plugin, dist):
    from megahash import catalog
    from megahash.models import registry

    assert catalog.source_file("attention", ATTENTION).startswith(str(plugin["root"]))
    assert catalog.source_file("embedding", EMBEDDING).startswith(str(plugin["root"]))
    assert ATTENTION in registry.names("attention") and EMBEDDING in registry.names("embedding")
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
    from megahash.accelerator import rng
    from megahash.config import load_config
    from megahash.models import costs
    from megahash.models.megatron_model import DecodeState, build_model

    cfg = load_config(
        None,
        [
            *SMALL,
            f"model.schedule=uniform:{ATTENTION}",
            f"model.embedding={EMBEDDING}",
            "data.seq_length=16",
        ],
    )
    rng.seed_all(0)
    model = build_model(cfg, 128, dtype=torch.float64).eval()
    tok = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = model.hidden_states(tok)
        state = DecodeState(2)
        parts = [model.hidden_states(tok[:, :5], decode_state=state)]
        parts += [model.hidden_states(tok[:, i : i + 1], decode_state=state) for i in range(5, 12)]
    torch.testing.assert_close(torch.cat(parts), full, rtol=0, atol=1e-10)
    expected = costs.cache_elements(ATTENTION, 2, 12, 4, 8)  # the kind's own formula
    assert all(sum(v.numel() for v in c.values()) == expected for c in state.caches)


def test_tp2_parity_of_the_new_kinds(plugin, tmp_path):
    """TP=1 vs TP=2 vs TP=2+SP (tests/models/attention_tp_worker.py, one 2-rank launch): equal loss and
    gradient norms for the new attention kind (decoder, encoder) with the new embedding."""
    from megahash.launching.env import free_port

    out = tmp_path / "tp.json"
    cases = [f"{ATTENTION}@emb={EMBEDDING}", f"{ATTENTION}@encoder@emb={EMBEDDING}"]
    port = free_port()
    procs = []
    for rank in range(2):
        env = child_env(
            RANK=rank, WORLD_SIZE=2, LOCAL_RANK=rank, MASTER_ADDR="127.0.0.1", MASTER_PORT=port, **plugin["env"]
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, str(ROOT / "tests" / "models" / "attention_tp_worker.py"), str(out), ",".join(cases)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
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
    r = pretrain_here(  # in this process, where the plugin fixture has put the package on sys.path
        [
            f"data.prefix=[{shakespeare_shards['prefix']}]",
            f"data.tokenizer={shakespeare_shards['tokenizer']}",
            f"model.schedule=list:{ATTENTION},mha-megatron",
            "model.num_layers=2",
            f"model.embedding={EMBEDDING}",
            "train.steps=1",
            f"train.save_dir={run_dir}",
            "train.eval_interval=1",
            "train.save_interval=0",
            "data.valid_samples=4",
            "data.valid_micro_batch=2",
            "data.seq_length=32",
            "train.micro_batch_size=2",
            "train.global_batch_size=2",
        ],
        config="configs/quickstart.yaml",
    )
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
    from megahash.accelerator import rng
    from megahash.config import load_config
    from megahash.convert.export import export_model
    from megahash.convert.verify import load_hf
    from megahash.models.megatron_model import build_model

    cfg = load_config(
        None,
        [
            *SMALL,
            f"model.schedule=list:{ATTENTION},mha",
            f"model.embedding={EMBEDDING}",
            "data.seq_length=16",
            "model.tie_embeddings=false",
        ],
    )
    rng.seed_all(0)
    model = build_model(cfg, 120).eval()
    with torch.no_grad():
        model.embedding.gain.fill_(0.5)  # the gain must reach the export
    export_model(cfg, model, tmp_path / "hf", vocab_size=120)
    code = [f.read_text() for f in (tmp_path / "hf").glob("*tiedqk.py")]
    assert (
        len(code) == 1 and "class TiedQK(SoftmaxAttention)" in code[0] and "megatron" not in code[0]
    )  # its file's torch-only section, nothing else
    hf = load_hf(tmp_path / "hf")
    tok = torch.randint(0, 120, (2, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = model(tok)[..., :120].float()
        theirs = hf(input_ids=tok).logits.float()
    torch.testing.assert_close(theirs, ours, rtol=1e-4, atol=1e-4)


def test_export_rebuilds_computed_buffers_and_cuts_any_vocabulary_head(plugin, dist, tmp_path):
    """A kind's non-persistent buffer (computed in ``build``) is rebuilt when transformers loads the export
    (before: left ``torch.empty``, the logits 0.16 off on a 4-step ALiBi run), and the export check cuts the
    logits of any head over the output layer to the vocabulary (before: only a head whose loss is nats per
    token, so a label-smoothed head's export crashed, 'size of tensor a (128) must match ... (120)')."""
    from megahash.accelerator import rng
    from megahash.config import load_config
    from megahash.convert.export import export_model
    from megahash.convert.verify import load_hf, verify_export
    from megahash.models.megatron_model import build_model

    cfg = load_config(
        None,
        [
            *SMALL,
            f"model.schedule=list:{BUFFER},mha",
            f"model.head={SMOOTHED}",
            "data.seq_length=16",
        ],
    )
    rng.seed_all(0)
    model = build_model(cfg, 120).eval()
    export_model(cfg, model, tmp_path / "hf", vocab_size=120)
    hf = load_hf(tmp_path / "hf")
    ours = model.decoder.layers[0].self_attention.gains
    torch.testing.assert_close(hf.model.decoder.layers[0].self_attention.gains, ours, rtol=0, atol=0)
    check = verify_export(cfg, model, tmp_path / "hf")
    assert check["max_abs_diff"] <= check["tolerance"], check


def test_a_kind_with_an_option_and_a_model_input_in_one_file(plugin, shakespeare_shards, dist, tmp_path):
    """``anchorqk`` (one plugin file) declares an option and adds an input to the model: the option is
    reached as ``model.attention.options.anchor_seed`` (typed, range-checked, written to the resolved
    config); ``pretrain`` trains and checkpoints it (the anchor rows ride in the checkpoint); export-hf
    of that checkpoint loads in transformers with equal logits, and cached decoding equals the full
    forward in megahash and in transformers."""
    from megahash.checkpoint.weights import load_for_inference
    from megahash.config import load_config
    from megahash.convert.verify import load_hf
    from megahash.errors import ConfigError
    from megahash.models.megatron_model import DecodeState

    with pytest.raises(ConfigError, match="anchor_length"):
        load_config(None, [f"model.schedule=uniform:{ANCHOR}", "model.attention.options.anchor_length=0"])
    with pytest.raises(ConfigError, match="anchor_seed"):
        load_config(None, [f"model.schedule=uniform:{ANCHOR}", "model.attention.options.anchor_seed=x"])
    run_dir = tmp_path / "run"
    r = pretrain_here(
        [
            f"data.prefix=[{shakespeare_shards['prefix']}]",
            f"data.tokenizer={shakespeare_shards['tokenizer']}",
            f"model.schedule=list:{ANCHOR},mha",
            "model.num_layers=2",
            "model.attention.options.anchor_seed=11",
            "model.attention.options.anchor_length=64",
            "train.steps=2",
            f"train.save_dir={run_dir}",
            "train.eval_interval=0",
            "data.seq_length=32",
            "train.micro_batch_size=2",
            "train.global_batch_size=2",
        ],
        config="configs/quickstart.yaml",
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert list(train_losses(run_dir)) == [1, 2]
    assert "anchor_seed: 11" in (run_dir / "resolved_config.yaml").read_text()
    cfg, model, _ = load_for_inference(run_dir)
    g = torch.Generator().manual_seed(11)
    # bit-exact: the same seeded draws times init_std, one rounding (the run was in this process: one ATEN_CPU_CAPABILITY)
    assert torch.equal(
        model.anchor.rows.float(), (torch.randn(64, cfg.model.hidden_size, generator=g) * cfg.model.init_std)
    )
    out = tmp_path / "hf"
    r = megahash_here(["export-hf", "--checkpoint", str(run_dir), "--output", str(out)])
    assert r.returncode == 0, r.stderr[-3000:]
    assert "verified: max |logit difference|" in r.stdout
    hf = load_hf(out)
    tok = torch.randint(5, 200, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = model(tok)[..., : hf.config.vocab_size].float()
        theirs = hf(input_ids=tok).logits.float()
        torch.testing.assert_close(theirs, ours, rtol=1e-4, atol=1e-4)
        full = model.hidden_states(tok)
        state = DecodeState(2)
        parts = [model.hidden_states(tok[:, :7], decode_state=state)]
        parts += [model.hidden_states(tok[:, i : i + 1], decode_state=state) for i in range(7, 20)]
        torch.testing.assert_close(torch.cat(parts), full, rtol=1e-5, atol=1e-5)
        cached = hf.generate(tok[:1, :6], max_new_tokens=8, do_sample=False, use_cache=True)
        uncached = hf.generate(tok[:1, :6], max_new_tokens=8, do_sample=False, use_cache=False)
    assert torch.equal(
        cached, uncached
    )  # bit-exact: greedy token ids (argmax of logits a few ulps apart: fixed seed, no near-tie; passes under default/avx2/avx512)


# -------------------------------------------------------------------------- no other file names a kind

# (identifier, path or path prefix): the same spelling for a different thing (tests/kind_leaks.py
# reports a kind's names, module, public top-level names and options fields used anywhere else)
HOMONYMS = {
    ("mlp", "megahash/models/accounting.py"): "the MLP sublayer's parameter count in `megahash params`",
    ("mlp", "megahash/models/closed_form.py"): "the MLP sublayer's parameter count (closed form)",
    (
        "mlp",
        "megahash/models/tensor_groups.py",
    ): "the MLP sublayer's slot (TransformerLayer.mlp), an artifact tensor group",
    ("rolling", "megahash/hashing/"): "the rolling hash-spec family (hashing knows no model kinds)",
    ("add", "megahash/models/attention/mhe.py"): "MHE's add/mul head-embedding mode (eq. 3.5)",
    ("random_seed", "megahash/data/dataset.py"): "megatron's dataset-config keyword (the data seed)",
    (
        "megahash.models.embeddings.vocab",
        "megahash/data/preprocess/train_tokenizer.py",
    ): "the '.vocab' file suffix of sentencepiece",
    (
        "megahash.models.heads.vocab",
        "megahash/data/preprocess/train_tokenizer.py",
    ): "the '.vocab' file suffix of sentencepiece",
    ("random_seed", "megahash/eval/run.py"): "lm-eval's simple_evaluate keyword",
    (
        "megahash.models.embeddings.vocab",
        "megahash/tokenization.py",
    ): "the '.vocab' file suffix of sentencepiece (path-like tokenizer values)",
    (
        "megahash.models.heads.vocab",
        "megahash/tokenization.py",
    ): "the '.vocab' file suffix of sentencepiece (path-like tokenizer values)",
    (
        "shuffle-random",
        "megahash/objectives/shuffle_random.py",
    ): "not a homonym: the S+R objective names the head it trains (ObjectiveSpec.head)",
}


def test_no_library_file_but_its_own_names_a_kind():
    """For every registered attention kind, embedding kind and head: the library files (megahash/)
    other than the kind's own that refer to it by string, module, public name or options field
    (tests/kind_leaks.py, ast; docstrings excepted): none. (Issue 27: the fixed-input kinds and the
    kind files that import another kind's file fail this until the kind hooks land.)"""
    import kind_leaks

    kinds = kind_leaks.catalog_kinds(ROOT)
    assert (
        len({n for k in kinds for n in k.names}) >= 20
    )  # every kind was checked (16 attention, 7 embeddings, 4 heads; names may coincide)
    leaks = kind_leaks.scan(ROOT, kinds, allow=HOMONYMS)
    by_kind: dict[str, list] = {}
    for leak in leaks:
        by_kind.setdefault(leak.kind, []).append(str(leak))
    if leaks:
        pytest.fail(
            f"{len(leaks)} references to a kind outside its own file:\n"
            + "\n".join(f"{kind}:\n  " + "\n  ".join(lines) for kind, lines in sorted(by_kind.items())),
            pytrace=False,
        )


def test_every_homonym_is_still_needed():
    """Each allow-listed homonym still excuses a finding (a stale entry would hide a future leak)."""
    import kind_leaks

    leaks = kind_leaks.scan(ROOT, kind_leaks.catalog_kinds(ROOT))
    assert [key for key in HOMONYMS if not any(kind_leaks.allowed(leak, {key: ""}) for leak in leaks)] == []


# -------------------------------------------------------------------------- no other file names an objective


def _objective_files(root) -> list:
    """kind_leaks records of the objectives (each file of megahash/objectives/ registering an
    ``ObjectiveSpec("name", ...)``): checked by name (a string constant) and module; their public names
    (``corrupt``) are common words."""
    import ast

    import kind_leaks

    out = []
    for path in sorted((root / "megahash" / "objectives").glob("*.py")):
        names = {
            node.args[0].value
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Call)
            and getattr(node.func, "id", None) == "ObjectiveSpec"
            and node.args
            and isinstance(node.args[0], ast.Constant)
        }
        if names:
            module = "megahash.objectives." + path.stem
            out.append(kind_leaks.Kind(frozenset(names), path.resolve(), module, frozenset(), frozenset(), True))
    return out


def test_no_library_file_but_its_own_names_an_objective(tmp_path):
    """For every registered objective (clm, mlm, sr): no library file but its own names it (a string
    constant, docstrings excepted, or an import of its module); the library asks its ObjectiveSpec. A
    planted comparison is found, so the check is live."""
    import kind_leaks

    from megahash.objective_spec import names

    objectives = _objective_files(ROOT)
    assert sorted(n for k in objectives for n in k.names) == names()  # every objective is checked
    leaks = kind_leaks.scan(ROOT, objectives)
    assert not leaks, "objective named outside its own file:\n" + "\n".join(map(str, leaks))
    (tmp_path / "megahash").mkdir()
    (tmp_path / "megahash" / "planted.py").write_text('def f(cfg):\n    return cfg.train.objective != "sr"\n')
    sr = next(k for k in objectives if "sr" in k.names)
    found = kind_leaks.scan(tmp_path, [dataclasses.replace(sr, file=tmp_path / "megahash" / "sr.py")])
    assert [(f.path, f.line, f.identifier, f.sort) for f in found] == [("megahash/planted.py", 2, "sr", "string")]
