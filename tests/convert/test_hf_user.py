"""A transformers / lm-eval user's view of megahash exports (the remote-code format): what the world calls on a
loaded export (lm-eval's ``hf`` model generating with stop sequences in batches, ``save_pretrained`` and
reloading, ``resize_token_embeddings``) against transformers' own results."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import pytest
import test_hf_interop
import torch

tf4_path = test_hf_interop.tf4_path  # the session fixture of the transformers 4.46 side install


@pytest.fixture(scope="module")
def exports(shakespeare_shards, dist, tmp_path_factory):
    """{variant: exported folder} of two in-memory models: a hash embedding with a recurrent kind
    (list:mha,approx) and a vocabulary embedding with an untied head and the compact-model levers (value
    embeddings, logit soft-cap, x0 mixing, ...), and an MLM encoder."""
    from test_convert import _build, _cfg

    from megahash.convert.export import export_model
    from megahash.eval.text import load_codec

    out = {}
    root = tmp_path_factory.mktemp("hf_user")
    for name in ("hash-emb-bucket", "levers-vocab", "encoder-mlm"):
        cfg = _cfg(shakespeare_shards, name)
        cfg.model.tie_embeddings = False
        model = _build(cfg)
        export_model(cfg, model, root / name, load_codec(cfg), fmt="megahash")
        out[name] = root / name
    return out


def _load(folder):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(folder), trust_remote_code=True).eval()
    return model, AutoTokenizer.from_pretrained(str(folder), trust_remote_code=True)


@pytest.mark.numerics  # in process: greedy tokens of a float model
def test_lm_eval_generate_until_batched_equals_one_at_a_time(exports):
    """lm-eval's ``hf`` model generating with stop sequences (``generate_until``) in batches of 4 gives the
    texts it gives one request at a time. Before: IndexError in lm-eval's MultiTokenEOSCriteria (the
    criteria made for the batch of 4 were handed to the one-row generations of a padded batch), so every
    generative task failed on a megahash export at batch_size > 1; and a row got ``max_length`` minus its own
    prompt length new tokens instead of minus the batch's padded width."""
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    model, tok = _load(exports["hash-emb-bucket"])
    prompts = ["KING. My lord,", "To be, or not to be: that is the question, whether", "O", "Now is the winter of"]
    # a stop string the model reaches mid-way: the third new token of the first prompt alone
    ids = tok(prompts[0], return_tensors="pt").input_ids
    alone = model.generate(ids, max_new_tokens=6, do_sample=False)[0, ids.shape[1] :]
    stop = tok.decode(alone[2:3])
    assert stop.strip(), alone

    def texts(batch_size):
        lm = HFLM(pretrained=model, tokenizer=tok, batch_size=batch_size, device="cpu", max_length=64)
        reqs = [
            Instance("generate_until", {}, (p, {"until": [stop], "max_gen_toks": 8, "do_sample": False}), i)
            for i, p in enumerate(prompts)
        ]
        return lm.generate_until(reqs)

    tok.padding_side = "left"
    enc = tok(prompts, return_tensors="pt", padding=True)
    width = enc.input_ids.shape[1]
    out = model.generate(**enc, max_length=width + 3, do_sample=False)  # as in a batch: 3 new tokens a row
    assert out.shape == (4, width + 3)
    for i, p in enumerate(prompts):
        row = tok(p, return_tensors="pt").input_ids
        want = model.generate(row, max_new_tokens=3, do_sample=False)[0, row.shape[1] :]
        assert out[i, width:].tolist() == want.tolist()
    one, four = texts(1), texts(4)
    assert four == one, (stop, one, four)
    assert one[0] == tok.decode(alone).split(stop)[0]  # cut at the stop string, as transformers generated it alone


