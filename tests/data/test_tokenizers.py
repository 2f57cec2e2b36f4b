"""Any tokenizer, one tokenizer everywhere (issue 13).

Two tokenizers: the sentencepiece BPE model of the session fixture (ids 0-4 = <s> <pad> </s> <unk>
<mask>) and a GPT-2/Pythia-style byte-level BPE ``tokenizer.json`` trained here with the
``tokenizers`` library, whose only specials ``<|endoftext|>`` / ``<|padding|>`` have ids 700/701.
For each: preprocess (the real data tool) -> 20 training steps -> ``megahash eval`` -> export ->
``AutoTokenizer``/``AutoModelForCausalLM``; and a property test over generated texts (special-token
strings, control characters, whitespace runs, mixed scripts) comparing the ids and hash codes of
every path: the data stage's shards, ``megahash.eval.text``, the exported Hugging Face tokenizer
and the export's remote-code text coder.
"""

import json
import os
import random
import subprocess
import sys

import numpy as np
import pytest

import conftest
from conftest import ROOT, child_env, run

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

TINY = [
    *conftest.TINY,
    "model.hidden_size=32",
    "model.ffn_hidden_size=64",
    "model.max_position_embeddings=128",
    "train.global_batch_size=4",
    "train.eval_interval=0",
    "train.lr=3e-3",
    "train.log_interval=10",
    "data.split=100,0,0",
]
SPECIAL_STRINGS = ["<s>", "</s>", "<unk>", "<pad>", "<mask>", "<|endoftext|>", "<|padding|>"]
PIECES = [
    "KING.",
    "lord",
    " ",
    "  ",
    "\t",
    "\n",
    "\n\n",
    "    ",
    "\u4e2d\u6587",
    "\u00e9t\u00e9",
    "\u0416\u0438\u0437\u043d\u044c",
    "\u2603",
    "x\u00a0y",
    "\x00",
    "\x07",
    "\x1b[0m",
    "1234",
    "play",
    "ing",
    "'s",
    "--",
    "\U0001f600",
    "\r\n",
]


def gen_texts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        parts = [rng.choice(PIECES + SPECIAL_STRINGS) for _ in range(rng.randint(1, 25))]
        out.append("".join(parts))
    out += ["<s>", "</s>", "<mask>", "a<mask>b", "<|endoftext|>x", " " * 40 + "end", "\t\t\n\n  x  \n"]
    return out


def make_bpe(path, docs) -> None:
    """Byte-level BPE (GPT-2 style) with the specials at the end of the vocabulary."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tr = trainers.BpeTrainer(
        vocab_size=700, special_tokens=[], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(docs, tr)
    tok.add_special_tokens([AddedToken("<|endoftext|>", special=True), AddedToken("<|padding|>", special=True)])
    tok.save(str(path))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """60 Shakespeare documents with special-token strings and odd whitespace spliced in, as jsonl."""
    from megahash.data.preprocess.sources import open_source, select_documents

    d = tmp_path_factory.mktemp("tok_corpus")
    docs = list(select_documents(open_source("shakespeare"), 0, 60))
    extra = gen_texts(40, seed=1)
    rng = random.Random(3)
    docs = [doc[:1500] + rng.choice(extra) + doc[1500:3000] for doc in docs]
    path = d / "corpus.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
    make_bpe(d / "bpe.json", docs)
    r = run(
        [
            sys.executable,
            "data_tools/train_tokenizer.py",
            "--input",
            str(path),
            "--output",
            str(d / "lossless"),
            "--vocab-size",
            "600",
            "--quiet",
        ]
    )  # the default: lossless
    assert r.returncode == 0, r.stderr[-2000:]
    return {"dir": d, "jsonl": path, "docs": docs, "bpe": d / "bpe.json", "lossless": f"{d / 'lossless'}.model"}


def _tokenizers(corpus, shakespeare_shards):
    return {"sp": shakespeare_shards["tokenizer"], "bpe": str(corpus["bpe"]), "lossless": corpus["lossless"]}


@pytest.fixture(scope="module", params=["sp", "bpe"])
def pipeline(request, corpus, shakespeare_shards, tmp_path_factory):
    """preprocess -> 20 steps -> export, once per tokenizer kind (training and export in this process)."""
    kind = request.param
    tok = _tokenizers(corpus, shakespeare_shards)[kind]
    d = tmp_path_factory.mktemp(f"pipe_{kind}")
    prefix = d / "shards"
    if kind == "bpe":  # Megatron-LM's spellings
        args = [
            "--tokenizer-type",
            "HuggingFaceTokenizer",
            "--tokenizer-model",
            tok,
            "--json-keys",
            "text",
            "--append-eod",
        ]
    else:
        args = ["--tokenizer", tok]
    r = run(
        [
            sys.executable,
            "data_tools/preprocess_data.py",
            "--input",
            str(corpus["jsonl"]),
            "--output-prefix",
            str(prefix),
            "--word-hashes",
            "md5",
            "--quiet",
            *args,
        ]
    )
    assert r.returncode == 0, r.stderr[-2000:]
    save = d / "run"
    r = conftest.pretrain_here(
        [f"data.prefix=[{prefix}]", f"data.tokenizer={tok}", *TINY, "train.steps=20", f"train.save_dir={save}"]
    )
    assert r.returncode == 0, r.stderr[-3000:]
    hf = d / "hf"
    r = conftest.megahash_here(["export-hf", "--checkpoint", str(save), "--output", str(hf)])
    assert r.returncode == 0, r.stderr[-3000:]
    return {"kind": kind, "tokenizer": tok, "prefix": str(prefix), "run": save, "hf": hf, "dir": d}


def test_special_ids_come_from_the_tokenizer(pipeline):
    meta = json.loads(open(pipeline["prefix"] + "_meta.json").read())
    ids = meta["tokenizer"]["special_ids"]
    import yaml

    cfg = yaml.safe_load((pipeline["run"] / "resolved_config.yaml").read_text())
    assert cfg["data"]["special_ids"] == ids  # recorded in the checkpoint
    if pipeline["kind"] == "bpe":
        assert ids == {"bos": 700, "pad": 701, "eos": 700, "unk": None, "mask": None}
        assert meta["stream"]["eos_id"] == 700
    else:
        assert ids == {"bos": 0, "pad": 1, "eos": 2, "unk": 3, "mask": 4}
    from megahash.data.shards import ShardSet

    s = ShardSet.open(pipeline["prefix"])
    last = [int(s.tokens.get(d)[-1]) for d in range(3)]
    assert last == [ids["eos"]] * 3  # documents end with the tokenizer's own eos


def test_export_and_eval_refuse_a_tokenizer_of_other_special_ids(pipeline, corpus, shakespeare_shards, tmp_path):
    """--tokenizer naming a tokenizer whose special ids differ from the run's (data.special_ids) is one line, exit 2,
    nothing written: the export used to warn and write the model without a tokenizer (with a smaller tokenizer
    vocabulary, a cut table), and eval scored text with the other tokenizer's ids."""
    other = str(corpus["bpe"]) if pipeline["kind"] == "sp" else shakespeare_shards["tokenizer"]
    out = tmp_path / "hf"
    r = conftest.megahash_here(
        ["export-hf", "--checkpoint", str(pipeline["run"]), "--output", str(out), "--tokenizer", other, "--no-verify"]
    )
    line = r.stderr.strip()
    assert r.returncode == 2 and not out.exists(), r.stderr[-2000:]
    assert "\n" not in line and "special ids" in line and "the checkpoint was trained with" in line, line
    text = tmp_path / "t.txt"
    text.write_text(corpus["docs"][0][:300])
    r = conftest.megahash_here(
        [
            "eval",
            "--checkpoint",
            str(pipeline["run"]),
            "--tokenizer",
            other,
            "--text",
            str(text),
            "--out",
            str(tmp_path / "ev"),
        ]
    )
    assert r.returncode == 2 and "special ids" in r.stderr and "\n" not in r.stderr.strip(), r.stderr[-2000:]


