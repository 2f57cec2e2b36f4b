"""Hugging Face interop (issue 13): import of a standard Qwen2ForCausalLM folder, publishable exports
(model card, no local paths, generation config, sharded weights) and the Qwen2 export on
transformers 4.x (a side install, see ``tf4_path``) against 5.x."""

import json
import os
import subprocess
import sys
from subprocess import PIPE

import pytest
import torch

from conftest import ROOT, child_env, popen

os.environ.setdefault("HF_HUB_OFFLINE", "1")

TF4 = "transformers==4.46.3 tokenizers==0.20.3 huggingface_hub==0.26.5"


# the shape of the random transformers decoders these tests import (Qwen2, Llama, Mistral)
TINY_DECODER = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    rope_parameters={"rope_type": "default", "rope_theta": 50000.0},
)


def random_qwen2(path, tie: bool, shard: str | None = None, vocab: int = 300):
    """A randomly initialised transformers Qwen2 (GQA, rope_theta 50000, a vocabulary that is not a
    multiple of 128) saved to ``path``."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=vocab,
        **TINY_DECODER,
        rms_norm_eps=1e-6,
        tie_word_embeddings=tie,
        use_sliding_window=False,
    )
    model = Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():  # biases are zero-initialised: make them count
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)
    kw = {"max_shard_size": shard} if shard else {}
    model.save_pretrained(str(path), **kw)
    return model


@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.numerics  # in process: floating-point logits of two implementations
def test_import_standard_qwen2_folder(tie, tmp_path, dist):
    """megahash import-hf on a transformers Qwen2 folder (sharded when untied): the imported
    checkpoint's logits equal transformers'."""
    from megahash.checkpoint.weights import load_for_inference
    from megahash.convert.importer import import_hf

    hf = random_qwen2(tmp_path / "hf", tie, shard=None if tie else "100KB")
    if not tie:
        assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    res = import_hf(tmp_path / "hf", tmp_path / "run")
    assert res["format"] == "qwen2-hf" and res["step"] == 0
    cfg, model, _ = load_for_inference(str(tmp_path / "run"))
    assert cfg.model.rotary_base == 50000 and cfg.model.num_query_groups == 2 and cfg.model.tie_embeddings == tie
    ids = torch.randint(0, 300, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(ids).logits
        got = model(ids)[..., :300].float()
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def _megahash_qwen2(src, dst):
    """``src`` (a plain Qwen2 folder) as a megahash Qwen2 export: its config tree, groups, padding and step."""
    import shutil

    from megahash.convert.qwen2 import megahash_tree

    shutil.copytree(src, dst)
    data = json.loads((dst / "config.json").read_text())
    data.update(
        megahash_config=megahash_tree(data, dst),
        megahash_kv_groups=2,
        megahash_padded_vocab_size=384,
        megahash_step=3,
    )
    (dst / "config.json").write_text(json.dumps(data))
    return dst


def test_hostile_config_and_tensors_are_one_line(tmp_path, dist, capsys):
    """A Qwen2 folder (plain, or a megahash export) whose config.json fields are missing, of another type, zero,
    non-finite or absurd, or whose tensors are missing or of another shape: one ``error:`` line, exit 2, no
    output folder. Before: KeyError/ValueError/TypeError/ZeroDivisionError/AttributeError tracebacks from
    config.json, reshape RuntimeErrors from the tensors, a 128 TB ``torch.zeros`` for a padded vocabulary of
    10**12 rows (a MemoryError traceback here; the OOM killer where it is smaller), ``step_-0000005`` written
    for megahash_step=-5, and three minutes of CPU building a meta model of 10**5 layers."""
    from safetensors.torch import load_file, save_file

    from megahash.cli import main

    plain = tmp_path / "plain"
    random_qwen2(plain, tie=True)
    ours = _megahash_qwen2(plain, tmp_path / "ours")
    capsys.readouterr()  # transformers' progress bars

    def config(**kw):
        def edit(d):
            data = json.loads((d / "config.json").read_text())
            for k, v in kw.items():
                if v is None:
                    data.pop(k, None)
                elif callable(v):
                    v(data)
                else:
                    data[k] = v
            (d / "config.json").write_text(json.dumps(data))

        return edit

    def tensors(fn):
        def edit(d):
            t = load_file(str(d / "model.safetensors"))
            fn(t)
            save_file(t, str(d / "model.safetensors"), metadata={"format": "pt"})

        return edit

    def tree(fn):
        return config(megahash_config=fn)

    cases = {
        (plain, "no hidden_size"): config(hidden_size=None),
        (plain, "hidden_size 'abc'"): config(hidden_size="abc"),
        (plain, "hidden_size [1]"): config(hidden_size=[1]),
        (plain, "zero heads"): config(num_attention_heads=0),
        (plain, "rope_parameters a string"): config(rope_parameters="x"),
        (plain, "rope_theta NaN"): config(rope_theta=float("nan"), rope_parameters={"rope_theta": float("nan")}),
        (plain, "vocab 10**12"): config(vocab_size=10**12),
        (plain, "a missing tensor"): tensors(lambda t: t.pop("model.layers.0.self_attn.q_proj.weight")),
        (plain, "k_proj of another shape"): tensors(
            lambda t: t.update({"model.layers.0.self_attn.k_proj.weight": torch.zeros(7, 3)})
        ),
        (plain, "a 1-D embedding"): tensors(lambda t: t.update({"model.embed_tokens.weight": torch.zeros(7)})),
        (plain, "more embedding rows"): tensors(
            lambda t: t.update({"model.embed_tokens.weight": torch.zeros(500, 64)})
        ),
        # imported before (exit 0): a layer the config does not name dropped silently, int weights cast
        (plain, "one layer fewer in config.json"): config(num_hidden_layers=1),
        (plain, "an int32 norm"): tensors(
            lambda t: t.update({"model.norm.weight": t["model.norm.weight"].to(torch.int32)})
        ),
        (ours, "hidden_size against megahash_config"): config(hidden_size=32),
        (ours, "megahash_config a list"): config(megahash_config=[1, 2]),
        (ours, "a section null"): tree(lambda d: d["megahash_config"].update(model=None)),
        (ours, "no kv groups"): config(megahash_kv_groups=None),
        (ours, "kv groups 0"): config(megahash_kv_groups=0),
        (ours, "kv groups 3"): config(megahash_kv_groups=3),
        (ours, "kv groups 'a'"): config(megahash_kv_groups="a"),
        (ours, "step 'a'"): config(megahash_step="a"),
        (ours, "step -5"): config(megahash_step=-5),
        (ours, "padded 10**11"): config(megahash_padded_vocab_size=10**11),
        (ours, "padded 10"): config(megahash_padded_vocab_size=10),
        (ours, "10**5 layers"): tree(lambda d: d["megahash_config"]["model"].update(num_layers=10**5)),
        (ours, "hidden_size 10**30"): tree(lambda d: d["megahash_config"]["model"].update(hidden_size=10**30)),
        (ours, "model_type megahash without its fields"): config(model_type="megahash"),
    }
    assert_imports_refused({name: (src, edit) for (src, name), edit in cases.items()}, tmp_path, capsys)
    for src in (plain, ours):  # the folders themselves import
        assert main(["import-hf", "--hf", str(src), "--output", str(tmp_path / f"ok_{src.name}")]) == 0


@pytest.fixture(scope="session")
def tf4_path():
    """transformers 4.46.3 (+ the tokenizers / huggingface_hub it needs) installed once with pip into
    a cache directory, imported only by subprocesses (PYTHONPATH): a 4.x beside the 5.x under test."""
    from pathlib import Path

    d = Path(os.environ.get("MEGAHASH_TF4_DIR", Path.home() / ".cache" / "megahash" / "transformers-4.46.3"))
    if not (d / "transformers" / "__init__.py").is_file():
        r = subprocess.run(
            [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(d), *TF4.split()],
            capture_output=True,
            text=True,
            timeout=600,
        )
        if r.returncode:
            pytest.skip(f"cannot pip install {TF4} (PyPI unreachable?): {r.stderr.strip().splitlines()[-1:]}")
    return d


TF4_SCRIPT = r"""
import json, sys, torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer
hf, text = sys.argv[1], sys.argv[2]
tok = AutoTokenizer.from_pretrained(hf)
model = AutoModelForCausalLM.from_pretrained(hf).eval()
ids = tok(text, add_special_tokens=False).input_ids
with torch.no_grad():
    logits = model(torch.tensor([ids])).logits[0]