@pytest.mark.numerics  # in process: logits of a float model
def test_save_pretrained_of_a_loaded_export_reloads_whole(exports, tmp_path):
    """``save_pretrained`` (model and tokenizer) of a loaded hash-embedding export, then ``from_pretrained`` of
    the copy: the same logits from ids alone and the same ``encode_text``. Before: the copy lacked
    megahash_hashing.json and the files it names, so its forward raised ValueError ("no megahash_hashing.json")
    and encode_text could not run."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, tok = _load(exports["hash-emb-bucket"])
    model.save_pretrained(str(tmp_path / "copy"))
    tok.save_pretrained(str(tmp_path / "copy"))
    again = AutoModelForCausalLM.from_pretrained(str(tmp_path / "copy"), trust_remote_code=True).eval()
    text = "KING. My lord, the queen is dead."
    ids = AutoTokenizer.from_pretrained(str(tmp_path / "copy"), trust_remote_code=True)(text, return_tensors="pt")
    assert ids.input_ids.tolist() == tok(text, return_tensors="pt").input_ids.tolist()
    with torch.no_grad():
        want, got = model(ids.input_ids).logits, again(ids.input_ids).logits
    # bit-exact: the same weights (safetensors copies) and the same code on the same input
    assert torch.equal(want, got)
    (a_ids, a_codes), (b_ids, b_codes) = model.encode_text(text), again.encode_text(text)
    # bit-exact: integer ids and hash codes
    assert torch.equal(a_ids, b_ids) and torch.equal(a_codes, b_codes)


@pytest.mark.numerics  # in process: logits of a float model
def test_resize_token_embeddings(exports, tmp_path):
    """``resize_token_embeddings`` of a vocabulary-embedding export (untied head, value embeddings): the logits
    of the old vocabulary are unchanged, a new id runs, and ``save_pretrained`` -> ``from_pretrained`` gives the
    resized model back. A hash embedding is refused with a ValueError naming why. Before: NotImplementedError
    (``set_input_embeddings`` not handled for MegahashModel) for every export, an AttributeError on NoneType for
    hash embeddings."""
    from transformers import AutoModelForCausalLM

    model, tok = _load(exports["levers-vocab"])
    ids = tok("KING. My lord, the queen is dead.", return_tensors="pt").input_ids
    with torch.no_grad():
        before = model(ids).logits
    assert before.shape[-1] == 1000 and model.config.padded_vocab_size == 1024
    model.resize_token_embeddings(1030)
    assert model.config.vocab_size == 1030 and model.config.padded_vocab_size == 1030
    assert model.model.value_embeds.tables[0].weight.shape[0] == 1030
    new = torch.cat([ids, torch.tensor([[1027, 1029]])], dim=1)
    with torch.no_grad():
        after = model(ids).logits
        longer = model(new).logits
    assert after.shape[-1] == 1030 and longer.shape == (1, new.shape[1], 1030)
    torch.testing.assert_close(after[..., :1000], before)  # fp32 defaults: the same rows, a wider matmul
    model.save_pretrained(str(tmp_path / "resized"))
    again = AutoModelForCausalLM.from_pretrained(str(tmp_path / "resized"), trust_remote_code=True).eval()
    with torch.no_grad():
        # bit-exact: the same weights (safetensors copies) and the same code on the same input
        assert torch.equal(again(new).logits, longer)
    hashed, _ = _load(exports["hash-emb-bucket"])
    with pytest.raises(ValueError, match="reads word-hash codes"):
        hashed.resize_token_embeddings(1030)


def test_import_refuses_a_folder_whose_two_configs_disagree(exports, tmp_path, capsys):
    """import-hf of a megahash export whose config.json fields (what transformers builds the model from) were
    edited away from its megahash_config, whose vocabulary does not fit its tables, or whose weights hold an
    integer tensor where a float goes: one ``error:`` line, exit 2, no output. Before: each was imported
    (exit 0) from megahash_config alone: a checkpoint of another model than the one transformers loads from the
    folder, a vocabulary of 5000 over 1024-row tables, int32 weights cast silently."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    from megahash.cli import main

    src = exports["levers-vocab"]

    def config(edit):
        def apply(d):
            data = json.loads((d / "config.json").read_text())
            edit(data)
            (d / "config.json").write_text(json.dumps(data))

        return apply

    def int_weight(d):
        t = load_file(str(d / "model.safetensors"))
        t["output_layer.weight"] = t["output_layer.weight"].to(torch.int32)
        save_file(t, str(d / "model.safetensors"), metadata={"format": "pt"})

    cases = {
        "hidden_size=96": config(lambda c: c.update(hidden_size=96)),
        "num_hidden_layers=3": config(lambda c: c.update(num_hidden_layers=3)),
        "vocab_size=10": config(lambda c: c.update(vocab_size=10)),
        "vocab_size=5000": config(lambda c: c.update(vocab_size=5000)),
        "megahash_config vocab 5000": config(lambda c: c["megahash_config"]["model"].update(vocab_size=5000)),
        "layer_specs cut": config(lambda c: c.update(layer_specs=c["layer_specs"][:1])),
        "a layer's kind edited": config(lambda c: c["layer_specs"][-1].update(kind="approx")),
        "int32 output layer": int_weight,
    }
    test_hf_interop.assert_imports_refused({name: (src, edit) for name, edit in cases.items()}, tmp_path, capsys)
    d = tmp_path / "case"
    assert main(["import-hf", "--hf", str(src), "--output", str(tmp_path / "ok")]) == 0  # the folder itself
    # an explicit model.vocab_size above the tokenizer's 1000 ids (1020: the same 1024 rows) is a real run's export
    shutil.rmtree(d)
    shutil.copytree(src, d)
    config(lambda c: c["megahash_config"]["model"].update(vocab_size=1020))(d)
    assert main(["import-hf", "--hf", str(d), "--output", str(tmp_path / "ok_1020")]) == 0