def test_mlm_with_a_tokenizer_without_mask_is_one_line_before_training(pipeline, tmp_path):
    """The bpe tokenizer has no <mask>: train.objective=mlm stops in one line, exit 2, before a step (it was a
    ValueError traceback from the first batch's corruption) and before the run folder is made."""
    if pipeline["kind"] != "bpe":
        pytest.skip("the sentencepiece tokenizer has a <mask>")
    save = tmp_path / "mlm"
    r = conftest.pretrain_here(
        [
            f"data.prefix=[{pipeline['prefix']}]",
            f"data.tokenizer={pipeline['tokenizer']}",
            *TINY,
            "train.objective=mlm",
            "model.arch=encoder",
            "train.steps=2",
            f"train.save_dir={save}",
        ]
    )
    line = r.stderr.strip()
    assert r.returncode == 2 and "\n" not in line and "needs a mask token" in line, r.stderr[-2000:]
    assert not save.exists()


def test_a_special_id_given_in_the_config_keeps_the_other_roles_of_the_meta():
    """data.special_ids.ROLE=ID overrides that role alone: the shard meta's other ids stay (eos 8 of a tokenizer
    trained with --eos_id=8 is the EOD); before, the config's partial mapping replaced them all (eos None: EOD 2)."""
    from megahash.config import load_config
    from megahash.data.dataset import record_special_ids
    from megahash.data.documents import eod_id

    meta = {"tokenizer": {"special_ids": {"bos": 6, "pad": 7, "eos": 8, "unk": 5, "mask": 0}}}
    cfg = load_config(None, ["data.special_ids.mask=9"])
    ids = record_special_ids(cfg, meta)
    assert ids == {"bos": 6, "pad": 7, "eos": 8, "unk": 5, "mask": 9} == cfg.data.special_ids
    assert eod_id(ids) == 8
    assert record_special_ids(load_config(None, []), meta) == meta["tokenizer"]["special_ids"]


