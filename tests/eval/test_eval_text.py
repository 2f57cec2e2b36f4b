"""Evaluation tokenises and hashes raw text exactly as the data stage did (subword and word
streams, MD5 and LSH codes), and the lm-eval model scores hash-embedding models and the hashed-word
decoder (hash-code head, through heads.score_continuation)."""

import math
import os
import sys

import numpy as np
import pytest
import torch

from conftest import run

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _cfg(prefix, tokenizer, *extra):
    from megahash.config import load_config

    return load_config(
        None,
        [
            f"data.prefix=[{prefix}]",
            f"data.tokenizer={tokenizer}",
            "model.hidden_size=32",
            "model.num_layers=2",
            "model.num_heads=4",
            "model.ffn_hidden_size=64",
            "data.seq_length=64",
            "model.max_position_embeddings=128",
            *extra,
        ],
    )


def _doc(i):
    from megahash.data.preprocess.sources import open_source, select_documents

    return next(iter(select_documents(open_source("shakespeare"), i, i + 1)))


@pytest.mark.parametrize("spec", ["md5", "lsh128"])
def test_subword_codes_equal_the_side_shards(shakespeare_shards, spec):
    from megahash.data.shards import ShardSet
    from megahash.eval.text import Encoded, load_codec

    cfg = _cfg(
        shakespeare_shards["prefix"],
        shakespeare_shards["tokenizer"],
        "model.embedding=add",
        f"model.embed.hash_spec={spec}",
    )
    codec = load_codec(cfg)
    shards = ShardSet.open(shakespeare_shards["prefix"])
    for doc in (0, 3):
        ids = np.asarray(shards.tokens.get(doc), dtype=np.int64)
        assert codec.encode(_doc(doc)).ids == ids[:-1].tolist()  # the shard appends </s>
        got = codec.codes(Encoded(ids.tolist()))
        assert np.array_equal(got, shards.hash_codes(spec, doc)), (spec, doc)  # bit-exact: integer codes
    assert codec.description["hash_unit"] == "word"


def test_lsh_planes_of_another_build_are_refused(shakespeare_shards, tmp_path):
    """Evaluation (and the export, through the same codec) hashes text with the set's ``_lsh.npz``; one of another
    build under that name (the prefix preprocessed again from another corpus, a file copied over) was loaded as it
    was, every word getting other codes than the side shards the model trained on, with no error. Now the file is
    checked against the size and sha256 the meta records for it: one line naming it and the fix."""
    import shutil
    from collections import Counter

    from megahash.data.shards import ShardSet
    from megahash.errors import DataError
    from megahash.eval.text import Encoded, load_codec
    from megahash.hashing.lsh import LSHModel

    src = shakespeare_shards["prefix"]
    for f in os.listdir(os.path.dirname(src)):
        if f.startswith(os.path.basename(src) + "_"):
            shutil.copy(os.path.join(os.path.dirname(src), f), tmp_path / f)
    prefix = str(tmp_path / os.path.basename(src))
    cfg = _cfg(prefix, shakespeare_shards["tokenizer"], "model.embedding=add", "model.embed.hash_spec=lsh128")
    shards = ShardSet.open(prefix)
    ids, codes = np.asarray(shards.tokens.get(0), dtype=np.int64), shards.hash_codes("lsh128", 0)
    assert np.array_equal(load_codec(cfg).codes(Encoded(ids.tolist())), codes)  # bit-exact: integer codes
    other = LSHModel.from_word_counts(Counter("another corpus with other words and other n-grams".split()), 64)
    other.save(tmp_path / f"{os.path.basename(src)}_lsh.npz", bits=[128])
    with pytest.raises(DataError, match=r"_lsh\.npz has \d+ bytes, the meta says \d+.*preprocess_data\.py"):
        load_codec(cfg)


@pytest.fixture(scope="module")
def word_shards(tmp_path_factory):
    d = tmp_path_factory.mktemp("words")
    r = run(
        [
            sys.executable,
            "data_tools/preprocess_data.py",
            "--input",
            "shakespeare",
            "--output-prefix",
            str(d / "w"),
            "--tokenizer",
            "words",
            "--word-hashes",
            "md5,md5-bucket997",
            "--max-docs",
            "30",
            "--quiet",
        ]
    )
    assert r.returncode == 0, r.stderr[-2000:]
    return str(d / "w")