def _random_family(kind: str, path, **kw):
    """A randomly initialised transformers Llama / Mistral / GPT-2 (GQA, a vocabulary not a multiple of 128) saved
    to ``path``."""
    import transformers

    torch.manual_seed(0)
    if kind == "gpt2":
        cfg = transformers.GPT2Config(vocab_size=300, n_embd=64, n_layer=2, n_head=4, n_positions=128, **kw)
        model = transformers.GPT2LMHeadModel(cfg)
    else:
        cls = {"llama": "Llama", "mistral": "Mistral"}[kind]
        cfg = getattr(transformers, f"{cls}Config")(vocab_size=300, **test_hf_interop.TINY_DECODER, **kw)
        model = getattr(transformers, f"{cls}ForCausalLM")(cfg)
    model.eval().save_pretrained(str(path))
    return model


@pytest.mark.numerics  # in process: floating-point logits of two implementations
@pytest.mark.parametrize(
    "kind, kw",
    [("llama", {"tie_word_embeddings": True}), ("llama", {}), ("mistral", {})],  # Mistral: its default 4096 window
)
def test_import_llama_and_mistral_folders(kind, kw, tmp_path, dist):
    """import-hf of a transformers Llama (tied, untied) or Mistral folder: the imported checkpoint's logits equal
    transformers'. Before: refused ("import-hf reads megahash exports and standard Qwen2ForCausalLM folders"),
    though both are Qwen2's block without q/k/v biases and with the same tensor names."""
    from megahash.checkpoint.weights import load_for_inference
    from megahash.convert.importer import import_hf

    hf = _random_family(kind, tmp_path / "hf", **kw)
    res = import_hf(tmp_path / "hf", tmp_path / "run")
    assert res["format"] == f"{kind}-hf" and res["step"] == 0
    cfg, model, _ = load_for_inference(str(tmp_path / "run"))
    assert not cfg.model.qkv_bias and cfg.model.rotary_base == 50000 and cfg.model.num_query_groups == 2
    assert cfg.model.tie_embeddings == bool(kw.get("tie_word_embeddings"))
    ids = torch.randint(0, 300, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, got = hf(ids).logits, model(ids)[..., :300].float()
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)  # as the Qwen2 import's test: fp32, two code paths