def test_eval_export_and_transformers(pipeline, corpus):
    """megahash eval runs; the export loads with AutoTokenizer/AutoModelForCausalLM (no remote code
    for the qwen2 format), its tokenizer gives the data stage's ids, its logits equal megahash's."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megahash.checkpoint.weights import load_for_inference
    from megahash.eval.text import load_codec

    cfg_json = json.loads((pipeline["hf"] / "config.json").read_text())
    assert cfg_json["model_type"] == "qwen2"
    special = cfg_json["megahash_config"]["data"]["special_ids"]
    assert cfg_json["eos_token_id"] == special["eos"]
    gen = json.loads((pipeline["hf"] / "generation_config.json").read_text())
    assert gen["eos_token_id"] == special["eos"]
    tok = AutoTokenizer.from_pretrained(str(pipeline["hf"]))
    model = AutoModelForCausalLM.from_pretrained(str(pipeline["hf"])).eval()
    cfg, mh, ckpt = load_for_inference(str(pipeline["run"]))
    codec = load_codec(cfg, ckpt)
    text = corpus["docs"][0][:400] + " <s> </s> <mask> <|endoftext|>\t\t  x"
    ids = tok(text, add_special_tokens=False).input_ids
    assert ids == codec.encode(text).ids
    assert tok(text).input_ids == ids  # nothing added around a text
    with torch.no_grad():
        hf_logits = model(torch.tensor([ids[:60]])).logits[0]
        mh_logits = mh(torch.tensor([ids[:60]]))[0, :, : codec.vocab_size]
    torch.testing.assert_close(hf_logits, mh_logits.float(), atol=1e-4, rtol=1e-4)


def test_the_exported_tokenizer_reads_back_with_the_runs_special_ids(pipeline, corpus, tmp_path):
    """The export's tokenizer folder is the run's tokenizer again: same special ids by role (the BPE's bos is its
    eos, GPT-2's <|endoftext|>; the export dropped that bos_token, so ``megahash eval --tokenizer HFDIR`` refused
    the folder as "not the run's tokenizer"), and transformers reads the same bos/eos from it."""
    from transformers import AutoTokenizer

    from megahash.tokenization import load_tokenizer

    run_tok = load_tokenizer(pipeline["tokenizer"])
    assert load_tokenizer(str(pipeline["hf"])).special_ids == run_tok.special_ids
    ids = run_tok.special_ids
    hf = AutoTokenizer.from_pretrained(str(pipeline["hf"]))
    assert hf.eos_token_id == ids["eos"]
    if pipeline["kind"] == "bpe":
        assert ids["bos"] == ids["eos"] and hf.bos_token_id == ids["bos"]
    else:  # a separate <s>: never declared (megahash trains no BOS; lm-eval's hf model then prefixes the eos)
        assert ids["bos"] != ids["eos"] and hf.bos_token_id is None
    text = corpus["docs"][1][:300]
    assert hf(text).input_ids == run_tok.encode(text)  # nothing added around a text, bos declared or not
    out = tmp_path / "score.json"
    args = ["eval", "--checkpoint", str(pipeline["run"]), "--tokenizer", str(pipeline["hf"]), "--out", str(out)]
    r = conftest.megahash_here([*args, "--text", str(corpus["jsonl"])])
    assert r.returncode == 0, r.stderr[-2000:]


def test_same_score_on_every_path(pipeline, corpus):
    """Rolling log-likelihoods of documents ~15x longer than the 64-token context, containing
    special-token strings: ``megahash eval`` (CLI, in this process), the lm-eval ``megahash`` model and lm-eval's
    ``hf`` model on the export agree to 1e-4 relative, with no window argument anywhere (the window
    is the trained sequence length on every path); for the BPE run also lm-eval's own CLI with
    ``--model megahash`` in a fresh process (megahash-lm-eval)."""
    import re

    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    from megahash.eval.lm import MegahashEvalLM

    docs = corpus["docs"][:2]
    assert any(t in "".join(docs) for t in SPECIAL_STRINGS)
    reqs = [Instance(request_type="loglikelihood_rolling", doc={}, arguments=(d,), idx=i) for i, d in enumerate(docs)]
    mh = MegahashEvalLM(checkpoint=str(pipeline["run"]), batch_size=4)
    hf = HFLM(pretrained=str(pipeline["hf"]), batch_size=4, device="cpu")
    assert mh.max_length == hf.max_length == 64
    assert len(mh.codec.encode(docs[0])) > 10 * 64  # many windows
    a = np.array(mh.loglikelihood_rolling(reqs))
    b = np.array(hf.loglikelihood_rolling(reqs))
    np.testing.assert_allclose(a, b, rtol=1e-4)
    words = sum(len(re.split(r"\s+", d)) for d in docs)
    expect = float(np.exp(-a.sum() / words))
    tasks = _ppl_task(pipeline["dir"], corpus)
    out = conftest.megahash_here(
        [
            "eval",
            "--checkpoint",
            str(pipeline["run"]),
            "--tasks-dir",
            str(tasks),
            "--tasks",
            "tok_ppl",
            "--out",
            str(pipeline["dir"] / "eval.json"),
        ]
    )
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads((pipeline["dir"] / "eval.json").read_text())["results"]["tok_ppl"]
    assert abs(res["word_perplexity"] / expect - 1) < 1e-4
    if pipeline["kind"] != "bpe":
        return
    lm_out = pipeline["dir"] / "lm_eval_out"
    # its own process, forked from the test fork server (conftest.run): the CLI's start, not the interpreter's
    out = run(
        [
            sys.executable,
            "-m",
            "megahash.eval.lm_eval_cli",
            "--model",
            "megahash",
            "--model_args",
            f"checkpoint={pipeline['run']}",
            "--batch_size",
            "4",
            "--tasks",
            "tok_ppl",
            "--include_path",
            str(tasks),
            "--output_path",
            str(lm_out),
        ]
    )
    assert out.returncode == 0, out.stderr[-3000:]
    found = [json.loads(p.read_text()) for p in lm_out.rglob("results*.json")]
    assert found, out.stdout[-2000:]
    got = found[0]["results"]["tok_ppl"]["word_perplexity,none"]
    assert abs(got / expect - 1) < 1e-4


def _ppl_task(d, corpus):
    tasks = d / "tasks"
    tasks.mkdir(exist_ok=True)
    data = tasks / "tok_ppl.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in corpus["docs"][:2]))
    (tasks / "tok_ppl.yaml").write_text(
        "task: tok_ppl\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: " + str(data) + "\n"
        "test_split: test\noutput_type: loglikelihood_rolling\ndoc_to_text: ''\ndoc_to_target: '{{text}}'\n"
        "metric_list:\n  - metric: word_perplexity\n  - metric: bits_per_byte\n"
    )
    return tasks


@pytest.mark.parametrize("kind", ["sp", "bpe", "lossless"])
def test_one_tokenizer_everywhere(kind, corpus, shakespeare_shards, tmp_path):
    """Generated texts: data stage == megahash.eval.text == exported HF tokenizer == remote text coder
    (ids), and the data stage's md5 codes == eval's == the remote coder's."""
    from transformers import AutoTokenizer

    from megahash.config import Config
    from megahash.convert.export import write_hashing_files
    from megahash.convert.tokenizer import write_tokenizer
    from megahash.data.shards import ShardSet
    from megahash.eval.text import load_codec
    from megahash.hashing.text_coder import TextCoder

    tok = _tokenizers(corpus, shakespeare_shards)[kind]
    texts = [t for t in gen_texts(150, seed=11) if t.strip()]
    jsonl = tmp_path / "gen.jsonl"
    jsonl.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    prefix = tmp_path / "gen"
    r = run(
        [
            sys.executable,
            "data_tools/preprocess_data.py",
            "--input",
            str(jsonl),
            "--output-prefix",
            str(prefix),
            "--tokenizer",
            tok,
            "--word-hashes",
            "md5",
            "--no-append-eos",
            "--quiet",
        ]
    )
    assert r.returncode == 0, r.stderr[-2000:]
    shards = ShardSet.open(str(prefix))
    cfg = Config()
    cfg.data.prefix = [str(prefix)]
    cfg.data.tokenizer = tok
    cfg.model.embedding = "hash-emb"
    cfg.model.embed.hash_spec = "md5"
    codec = load_codec(cfg)
    out = tmp_path / "hf"
    out.mkdir()
    info = write_tokenizer(out, codec, 1024)
    assert info["mismatches"] == 0
    write_hashing_files(out, codec, cfg)
    hf_tok = AutoTokenizer.from_pretrained(str(out))
    coder = TextCoder.from_pretrained(str(out))
    texts = [t for t in texts if codec.encode(t).ids]  # the data stage skips texts without tokens
    assert len(shards.tokens) == len(texts)
    for d, text in enumerate(texts):
        stage = shards.tokens.get(d).astype(np.int64).tolist()
        enc = codec.encode(text)
        assert enc.ids == stage, (text, enc.ids, stage)
        assert hf_tok(text, add_special_tokens=False).input_ids == stage, text
        assert coder.encode(text)[0] == stage, text
        stage_codes = shards.hash_codes("md5", d, 0, len(stage))
        np.testing.assert_array_equal(codec.codes(enc), stage_codes)  # bit-exact: integer codes
        np.testing.assert_array_equal(coder.codes(stage), stage_codes)  # bit-exact: integer codes
    special = set(i for r, i in codec.special_ids.items() if i is not None and r != "unk")  # unk: unknown characters
    all_ids = set(np.concatenate([shards.tokens.get(d) for d in range(len(texts))]).tolist())
    assert not (all_ids & special)  # special strings in text are text, never the special ids