def test_word_stream_ids_and_codes_equal_the_shards(word_shards):
    from megahash.data.shards import ShardSet
    from megahash.eval.text import UNK_ID, load_codec

    cfg = _cfg(word_shards, "words", "model.embedding=hash-emb", "model.embed.hash_spec=md5-bucket997")
    codec = load_codec(cfg)
    shards = ShardSet.open(word_shards)
    ids = np.asarray(shards.tokens.get(2), dtype=np.int64)
    enc = codec.encode(_doc(2))
    assert enc.ids == ids[:-1].tolist()
    assert np.array_equal(codec.codes(enc), shards.hash_codes("md5-bucket997", 2)[:-1])  # bit-exact: integer codes
    unseen = codec.encode("zyzzyvas quokka")
    assert unseen.ids == [UNK_ID, UNK_ID] and (codec.codes(unseen) != 0).all()  # hashed as themselves
    table = shards.word_table()
    assert codec.decode(ids[:5].tolist()) == " ".join(table[i] for i in ids[:5])


def _req(kind, *args):
    from lm_eval.api.instance import Instance

    return Instance(request_type=kind, doc={}, arguments=tuple(args), idx=0)


@pytest.mark.parametrize(
    "head, emb, spec",
    [("vocab", "add", "md5"), ("hash-bits", "add", "md5"), ("hash-bucket", "hash-emb", "md5-bucket997")],
)
def test_hash_models_are_scored_through_their_codes(dist, word_shards, head, emb, spec):
    """Word stream + hash embedding, with the vocabulary head or a hash-code head (the hashed-word
    decoder): loglikelihood equals the head's own per-token loss on the codes; greedy generation
    picks words of the word table."""
    from megahash.accelerator import rng
    from megahash.eval.lm import MegahashEvalLM
    from megahash.eval.text import load_codec
    from megahash.models.megatron_model import build_model

    cfg = _cfg(word_shards, "words", f"model.embedding={emb}", f"model.embed.hash_spec={spec}", f"model.head={head}")
    codec = load_codec(cfg)
    rng.seed_all(3)
    model = build_model(cfg, codec.vocab_size).eval()
    lm = MegahashEvalLM.from_model(cfg, model, codec, batch_size=2)
    ctx, cont = "Now is the winter of our", " discontent made glorious"
    (ll, greedy), (ll2, _) = lm.loglikelihood(
        [_req("loglikelihood", ctx, cont), _req("loglikelihood", ctx, " zyzzyva quokka")]
    )
    enc = codec.encode(ctx + cont)
    n = len(codec.encode(cont).ids)
    ids = torch.tensor([enc.ids])
    codes = torch.from_numpy(codec.codes(enc))[None]
    with torch.no_grad():
        if head == "vocab":  # log-probabilities over the real vocabulary (TP padding columns dropped)
            logp = model(ids[:, :-1], hash_codes=codes[:, :-1])[0, :, : codec.vocab_size].log_softmax(-1)
            ref = sum(float(logp[t - 1, enc.ids[t]]) for t in range(len(enc.ids) - n, len(enc.ids)))
        else:  # the head's loss is -log p(code of the next word)
            loss = model(ids[:, :-1], hash_codes=codes[:, :-1], labels=ids[:, 1:], label_codes=codes[:, 1:])
            ref = -float(loss[0, -n:].sum())
    assert ll == pytest.approx(ref, abs=1e-4)
    assert ll2 < 0 and ll != ll2  # unseen words still get distinct codes
    (rolling,) = lm.loglikelihood_rolling([_req("loglikelihood_rolling", ctx + cont)])
    ((whole, _),) = lm.loglikelihood([_req("loglikelihood", "", ctx + cont)])
    assert rolling == pytest.approx(whole, abs=1e-4)
    out = lm.generate_until([_req("generate_until", ctx, {"until": ["\n"], "max_gen_toks": 3})])
    assert isinstance(out[0], str) and len(out[0].split()) <= 3
    assert all(w in codec.word_index for w in out[0].split())
    from megahash.eval.bits_per_byte import static_lines, text_metrics

    metrics = text_metrics(lm, [ctx + cont])  # megahash eval --text
    assert metrics["loss"] == pytest.approx(-rolling / len(enc), rel=1e-6)
    if head == "vocab":
        assert metrics["bpb"] > 0 and metrics["ppl"] == pytest.approx(math.exp(metrics["loss"]))
    else:  # the head scores hash codes, not the text: a loss, no perplexity or bits per byte (docs/eval.md)
        assert "bpb" not in metrics and "ppl" not in metrics and "bpb" not in static_lines("src", metrics, 16)