def test_import_of_what_megahash_cannot_run_is_one_line(tmp_path, capsys):
    """Llama/Mistral/GPT-2 folders megahash's decoder cannot hold: one ``error:`` line naming why, exit 2."""
    from megahash.cli import main

    cases = {
        ("mistral", "sliding_window=64"): {"sliding_window": 64},
        ("llama", "attention_bias=true"): {"attention_bias": True},
        ("llama", "mlp_bias=true"): {"mlp_bias": True},
        ("gpt2", "model_type 'gpt2'"): {},
    }
    for (kind, expect), kw in cases.items():
        src = tmp_path / f"{kind}_{len(kw)}_{expect[:5]}"
        _random_family(kind, src, **kw)
        capsys.readouterr()
        assert main(["import-hf", "--hf", str(src), "--output", str(tmp_path / "out")]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and expect in err[0], err
        assert not (tmp_path / "out").exists()


@pytest.mark.numerics  # in process: beam-search tokens of a float model
def test_padded_batch_with_num_return_sequences(exports):
    """``generate(num_beams=2, num_return_sequences=2)`` on a left-padded batch: 2 rows per prompt, in
    transformers' order, each pair the one the prompt alone gets. Before: one row per prompt (the first
    sequence of each; the batch of 2 prompts came back as 2 rows, not 4)."""
    model, tok = _load(exports["hash-emb-bucket"])
    tok.padding_side = "left"
    prompts = ["KING. My lord,", "O"]
    enc = tok(prompts, return_tensors="pt", padding=True)
    width = enc.input_ids.shape[1]
    kw = dict(max_new_tokens=4, do_sample=False, num_beams=2, num_return_sequences=2)
    out = model.generate(**enc, **kw)
    assert out.shape[0] == 4
    for i, p in enumerate(prompts):
        row = tok(p, return_tensors="pt").input_ids
        alone = model.generate(row, **kw)[:, row.shape[1] :]
        for j in range(2):
            got = out[2 * i + j, width:]
            assert got[: alone.shape[1]].tolist() == alone[j].tolist()
            assert out[2 * i + j, :width].tolist() == enc.input_ids[i].tolist()


@pytest.mark.numerics  # in process: gradients of a float model
@pytest.mark.parametrize("name", ["hash-emb-bucket", "levers-vocab"])
def test_gradient_checkpointing_gives_the_same_gradients(exports, name):
    """``gradient_checkpointing_enable()`` (what ``Trainer(gradient_checkpointing=True)`` calls) on an export: the
    loss and every gradient of a ``labels=`` step equal those without it (a recurrent kind with a hash embedding;
    value embeddings, x0 mixing and U-Net skips). Before: ValueError "MegahashForCausalLM does not support
    activation checkpointing"."""
    model, tok = _load(exports[name])
    batch = tok(["KING. My lord, the queen is dead.", "O my"], return_tensors="pt", padding=True)
    labels = batch.input_ids.masked_fill(batch.attention_mask == 0, -100)

    def grads():
        model.zero_grad()
        model.train()
        loss = model(**batch, labels=labels).loss
        loss.backward()
        return loss.detach(), {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}

    loss, want = grads()
    model.gradient_checkpointing_enable()  # transformers defaults (reentrant)
    assert model.model.gradient_checkpointing
    loss_ckpt, got = grads()
    torch.testing.assert_close(loss_ckpt, loss)  # fp32 defaults: the same ops, recomputed
    assert sorted(got) == sorted(want) and len(got) > 5
    for k in want:
        torch.testing.assert_close(got[k], want[k], msg=k)


@pytest.mark.numerics  # in process: logits of a float model
def test_fill_mask_pipeline_on_an_encoder_export(exports):
    """docs/convert.md's recipe: ``pipeline("fill-mask")`` on an MLM encoder export with
    ``tokenizer_kwargs={"split_special_tokens": False}`` scores the mask position: its top token is the argmax of
    the model's logits there. (Without it the tokenizer reads "<mask>" as text, as every megahash path does.)"""
    from transformers import AutoModelForMaskedLM, AutoTokenizer, pipeline

    folder = str(exports["encoder-mlm"])
    model = AutoModelForMaskedLM.from_pretrained(folder, trust_remote_code=True).eval()
    tok = AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
    text = f"KING. My lord, the {tok.mask_token} is dead."
    assert tok.mask_token_id not in tok(text).input_ids  # special strings are text by default
    ids = tok(text, split_special_tokens=False, return_tensors="pt").input_ids
    assert tok.mask_token_id in ids[0].tolist()
    fill = pipeline("fill-mask", model=model, tokenizer=tok)
    top = fill(text, tokenizer_kwargs={"split_special_tokens": False})[0]
    with torch.no_grad():
        logits = model(ids).logits[0, ids[0].tolist().index(tok.mask_token_id)]
    assert top["token"] == int(logits.argmax())


TF4_USER = r"""
import json, os, sys, torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer
src, copy, text = sys.argv[1], sys.argv[2], sys.argv[3]
tok = AutoTokenizer.from_pretrained(src, trust_remote_code=True)
model = AutoModelForCausalLM.from_pretrained(src, trust_remote_code=True).eval()
enc = tok(text, return_tensors="pt")
out = model.generate(**enc, max_new_tokens=5, do_sample=False)  # the idiom: everything the tokenizer returns
model.save_pretrained(copy)
again = AutoModelForCausalLM.from_pretrained(copy, trust_remote_code=True).eval()
with torch.no_grad():
    same = bool(torch.equal(again(enc.input_ids).logits, model(enc.input_ids).logits))
print(json.dumps({"version": transformers.__version__, "keys": sorted(enc.keys()), "new": out[0].tolist(),
                  "copy_same": same}))
"""


@pytest.mark.numerics  # greedy tokens of a float model under two transformers versions
def test_transformers_4_user_idioms(exports, tmp_path, tf4_path):
    """On transformers 4.46 (side install): ``model.generate(**tok(text, return_tensors="pt"))`` runs and gives
    5.x's tokens, and ``save_pretrained`` of the loaded export reloads (same logits). Before: the tokenizer returned
    token_type_ids, which 4.x's generate() refuses ("model_kwargs are not used by the model"); and the saved copy
    had no modeling_megahash.py (4.x does not mark remote-code models for their Auto class), so it did not load."""
    import json
    import subprocess
    import sys

    from conftest import child_env

    folder = exports["levers-vocab"]
    text = "KING. My lord, the queen"
    r = subprocess.run(
        [sys.executable, "-c", TF4_USER, str(folder), str(tmp_path / "copy"), text],
        cwd=str(tmp_path),
        env=child_env(PYTHONPATH=str(tf4_path)),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["version"] == "4.46.3" and got["keys"] == ["attention_mask", "input_ids"] and got["copy_same"]
    model, tok = _load(folder)
    enc = tok(text, return_tensors="pt")
    # greedy token ids of one model under two transformers versions (the same code): no near-tie at these seeds
    assert model.generate(**enc, max_new_tokens=5, do_sample=False)[0].tolist() == got["new"]