@pytest.mark.parametrize("kind", ["lossy", "lossless", "lossless-angle"])
def test_unigram_export_keeps_control_and_byte_pieces_out_of_text(kind, corpus, tmp_path):
    """A sentencepiece Unigram model's exported tokenizer.json gives sentencepiece's ids on texts full of
    special-token and byte-piece strings (Hugging Face's Unigram matched the control pieces, which score 0: a
    literal `</s>` was the eos id, `<0x41>` a byte): lossy (NFKC, no byte fallback), lossless on Shakespeare
    (byte fallback, `<` no piece of its own: the byte pieces of `<` and the space swap names) and lossless on
    text with `<` (a piece of its own). A text whose ids differ must be another segmentation of equal score
    (Viterbi ties before unknown characters, which the two lattices break apart); lossless decodes exactly; megahash
    loading the folder back sees the model's own piece names."""
    import sentencepiece as spm
    from transformers import AutoTokenizer
    from transformers.convert_slow_tokenizer import import_protobuf

    from megahash.config import Config
    from megahash.convert.tokenizer import PROBES, write_tokenizer
    from megahash.data.preprocess import train_tokenizer
    from megahash.data.text_bytes import TokenBytes
    from megahash.eval.text import load_codec
    from megahash.piece_escape import unigram_escape
    from megahash.tokenization import load_tokenizer

    src = (
        ["--input", str(corpus["jsonl"])]
        if kind == "lossless-angle"
        else ["--input", "shakespeare", "--max-docs", "150"]
    )
    lossy = ["--lossy"] if kind == "lossy" else []
    model = tmp_path / "uni"
    args = [*src, "--output", str(model), "--vocab-size", "600", "--type", "unigram", "--threads", "1", "--quiet"]
    assert train_tokenizer.main(args + lossy) == 0
    cfg = Config()
    cfg.data.tokenizer = f"{model}.model"
    codec = load_codec(cfg)
    proto = import_protobuf().ModelProto()
    proto.ParseFromString(codec.sp.model_bytes)
    escape = unigram_escape(proto)
    assert escape and escape["char"] == "<"
    assert bool(escape["decode"]) == (kind == "lossless")  # the byte pieces swap only where `<` is no piece
    out = tmp_path / "hf"
    out.mkdir()
    assert write_tokenizer(out, codec, 1024)["mismatches"] == 0
    hf = AutoTokenizer.from_pretrained(str(out))
    sp = spm.SentencePieceProcessor(model_proto=codec.sp.model_bytes)
    texts = (
        PROBES + gen_texts(200, seed=7) + ["<s>", "</s><pad><unk>", "<0x41><0x00>", "a<s>b", "<<s>>", "if a<b:", "<"]
    )
    ties = 0
    for t in texts:
        want, got = codec.encode(t).ids, hf(t, add_special_tokens=False).input_ids
        if got != want:  # another Viterbi path of the same score, never a special id from the text
            assert sum(sp.get_score(i) for i in got) == pytest.approx(sum(sp.get_score(i) for i in want), abs=1e-3), t
            assert hf.decode(got) == hf.decode(want), t
            ties += 1
        if kind != "lossy":
            assert hf.decode(want) == codec.decode(want) == t, t
    assert ties <= len(texts) // 20, ties
    special = {i for r, i in codec.special_ids.items() if i is not None and r != "unk"}
    assert not special & {i for t in texts for i in hf(t, add_special_tokens=False).input_ids}
    # megahash reading the export back (data.tokenizer=FOLDER, import-hf): the pieces under their sentencepiece
    # names, so word hashes and bytes per token are the model's own
    mine, back = load_tokenizer(f"{model}.model"), load_tokenizer(str(out))
    assert back.kind == "hf" and back.hash_pieces == mine.hash_pieces
    assert back.encode(texts[-2]) == mine.encode(texts[-2])
    np.testing.assert_array_equal(TokenBytes(back).size, TokenBytes(mine).size)  # bit-exact: integer counts
    np.testing.assert_array_equal(TokenBytes(back).space, TokenBytes(mine).space)  # bit-exact: flags