print(json.dumps({"version": transformers.__version__, "rope_theta": model.config.rope_theta, "ids": ids,
                  "logits": logits.tolist(), "n_positions": model.config.n_positions}))
"""


def test_qwen2_export_is_publishable_on_transformers_4_and_5(tmp_path, dist, tf4_path):
    """Import a Qwen2 folder that carries a byte-level BPE tokenizer (specials 700/701), export it
    again in shards: model card, generation config, index, no local path in any file; transformers
    4.46 (side install) and 5.x load it without remote code and agree on rope_theta, the tokenizer's
    ids (special strings as text) and the logits."""
    from test_tokenizers import make_bpe
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megahash.checkpoint.weights import load_for_inference
    from megahash.convert.export import export_model
    from megahash.convert.importer import import_hf
    from megahash.eval.text import load_codec

    src = tmp_path / "src"
    random_qwen2(src, tie=False, vocab=702)
    from megahash.data.preprocess.sources import open_source, select_documents

    make_bpe(src / "tokenizer.json", list(select_documents(open_source("shakespeare"), 0, 20)))
    import_hf(src, tmp_path / "run")
    cfg, model, ckpt = load_for_inference(str(tmp_path / "run"))
    codec = load_codec(cfg, ckpt)
    out = tmp_path / "export"
    summary = export_model(cfg, model, out, codec, step=0, fmt="qwen2", max_shard_size="200KB", run_dir=ckpt.parent)
    files = set(summary["files"])
    assert {"README.md", "generation_config.json", "model.safetensors.index.json", "tokenizer.json"} <= files
    assert sum(f.startswith("model-") for f in files) >= 2
    card = (out / "README.md").read_text()
    assert f"{sum(p.numel() for p in model.parameters()):,} total" in card
    for f in out.iterdir():  # no path of this machine anywhere
        if f.suffix in (".json", ".md", ".py", ".txt"):
            text = f.read_text()
            assert str(tmp_path) not in text and "/tmp/" not in text and os.path.expanduser("~") not in text, f.name
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen["eos_token_id"] == 700 and gen["pad_token_id"] == 701
    text = "KING. My lord <|endoftext|> <s>\t\t  x"
    tok5 = AutoTokenizer.from_pretrained(str(out))
    m5 = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    ids = tok5(text, add_special_tokens=False).input_ids
    assert ids == codec.encode(text).ids and 700 not in ids
    env = child_env(PYTHONPATH=str(tf4_path))
    r = subprocess.run(
        [sys.executable, "-c", TF4_SCRIPT, str(out), text],
        cwd=str(tmp_path),
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["version"] == "4.46.3"
    assert got["rope_theta"] == 50000.0 and got["n_positions"] == cfg.data.seq_length
    assert got["ids"] == ids
    with torch.no_grad():
        want = m5(torch.tensor([ids])).logits[0]
        mh = model(torch.tensor([ids]))[0, :, :702].float()
    torch.testing.assert_close(torch.tensor(got["logits"]), want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(want, mh, atol=1e-4, rtol=1e-4)


@pytest.mark.numerics  # in process: floating-point logits of two implementations
def test_remote_code_batched_left_padded_generate(shakespeare_shards, dist, tmp_path):
    """generate() on a left-padded batch (transformers' padding for generation) equals generating
    each prompt alone, for a hash-embedding model with a recurrent attention kind."""
    from test_convert import _build, _cfg
    from transformers import AutoModelForCausalLM

    from megahash.convert.export import export_model

    cfg = _cfg(shakespeare_shards, "hash-emb-bucket")  # list:mha,approx with a hash embedding
    from megahash.eval.text import load_codec

    model = _build(cfg)
    export_model(cfg, model, tmp_path / "hf", load_codec(cfg), fmt="megahash")
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), trust_remote_code=True).eval()
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(5, 1000, (n,), generator=g) for n in (3, 9, 6)]
    pad = hf.generation_config.pad_token_id
    batch = torch.full((3, 9), pad, dtype=torch.long)
    mask = torch.zeros((3, 9), dtype=torch.long)
    for i, p in enumerate(prompts):
        batch[i, 9 - len(p) :] = p
        mask[i, 9 - len(p) :] = 1
    out = hf.generate(batch, attention_mask=mask, max_new_tokens=6, do_sample=False)
    assert out.shape == (3, 15) and torch.equal(out[:, :9], batch)  # bit-exact: the prompt ids, copied
    for i, p in enumerate(prompts):
        alone = hf.generate(p[None], max_new_tokens=6, do_sample=False)[0, len(p) :]
        assert torch.equal(
            out[i, 9 : 9 + len(alone)], alone
        )  # bit-exact: greedy token ids (argmax of logits a few ulps apart: fixed seeds, no near-tie; passes under default/avx2/avx512)


@pytest.mark.numerics  # in process: floating-point logits of two implementations
def test_hash_embedding_special_rows_follow_roles(shakespeare_shards, dist, tmp_path):
    """With special ids that are not 0-4 (data.special_ids), a hash embedding gives the special rows
    to those ids by role (row 0 bos, 1 pad, 2 eos) and treats ids 0-4 as ordinary tokens; the
    remote-code export agrees (logits equal on a sequence containing the specials)."""
    from test_convert import _build, _cfg
    from transformers import AutoModelForCausalLM

    from megahash.convert.export import export_model
    from megahash.eval.text import load_codec

    cfg = _cfg(shakespeare_shards, "hash-emb-bucket")
    cfg.data.special_ids = {"bos": 700, "pad": 701, "eos": 700, "unk": None, "mask": None}
    model = _build(cfg)
    emb = model.embedding
    tok = torch.tensor([[700, 701, 3, 42]])
    codes = torch.zeros((1, 4, 1), dtype=torch.long)  # md5-bucket64: one bucket id per token
    out = emb(tok, codes)[:, 0]  # [s, h]
    torch.testing.assert_close(out[0], emb.special[0])  # bos/eos id 700 -> the bos row
    torch.testing.assert_close(out[1], emb.special[1])  # pad
    assert not torch.allclose(out[2], emb.special[3])  # id 3 is an ordinary token here
    export_model(cfg, model, tmp_path / "hf", load_codec(cfg), fmt="megahash")
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), trust_remote_code=True).eval()
    ids = torch.tensor([[700, 17, 3, 0, 701, 250, 700, 4, 9]])
    with torch.no_grad():
        want = model(ids, hash_codes=hf.model.codes_for_ids(ids))[..., :1000].float()
        got = hf(ids).logits
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


TF_GENERATE_SCRIPT = r"""
import json, sys, warnings, torch
import transformers
from transformers import AutoModelForCausalLM
hf, prompt = sys.argv[1], json.loads(sys.argv[2])
model = AutoModelForCausalLM.from_pretrained(hf, trust_remote_code=True).eval()
ids = torch.tensor([prompt])
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    cached = model.generate(ids, max_new_tokens=10, do_sample=False, use_cache=True)[0, len(prompt):].tolist()
uncached = model.generate(ids, max_new_tokens=10, do_sample=False, use_cache=False)[0, len(prompt):].tolist()
cache_warnings = [str(w.message) for w in caught if "past_key_values" in str(w.message) or "cache" in str(w.message)]
print(json.dumps({"version": transformers.__version__, "cached": cached, "uncached": uncached,
                  "cache_warnings": cache_warnings}))
"""


def test_megahash_export_cached_generate_on_transformers_4_and_5(shakespeare_shards, dist, tmp_path, tf4_path):
    """The megahash-format export's remote code follows the cache API of the transformers that loads it
    (``cache`` in 5.2x, ``past_key_values`` before): greedy generate() with the cache equals generate()
    without it, on transformers 4.46 (side install) and on the installed 5.x, with no cache deprecation
    warning. The model (vocabulary embedding: no word-hash codes, which a longer context may change)
    mixes softmax kinds (key/value cache), recurrent kinds (state cache) and a static-map kind."""
    from test_convert import _build, _cfg

    from megahash.convert.export import export_model
    from megahash.eval.text import load_codec

    cfg = _cfg(shakespeare_shards, "mhe-mlp-linear-static")  # mhe-add,mhe-mul,mlp,approx,nonapprox,staticembqk
    export_model(cfg, _build(cfg), tmp_path / "hf", load_codec(cfg), fmt="megahash")
    prompt = [int(t) for t in torch.randint(5, 1000, (7,), generator=torch.Generator().manual_seed(5))]
    script = tmp_path / "generate.py"
    script.write_text(TF_GENERATE_SCRIPT)
    results = []
    for pythonpath in (str(tf4_path), None):
        # conftest.popen: 5.x forked from the test fork server; 4.46 (another PYTHONPATH) a fresh interpreter
        env = {"PYTHONPATH": f"{pythonpath}:{ROOT}"} if pythonpath else {}
        p = popen([sys.executable, str(script), str(tmp_path / "hf"), json.dumps(prompt)], PIPE, PIPE, tmp_path, **env)
        out, err = p.communicate(timeout=600)
        assert p.returncode == 0, err[-3000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    import transformers

    assert [res["version"] for res in results] == ["4.46.3", transformers.__version__]
    for res in results:
        assert len(res["cached"]) == 10 and res["cached"] == res["uncached"], res
        assert res["cache_warnings"] == [], res
    assert results[0]["cached"] == results[1]["cached"]


def test_import_output_of_another_kind_is_one_line(tmp_path, dist, capsys):
    """--output a file, under a file, holding a folder named ``latest`` or an unfinished ``step_N``: one line
    before anything is written (FileExistsError/NotADirectoryError tracebacks before; a folder named ``latest``
    failed after the checkpoint was published, leaving it without ``latest`` or its config). A leftover
    ``step_N.tmp`` of any kind is replaced."""
    from megahash.cli import main

    hf = tmp_path / "hf"
    random_qwen2(hf, tie=True)
    capsys.readouterr()
    afile = tmp_path / "afile"
    afile.write_text("x\n")
    latest = tmp_path / "with_latest"
    (latest / "latest").mkdir(parents=True)
    unfinished = tmp_path / "unfinished"
    (unfinished / "step_00000000" / "model").mkdir(parents=True)
    for out, expect in (
        (afile, "is a file; name a folder"),
        (afile / "x", "is a file, not a folder"),
        (latest, "latest is not a file"),
        (unfinished, "already holds step_00000000"),
    ):
        before = sorted(p.name for p in out.parent.rglob("*"))
        assert main(["import-hf", "--hf", str(hf), "--output", str(out)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and expect in err[0], err
        assert sorted(p.name for p in out.parent.rglob("*")) == before
    leftover = tmp_path / "leftover"
    leftover.mkdir()
    (leftover / "step_00000000.tmp").write_text("a file where the import's temp folder goes\n")
    assert main(["import-hf", "--hf", str(hf), "--output", str(leftover)]) == 0
    assert sorted(p.name for p in leftover.iterdir()) == ["latest", "resolved_config.yaml", "step_00000000"]


def assert_imports_refused(cases: dict, tmp_path, capsys) -> None:
    """Each case ``name: (folder, edit)``: a copy of the folder, edited, is refused by ``import-hf`` in one line
    ``error: ...`` with exit 2, and nothing is written."""
    import shutil

    from megahash.cli import main

    for name, (src, edit) in cases.items():
        d = tmp_path / "case"
        shutil.rmtree(d, ignore_errors=True)
        shutil.copytree(src, d)
        edit(d)
        out = tmp_path / "out"
        status = main(["import-hf", "--hf", str(d), "--output", str(out)])
        err = capsys.readouterr().err.strip().splitlines()
        assert status == 2 and len(err) == 1 and err[0].startswith("error: ") and len(err[0]) < 520, (name, err)
        assert not out.exists(), name