@pytest.mark.parametrize(
    "normalizer, decoder",
    [
        (None, None),
        ([], 5),
        ({"normalizers": "x"}, {"decoders": [7]}),
        ({"normalizers": [{"type": "Replace", "pattern": "x"}, 1]}, {}),
        ({"normalizers": [{"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}, {"type": "Replace"}]}, {}),
        ({"normalizers": [{"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"},
                          {"type": "Replace", "pattern": {"String": ["<"]}, "content": " "}]}, {}),
        ({"normalizers": [{"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"},
                          {"type": "Replace", "pattern": {"String": "<<"}, "content": " "}]}, {}),
    ],
)  # fmt: skip
def test_an_escape_is_read_only_from_the_exports_own_steps(normalizer, decoder):
    """megahash reads a tokenizer.json of anyone's (data.tokenizer): the Unigram export's escape is recognised only
    from its two normaliser steps (the space made "\u2581", then one character made a space), anything else of any
    shape is no escape, and nothing raises."""
    from megahash.piece_escape import escaped_char

    assert escaped_char({"normalizer": normalizer, "decoder": decoder}) is None
    steps = [{"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}]
    steps.append({"type": "Replace", "pattern": {"String": "<"}, "content": " "})
    swap = {"decoders": [{"type": "Replace", "pattern": {"String": "<0x3C>"}, "content": "\u2581"}]}
    assert escaped_char({"normalizer": {"normalizers": steps}, "decoder": decoder}) == ("<", False)
    assert escaped_char({"normalizer": {"normalizers": steps}, "decoder": swap}) == ("<", True)


def test_default_tokenizer_is_lossless(corpus, tmp_path):
    """train_tokenizer.py's default model round-trips arbitrary text (newlines, tabs, space runs, any
    script, control characters, special-token strings), through sentencepiece and through the
    exported Hugging Face tokenizer; --lossy keeps sentencepiece's folding normaliser."""
    from megahash.config import Config
    from megahash.convert.tokenizer import write_tokenizer
    from megahash.eval.text import load_codec

    cfg = Config()
    cfg.data.tokenizer = corpus["lossless"]
    codec = load_codec(cfg)
    write_tokenizer(tmp_path, codec, 1024)
    from transformers import AutoTokenizer

    hf_tok = AutoTokenizer.from_pretrained(str(tmp_path))
    texts = gen_texts(200, seed=5) + [corpus["docs"][0], "def f(x):\n\treturn  x\n\n\n    # done\n"]
    for t in texts:
        ids = codec.encode(t).ids
        assert codec.decode(ids) == t
        assert hf_tok.decode(ids) == t
    r = run(
        [
            sys.executable,
            "data_tools/train_tokenizer.py",
            "--input",
            str(corpus["jsonl"]),
            "--output",
            str(tmp_path / "lossy"),
            "--vocab-size",
            "300",
            "--lossy",
            "--quiet",
        ]
    )
    assert r.returncode == 0, r.stderr[-2000:]
    import sentencepiece as spm

    lossy = spm.SentencePieceProcessor(model_file=str(tmp_path / "lossy.model"))
    assert lossy.decode(lossy.encode("a  b\n\tc")) == "a b c"


def test_small_corpus_split_is_a_one_line_error(tmp_path, shakespeare_shards):
    """10 documents with the default 98,2,0 split: megatron-core would search for validation tokens
    for ever; megahash says what to change instead. 90,10,0 gives both splits documents."""
    from megahash.data.split_sizes import check_split_sizes
    from megahash.errors import DataError

    r = run(
        [
            sys.executable,
            "data_tools/preprocess_data.py",
            "--input",
            "shakespeare",
            "--max-docs",
            "10",
            "--output-prefix",
            str(tmp_path / "s"),
            "--tokenizer",
            shakespeare_shards["tokenizer"],
            "--quiet",
        ]
    )
    assert r.returncode == 0, r.stderr[-2000:]
    path = str(tmp_path / "s_text_document")
    with pytest.raises(
        DataError,
        match=r"data.split=98,2,0 leaves the validation split no documents of the 10 .*"
        r"data.split=90,10,0",
    ):
        check_split_sizes("98,2,0", [path], {"train": 8, "validation": 4})
    check_split_sizes("90,10,0", [path], {"train": 8, "validation": 4})
    check_split_sizes("98,2,0", [path], {"train": 8, "validation": 0})  # no validation wanted
    with pytest.raises(DataError, match="train split no documents"):
        check_split_sizes("1,99,0", [path], {"train": 8, "validation": 4})


@pytest.mark.parametrize(
    "split", ["98,2,0", "90,10,0", "1,99,0", "100,0,0", "969,30,1", "0.5,0.5", "3", "1, 2 ,3", "7/2/1"]
)
def test_split_bounds_are_megatron_cores(split):
    """The torch-free split of megahash/data/split_sizes.py (run before torch by `--check inputs`) gives the
    bounds megatron-core's builder divides documents by, float for float (so ``round(b N)`` agrees)."""
    from megatron.core.datasets.blended_megatron_dataset_config import (
        convert_split_vector_to_split_matrix,
        parse_and_normalize_split,
    )

    from megahash.data.split_sizes import split_bounds

    assert split_bounds(split) == convert_split_vector_to_split_matrix(parse_and_normalize_split(split))


def test_samples_past_the_memory_of_their_index_are_a_one_line_error(shakespeare_shards, tmp_path, monkeypatch):
    """train.steps=1e12 (8e12 samples) made megatron-core count the epochs one at a time (3e8 of the quickstart's
    shards) and then allocate epochs x documents entries (MemoryError, or the OOM killer); 1e30 counted for ever,
    deaf to SIGTERM. build_datasets refuses both before megatron-core's builder, naming the epochs and the key
    to lower; a blend's share is what each of its sets must give; a run of ordinary size builds."""
    from megahash.config import load_config
    from megahash.data.dataset import build_datasets
    from megahash.data.split_sizes import check_split_sizes
    from megahash.errors import DataError

    prefix = shakespeare_shards["prefix"]
    cfg = load_config(
        None, [f"data.prefix=[{prefix}]", f"data.tokenizer={shakespeare_shards['tokenizer']}", "data.seq_length=64"]
    )
    path = f"{prefix}_text_document"
    with monkeypatch.context() as m:  # a machine of 1 GiB: 8e7 samples (~2 GB of index) do not fit, a quarter does
        m.setattr(os, "sysconf", lambda key: {"SC_PAGE_SIZE": 4096, "SC_PHYS_PAGES": 1 << 18}[key])
        with pytest.raises(DataError, match="more than this machine's 1 GiB of memory"):
            check_split_sizes("98,2,0", [path], {"train": 8 * 10**7}, 64)
        check_split_sizes("98,2,0", [path] * 4, {"train": 8 * 10**7}, 64, [1.0] * 4)
    for samples in (8 * 10**12, 10**30):
        with pytest.raises(
            DataError,
            match=r"train samples of 64 tokens need [0-9,]+ epochs of the [0-9,]+ documents"
            r".* GiB of memory; lower train.steps \(or train.global_batch_size\)",
        ):
            build_datasets(cfg, samples, 8, str(tmp_path / "cache"))
    assert not list((tmp_path / "cache").glob("**/*.npy"))  # nothing of an index written
    with pytest.raises(DataError, match="lower data.valid_samples"):
        build_datasets(cfg, 8, 8 * 10**12, str(tmp_path / "cache"))
    train = build_datasets(cfg, 64, 8, str(tmp_path / "cache")).train
    assert len(train) >= 64


def test_zst_input_and_offline_hub_name(corpus, shakespeare_shards, tmp_path):
    """A .jsonl.zst corpus gives the same shards as the plain .jsonl; an HF tokenizer name offline is
    one line naming what to pass instead (exit 2)."""
    import shutil

    zst = tmp_path / "corpus.jsonl.zst"
    try:
        import zstandard

        zst.write_bytes(zstandard.ZstdCompressor().compress(corpus["jsonl"].read_bytes()))
    except ImportError:
        if shutil.which("zstd") is None:
            pytest.skip("neither the zstandard package nor the zstd command is installed")
        subprocess.run(["zstd", "-q", "-o", str(zst), str(corpus["jsonl"])], check=True)
    outs = {}
    for name, src in (("plain", corpus["jsonl"]), ("zst", zst)):
        r = run(
            [
                sys.executable,
                "data_tools/preprocess_data.py",
                "--input",
                str(src),
                "--output-prefix",
                str(tmp_path / name),
                "--tokenizer",
                str(corpus["bpe"]),
                "--quiet",
            ]
        )
        assert r.returncode == 0, r.stderr[-2000:]
        outs[name] = (tmp_path / f"{name}_text_document.bin").read_bytes()
    assert outs["plain"] == outs["zst"] and len(outs["plain"]) > 1000
    r = run(
        [
            sys.executable,
            "data_tools/preprocess_data.py",
            "--input",
            str(corpus["jsonl"]),
            "--output-prefix",
            str(tmp_path / "hub"),
            "--tokenizer-type",
            "HuggingFaceTokenizer",
            "--tokenizer-model",
            "EleutherAI/pythia-160m-nonexistent-offline",
        ]
    )
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: cannot load Hugging Face tokenizer"), r.stderr
    assert "tokenizer.json" in lines[0]


def test_missing_tokenizer_fails_at_once_without_hub_retries(shakespeare_shards, tmp_path):
    """`--check inputs` with a data.tokenizer that names nothing: one line, exit 2, in seconds (issue 36:
    64 s of Hugging Face hub retries before): a path-like value is never looked up on the hub, with
    HF_HUB_OFFLINE unset too; a hub name is tried only when it can be (offline or unreachable and not
    in the local cache: the line says how to get it)."""
    import time

    (tmp_path / "data").mkdir()  # "data/spm" is a path here: its first component is a local folder
    cases = [
        ("data/spm", {}, "tokenizer not found: 'data/spm'"),
        ("./spm", {}, "tokenizer not found: './spm'"),
        ("no-such-org/no-such-tok", {"HF_ENDPOINT": "http://127.0.0.1:9"}, "http://127.0.0.1:9 is unreachable"),
        ("no-such-org/no-such-tok", {"HF_HUB_OFFLINE": "1"}, "offline (HF_HUB_OFFLINE) with no copy in the local"),
    ]
    for spec, extra, want in cases:
        env = child_env(HF_HUB_CACHE=tmp_path / "hub", **extra)  # an empty cache: nothing is cached
        if "HF_HUB_OFFLINE" not in extra:
            env.pop("HF_HUB_OFFLINE")
        t0 = time.monotonic()
        r = subprocess.run(
            [
                sys.executable,
                str(ROOT / "megahash/pretrain.py"),
                "--check",
                "inputs",
                "--config",
                str(ROOT / "configs/quickstart.yaml"),
                f"data.prefix=[{shakespeare_shards['prefix']}]",
                f"data.tokenizer={spec}",
            ],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        took = time.monotonic() - t0
        lines = (r.stdout + r.stderr).strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: data.tokenizer: "), (
            r.stdout + r.stderr
        )
        assert want in lines[0], lines[0]
        assert took < 20, (spec, took)  # 1-2 s on the 2-core machine (the hub's retries took 64 s)
        hub_name = spec == "no-such-org/no-such-tok"
        assert ("`hf download no-such-org/no-such-tok`" in lines[0]) == hub_name, lines[0]


def test_export_of_a_tokenizer_that_cannot_encode_a_probe(tmp_path):
    """A Metaspace BPE tokenizer.json with its specials at the end of the vocabulary (added with
    add_special_tokens, so ``<unk>`` is not in its model's vocabulary): ``tokenizers`` raises on a character it never saw,
    and the export's own probe texts (a snowman, Chinese) made ``export-hf`` a traceback. The exported
    tokenizer gives the ids ``tokenizers`` gives, and raises where it raises."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoTokenizer

    from megahash.convert.tokenizer import write_tokenizer
    from megahash.eval.text import TextCodec
    from megahash.tokenization import TokenizerError, load_tokenizer

    docs = ["KING. My lord, the queen is dead.", "How now? tab\there", "e ü ñ Æ 1234 <mask> </s>"]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.train_from_iterator(docs, trainers.BpeTrainer(vocab_size=80, special_tokens=[], show_progress=False))
    tok.add_special_tokens(["</s>", "<pad>", "<unk>"])
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    with pytest.raises(Exception, match="unk"):
        tok.encode("\u2603")  # the library's own answer
    mh = load_tokenizer(str(path))
    assert mh.special_ids["eos"] == tok.token_to_id("</s>") and mh.special_ids["eos"] > 4
    with pytest.raises(TokenizerError, match="cannot encode"):
        mh.encode("\u2603")
    out = tmp_path / "hf"
    out.mkdir()
    info = write_tokenizer(out, TextCodec("hf", mh.vocab_size, sp=mh), 128)
    assert info["mismatches"] == 0
    hf = AutoTokenizer.from_pretrained(str(out))
    tok.encode_special_tokens = True
    for text in docs:
        assert hf(text)["input_ids"] == tok.encode(text, add_special_tokens=False).ids == mh.encode(text)
    with pytest.raises(Exception, match="unk"):
        hf("\u2603")


def test_packed_document_flags_need_an_end_of_document_token(corpus, tmp_path):
    """A byte-level BPE without special tokens (--no-append-eos) has no eos: the dataset's fallback EOD id 2 is an
    ordinary piece of it, so data.eod_mask_loss dropped the loss of every such piece and data.reset_attention_mask
    cut documents there, silently. Now one line, exit 2, before a step; without the flags the run is as before."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok.train_from_iterator(
        corpus["docs"], trainers.BpeTrainer(vocab_size=400, initial_alphabet=alphabet, show_progress=False)
    )
    path = tmp_path / "nospecial.json"
    tok.save(str(path))
    two = tok.id_to_token(2)
    assert two is not None and two not in tok.get_added_tokens_decoder().values()  # id 2 is an ordinary piece
    prefix = tmp_path / "shards"
    args = ["--input", str(corpus["jsonl"]), "--output-prefix", str(prefix), "--tokenizer", str(path), "--quiet"]
    r = run([sys.executable, "data_tools/preprocess_data.py", *args, "--no-append-eos"])
    assert r.returncode == 0, r.stderr[-2000:]
    base = [f"data.prefix=[{prefix}]", f"data.tokenizer={path}", *TINY, "train.steps=2"]
    for flag in ("data.eod_mask_loss=true", "data.reset_attention_mask=true", "data.reset_position_ids=true"):
        save = tmp_path / flag
        r = conftest.pretrain_here([*base, flag, f"train.save_dir={save}"])
        line = r.stderr.strip()
        assert r.returncode == 2 and "\n" not in line and "end-of-document token" in line, r.stderr[-2000:]
        assert flag.split("=")[0] in line and not save.exists()
    r = conftest.pretrain_here([*base, f"train.save_dir={tmp_path / 'plain'}"])
    assert r.returncode == 0, r.stderr[-3000:]
    # a tokenizer with an eos, shards without it: no document would end
    args = [*args[:3], str(tmp_path / "no_eos"), "--tokenizer", corpus["lossless"], "--quiet", "--no-append-eos"]
    assert run([sys.executable, "data_tools/preprocess_data.py", *args]).returncode == 0
    base = [f"data.prefix=[{tmp_path / 'no_eos'}]", f"data.tokenizer={corpus['lossless']}", *TINY, "train.steps=2"]
    r = conftest.pretrain_here([*base, "data.eod_mask_loss=true", f"train.save_dir={tmp_path / 'no_eos_run'}"])
    line = r.stderr.strip()
    assert r.returncode == 2 and "\n" not in line and "--no-append-eos" in line, r.stderr[-2000:]


def test_a_tokenizer_folder_whose_tokenizer_json_is_not_utf8_is_one_line(tmp_path, capsys):
    """A folder's tokenizer.json was read unguarded: a UnicodeDecodeError traceback in pretrain.py --check and
    megahash eval, and a line naming neither the file nor the fix in preprocess_data.py."""
    from megahash.data.preprocess import preprocess_data
    from megahash.tokenization import TokenizerError, load_tokenizer

    folder = tmp_path / "tok"
    folder.mkdir()
    (folder / "tokenizer.json").write_bytes(b'{"version": "1.0", "model": \xff\xfe}')
    with pytest.raises(UnicodeDecodeError):
        (folder / "tokenizer.json").read_text(encoding="utf-8")
    for spec in (folder, folder / "tokenizer.json"):
        with pytest.raises(TokenizerError, match=r"cannot read tokenizer .*tokenizer\.json.*UTF-8"):
            load_tokenizer(str(spec))
    src = tmp_path / "d.jsonl"
    src.write_text('{"text": "hello"}\n')
    rc = preprocess_data.main(
        ["--input", str(src), "--output-prefix", str(tmp_path / "o" / "x"), "--tokenizer", str(folder)]
    )
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "\n" not in err and "tokenizer.json" in err and "Traceback" not in err, err


def test_sets_of_another_tokenizer_in_a_blend_or_valid_are_one_line(corpus, tmp_path):
    """data.prefix blends and data.valid sets were not compared with the run's tokenizer: a set made with a
    smaller vocabulary trained (or was scored) silently on ids that mean other pieces."""
    sets = {}
    for name, tok, docs in (
        ("bpe", corpus["bpe"], "0:30"),
        ("bpe2", corpus["bpe"], "30:"),
        ("sp", corpus["lossless"], "0:"),
    ):
        prefix = tmp_path / name
        args = ["--input", str(corpus["jsonl"]), "--output-prefix", str(prefix), "--tokenizer", str(tok), "--quiet"]
        r = run([sys.executable, "data_tools/preprocess_data.py", *args, "--doc-range", docs])
        assert r.returncode == 0, r.stderr[-2000:]
        sets[name] = str(prefix)
    from megahash.tokenization import load_tokenizer

    assert load_tokenizer(corpus["lossless"]).vocab_size < load_tokenizer(str(corpus["bpe"])).vocab_size
    base = ["--check", "inputs", f"data.tokenizer={corpus['bpe']}", *TINY, "train.steps=2"]
    for extra in (f"data.prefix=[{sets['bpe']},{sets['sp']}]", f"data.valid=[held={sets['sp']}]"):
        r = conftest.pretrain_here([*base, f"data.prefix=[{sets['bpe']}]", extra, f"train.save_dir={tmp_path / 'r'}"])
        line = r.stderr.strip()
        assert r.returncode == 2 and "\n" not in line, r.stderr[-2000:]
        assert f"{sets['sp']!s}" in line and "preprocess every set with the run's tokenizer" in line, line
    same = [f"data.prefix=[{sets['bpe']},{sets['bpe2']}]", f"data.valid=[held={sets['bpe2']}]"]
    r = conftest.pretrain_here([*base, *same, f"train.save_dir={tmp_path / 'ok'}"])
    assert r.returncode == 0, r.stderr[-2000:]


def test_truncation_and_padding_saved_in_a_tokenizer_json_are_not_applied(corpus, tmp_path):
    """A tokenizer.json saved after enable_truncation/enable_padding (as transformers can save one) cut every
    document to its max_length and padded it, silently; every path encodes the whole text, as the same tokenizer
    without those settings does."""
    from tokenizers import Tokenizer

    from megahash.data.shards import ShardSet
    from megahash.tokenization import load_tokenizer

    plain = Tokenizer.from_file(str(corpus["bpe"]))
    plain.encode_special_tokens = True
    cut = Tokenizer.from_file(str(corpus["bpe"]))
    cut.enable_truncation(16)
    cut.enable_padding(pad_id=plain.token_to_id("<|padding|>"), pad_token="<|padding|>", length=20)
    path = tmp_path / "tokenizer.json"
    cut.save(str(path))
    docs = corpus["docs"][:6]
    assert len(Tokenizer.from_file(str(path)).encode(docs[0]).ids) == 20  # the file's own settings
    tok = load_tokenizer(str(path))
    want = [plain.encode(d, add_special_tokens=False).ids for d in docs]
    assert [tok.encode(d) for d in docs] == want and len(want[0]) > 100
    src = tmp_path / "d.jsonl"
    src.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    prefix = tmp_path / "shards"
    args = ["--input", str(src), "--output-prefix", str(prefix), "--tokenizer", str(path), "--quiet"]
    r = run([sys.executable, "data_tools/preprocess_data.py", *args, "--split-chars", "700"])  # continuations too
    assert r.returncode == 0, r.stderr[-2000:]
    shards = ShardSet.open(str(prefix))
    eos = plain.token_to_id("<|endoftext|>")
    assert [shards.tokens[i].tolist() for i in range(len(docs))] == [w + [eos] for w in want]


def test_resuming_on_another_tokenizers_shards_is_one_line(corpus, tmp_path):
    """Two byte-level BPEs of the same pieces whose specials come in another order (eos 700 and 701): the
    embedding rows pad alike, so a resume on the other one's shards trained on silently, every special
    meaning another token. Now one line, exit 2; the run's own shards resume."""
    from tokenizers import AddedToken, Tokenizer

    from megahash.tokenization import load_tokenizer

    swapped = Tokenizer.from_file(str(corpus["bpe"]))
    d = json.loads(swapped.to_str())
    d["added_tokens"] = []
    other = Tokenizer.from_str(json.dumps(d))
    other.add_special_tokens([AddedToken("<|padding|>", special=True), AddedToken("<|endoftext|>", special=True)])
    other_path = tmp_path / "other.json"
    other.save(str(other_path))
    a, b = load_tokenizer(str(corpus["bpe"])), load_tokenizer(str(other_path))
    assert a.vocab_size == b.vocab_size and a.special_ids["eos"] != b.special_ids["eos"]
    prefixes = {}
    for name, tok in (("a", corpus["bpe"]), ("b", other_path)):
        prefixes[name] = tmp_path / name
        args = ["--input", str(corpus["jsonl"]), "--output-prefix", str(prefixes[name]), "--tokenizer", str(tok)]
        r = run([sys.executable, "data_tools/preprocess_data.py", *args, "--quiet"])
        assert r.returncode == 0, r.stderr[-2000:]
    save = tmp_path / "run"
    first = [f"data.prefix=[{prefixes['a']}]", f"data.tokenizer={corpus['bpe']}", *TINY, f"train.save_dir={save}"]
    r = conftest.pretrain_here([*first, "train.steps=2"])
    assert r.returncode == 0, r.stderr[-3000:]
    other_run = [f"data.prefix=[{prefixes['b']}]", f"data.tokenizer={other_path}", *TINY, f"train.save_dir={save}"]
    r = conftest.pretrain_here([*other_run, "train.steps=3"])
    line = r.stderr.strip()
    assert r.returncode == 2 and "\n" not in line and "another tokenizer's pieces" in line, r.stderr[-2000:]
    assert sorted(p.name for p in save.glob("step_*")) == ["step_00000002"]
    r = conftest.pretrain_here([*first, "train.steps=3"])
    assert r.returncode == 0 and "resumed from" in r.stdout + r.stderr, r.stderr[-3000:]


def test_a_broken_tokenizer_config_beside_the_tokenizer_is_one_line(corpus, tmp_path):
    """The folder's tokenizer_config.json / special_tokens_map.json name the special tokens' roles: one that was not
    JSON was passed over (the roles it names silently lost: other special ids), one that is JSON but no object was an
    AttributeError traceback. Now each is one line naming the file; a well-formed one is read."""
    import shutil

    from megahash.tokenization import TokenizerError, load_tokenizer

    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        for body, expect in ((b"{not json", "cannot read"), (b"[1, 2]", "not a JSON object"), (b"\xff\xfe", "cannot")):
            folder = tmp_path / f"{name}-{len(body)}-{expect[:3]}"
            folder.mkdir()
            shutil.copy(corpus["bpe"], folder / "tokenizer.json")
            (folder / name).write_bytes(body)
            for spec in (folder, folder / "tokenizer.json"):
                with pytest.raises(TokenizerError, match=expect) as e:
                    load_tokenizer(str(spec))
                assert name in str(e.value) and "\n" not in str(e.value)
            (folder / name).write_text(json.dumps({"eos_token": "<|padding|>"}))
            assert load_tokenizer(str(folder)).special_ids["eos"] == load_tokenizer(str(folder)).special_ids["pad"]
