"""Objectives (CLM, MLM, Shuffle+Random) and heads (vocab, S+R, hash-bits, hash-bucket) on real words."""

from __future__ import annotations

import os
import sys
import warnings

os.environ.setdefault("OMP_NUM_THREADS", "1")
warnings.filterwarnings("ignore")

import _emb_helpers as H
import numpy as np
import pytest
import torch
import torch.nn.functional as F

torch.set_num_threads(1)


pytestmark = pytest.mark.usefixtures("dist")  # one-rank world (conftest)


def corpus_batches(n=60, b=8, s=64, spec="md5"):
    """Word-id tokens (<s> first, some rows padded at the end) with their codes; specials have zero codes."""
    out = []
    for tok, codes in H.word_batches(spec, b, s, n, vocab_size=2000):
        tok, codes = tok.clone(), codes.clone()
        tok[1, -7:] = 1  # <pad>
        tok[2, 20] = 2  # </s> inside
        codes[tok < 5] = 0
        out.append((tok, codes))
    return out


def pair_map(tokens, codes):
    return {int(t): tuple(c.tolist()) for t, c in zip(tokens.reshape(-1), codes.reshape(-1, codes.shape[-1])) if t >= 5}


def assert_codes_follow_tokens(ref_map, tokens, codes):
    for t, c in zip(tokens.reshape(-1), codes.reshape(-1, codes.shape[-1])):
        t = int(t)
        if t >= 5:
            assert tuple(c.tolist()) == ref_map[t]
        else:
            assert not c.any()


# ------------------------------------------------------------------------------ CLM


def test_clm_shift():
    from megahash.objectives import clm

    tok, codes = corpus_batches(1)[0]
    out = clm.corrupt(tok, codes)
    assert torch.equal(out["tokens"], tok[:, :-1]) and torch.equal(
        out["labels"], tok[:, 1:]
    )  # bit-exact: ids, codes, 0/1 masks
    assert torch.equal(out["hash_codes"], codes[:, :-1]) and torch.equal(
        out["label_codes"], codes[:, 1:]
    )  # bit-exact: ids, codes, 0/1 masks
    assert torch.equal(out["loss_mask"], (tok[:, 1:] != 1).float())  # bit-exact: ids, codes, 0/1 masks


def test_clm_masks_the_tokenizers_pad_not_id_1():
    """With the special ids of a tokenizer whose specials are not 0-4, id 1 is an ordinary piece (it lost its loss)
    and the pad is the tokenizer's; a tokenizer without a pad (GPT-2's) masks nothing."""
    from megahash.objectives import clm

    tok = torch.tensor([[5, 1, 1, 7, 900, 901, 1]])
    bpe = {"bos": None, "pad": 901, "eos": 900, "unk": None, "mask": None}
    labels = tok[:, 1:]
    want = [0.0 if int(t) == 901 else 1.0 for t in labels[0]]
    assert clm.corrupt(tok, special_ids=bpe)["loss_mask"][0].tolist() == want
    gpt2 = {"bos": 900, "pad": None, "eos": 900, "unk": 900, "mask": None}
    assert clm.corrupt(tok, special_ids=gpt2)["loss_mask"][0].tolist() == [1.0] * labels.shape[1]
    assert clm.corrupt(tok)["loss_mask"][0].tolist() == [0.0 if int(t) == 1 else 1.0 for t in labels[0]]  # word ids


# ------------------------------------------------------------------------------ MLM


def test_mlm_rates_specials_and_codes():
    from megahash.objectives import mlm

    gen = torch.Generator().manual_seed(1)
    n_word = n_sel = n_mask = n_rand = n_keep = 0
    for tok, codes in corpus_batches():
        out = mlm.corrupt(tok, codes, gen)
        word = tok >= 5
        sel = out["labels"] != -100
        assert not (sel & ~word).any()  # specials never selected
        assert torch.equal(out["tokens"][~word], tok[~word]) and torch.equal(
            out["hash_codes"][~word], codes[~word]
        )  # bit-exact: ids, codes, 0/1 masks
        assert torch.equal(out["labels"][sel], tok[sel]) and torch.equal(
            out["loss_mask"], sel.float()
        )  # bit-exact: ids, codes, 0/1 masks
        assert torch.equal(out["tokens"][~sel], tok[~sel])  # bit-exact: ids, codes, 0/1 masks
        assert torch.equal(out["label_codes"], codes) and torch.equal(
            out["padding_mask"], tok != 1
        )  # bit-exact: ids, codes, 0/1 masks
        masked = sel & (out["tokens"] == 4)
        assert not out["hash_codes"][masked].any()  # <mask> has the zero codes of a special
        changed = sel & (out["tokens"] != 4) & (out["tokens"] != tok)
        batch_words = set(tok[word].tolist())
        assert set(out["tokens"][changed].tolist()) <= batch_words  # random words: the batch's own
        assert_codes_follow_tokens(pair_map(tok, codes), out["tokens"], out["hash_codes"])
        n_word += int(word.sum())
        n_sel += int(sel.sum())
        n_mask += int(masked.sum())
        n_rand += int(changed.sum())
        n_keep += int((sel & (out["tokens"] == tok)).sum())
    assert abs(n_sel / n_word - 0.15) < 0.01
    assert abs(n_mask / n_sel - 0.8) < 0.02
    assert abs(n_rand / n_sel - 0.1) < 0.02  # a random word equal to the original counts as kept
    assert abs(n_keep / n_sel - 0.1) < 0.025


# ------------------------------------------------------------------------------ Shuffle+Random


def test_shuffle_random_rates_specials_and_codes():
    from megahash.objectives import shuffle_random as sr

    gen = torch.Generator().manual_seed(2)
    n_word = n_shuf = n_rand = 0
    for tok, codes in corpus_batches():
        out = sr.corrupt(tok, codes, gen)
        lab, new = out["labels"], out["tokens"]
        word = tok >= 5
        assert torch.equal(lab == -100, ~word)  # bit-exact: ids, codes, 0/1 masks; specials: ignored ...
        assert torch.equal(new[~word], tok[~word]) and torch.equal(
            out["hash_codes"][~word], codes[~word]
        )  # bit-exact: ids, codes, 0/1 masks; ... untouched
        assert torch.equal(out["loss_mask"], word.float())  # bit-exact: ids, codes, 0/1 masks
        assert torch.equal(new[lab == 0], tok[lab == 0])  # bit-exact: ids, codes, 0/1 masks; originals stay
        for r in range(tok.shape[0]):  # shuffled: a permutation of the row's selected tokens
            pos = lab[r] == 1
            assert sorted(new[r][pos].tolist()) == sorted(tok[r][pos].tolist())
        assert set(new[lab == 2].tolist()) <= set(tok[word].tolist())  # random: the batch's own words
        assert_codes_follow_tokens(pair_map(tok, codes), new, out["hash_codes"])  # codes move with tokens
        n_word += int(word.sum())
        n_shuf += int((lab == 1).sum())
        n_rand += int((lab == 2).sum())
    assert abs(n_shuf / n_word - 0.10) < 0.01
    assert abs(n_rand / n_word - 0.09) < 0.01  # ~10% of the other 90%


def test_corruption_is_deterministic_in_the_generator():
    from megahash.objectives import mlm, shuffle_random

    tok, codes = corpus_batches(1)[0]
    for mod in (mlm, shuffle_random):
        a = mod.corrupt(tok, codes, torch.Generator().manual_seed(5))
        b = mod.corrupt(tok, codes, torch.Generator().manual_seed(5))
        c = mod.corrupt(tok, codes, torch.Generator().manual_seed(6))
        assert all(
            torch.equal(a[k], b[k]) for k in ("tokens", "hash_codes", "labels")
        )  # bit-exact: ids, codes, 0/1 masks
        assert not torch.equal(a["labels"], c["labels"])  # bit-exact: ids, codes, 0/1 masks
    out = shuffle_random.corrupt(tok, None, torch.Generator().manual_seed(5))  # codes are optional
    assert out["hash_codes"] is None and (out["labels"] == 1).any()


# ------------------------------------------------------------------------------ heads


def train(model, batches, objective, steps=40, lr=3e-3, seed=0):
    from megahash.objectives import clm, mlm, shuffle_random

    mod = {"clm": clm, "mlm": mlm, "sr": shuffle_random}[objective]
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(seed)
    losses = []
    for step in range(steps):
        tok, codes = batches[step % len(batches)]
        b = mod.corrupt(tok, codes, gen)
        per = model(
            b["tokens"],
            b["hash_codes"],
            labels=b["labels"],
            padding_mask=b.get("padding_mask"),
            label_codes=b.get("label_codes"),
        )
        loss = (per * b["loss_mask"]).sum() / b["loss_mask"].sum().clamp(min=1)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss))
    return losses


def test_shuffle_random_head_learns():
    from megahash.accelerator import rng
    from megahash.models.megatron_model import build_model

    cfg = H.tiny_cfg("proj", ["model.arch=encoder", "train.objective=sr", "model.embed.hash_spec=lsh128"], seq=64)
    rng.seed_all(0)
    model = build_model(cfg, 128)
    assert model.output_layer is None and model.head.linear.out_features == 3
    losses = train(model, corpus_batches(4, spec="lsh128"), "sr", steps=40)
    assert abs(losses[0] - 1.0986) < 0.2  # ~log 3 at init
    assert sum(losses[-5:]) / 5 < 0.75


def test_vocab_mlm_head_ignores_unlabelled_positions():
    from megahash.accelerator import rng
    from megahash.models.megatron_model import build_model
    from megahash.objectives import mlm

    cfg = H.tiny_cfg("add", ["model.arch=encoder", "train.objective=mlm"], seq=64)
    rng.seed_all(0)
    model = build_model(cfg, 2000)
    tok, codes = corpus_batches(1)[0]
    b = mlm.corrupt(tok, codes, torch.Generator().manual_seed(0))
    per = model(b["tokens"], b["hash_codes"], labels=b["labels"], padding_mask=b["padding_mask"])
    assert torch.equal(
        per == 0, b["labels"] == -100
    )  # bit-exact: boolean masks (ignored positions: a loss of exactly 0)


@pytest.mark.parametrize("head,spec", [("hash-bits", "md5"), ("hash-bucket", "md5-bucket512")])
def test_hash_head_decoder_learns_and_scores_continuations(head, spec):
    from megahash.accelerator import rng
    from megahash.models.heads import score_continuation
    from megahash.models.megatron_model import build_model

    kind = "proj" if head == "hash-bits" else "hash-emb"
    cfg = H.tiny_cfg(kind, [f"model.head={head}", f"model.embed.hash_spec={spec}"], seq=32)
    rng.seed_all(0)
    model = build_model(cfg, 128)  # the token vocabulary only covers the specials: vocabulary-free
    assert model.output_layer is None
    batches = [(torch.where(t >= 5, 5, t), c) for t, c in H.word_batches(spec, 8, 33, 2)]
    losses = train(model, batches, "clm", steps=60, lr=5e-3)
    assert sum(losses[-5:]) / 5 < 0.6 * losses[0]

    model.eval()
    tok, codes = batches[0]
    ctx, cont, wrong = codes[0, 1:11], codes[0, 11:14], codes[3, 20:23]
    ll_true = score_continuation(model, ctx, cont)
    assert ll_true > score_continuation(model, ctx, wrong)
    assert ll_true > score_continuation(model, ctx, cont.flip(0))

    # the documented formula, by hand
    with torch.no_grad():
        inp = torch.cat([ctx, cont[:-1]]).unsqueeze(0)
        logits = model(torch.full(inp.shape[:2], 5), inp)[0, 9:12].double()  # predictions of cont
    if head == "hash-bits":
        bits = torch.from_numpy(np.unpackbits(cont.numpy(), axis=-1)).double()
        manual = F.logsigmoid(torch.where(bits > 0, logits, -logits)).sum()
    else:
        manual = torch.log_softmax(logits, dim=-1).gather(1, cont.long()).sum()
    assert abs(ll_true - float(manual)) < 1e-3
    batched = score_continuation(model, codes[:2, 1:11], codes[:2, 11:14])
    assert abs(float(batched[0]) - ll_true) < 1e-4
    assert score_continuation(model, codes[0, :0], cont) < 0  # empty context -> <s>


def test_head_config_errors():
    from megahash.errors import ConfigError
    from megahash.models.megatron_model import MegahashLM

    with pytest.raises(ConfigError, match="model.head"):
        MegahashLM(H.tiny_cfg("proj", ["train.objective=sr", "model.head=hash-bits"], seq=16), 128)
    with pytest.raises(ConfigError, match="bit codes"):
        MegahashLM(H.tiny_cfg("hash-emb", ["model.head=hash-bits"], seq=16), 128)
    with pytest.raises(ConfigError, match="model.head must be"):
        MegahashLM(H.tiny_cfg("proj", ["model.head=bits"], seq=16), 128)
    with pytest.raises(ConfigError, match="num_bits"):
        MegahashLM(H.tiny_cfg("proj", ["model.embed.hash_spec=lsh64"], seq=16), 128)


def test_the_worked_objective_of_the_architecture_page_trains(shakespeare_shards, tmp_path, capsys, monkeypatch):
    """docs/architecture.md "add an objective": its file, imported as written, registers ``clm-wdrop``; the
    corruption drops ordinary words only (specials kept, rate P_DROP within 4 binomial sigmas), leaves the labels
    and follows its generator; two DeepSpeed steps train with it and log finite losses."""
    import importlib.util
    import math

    from test_batch_ramp import _main, _records

    from conftest import TINIER, doc_block
    from megahash import objective_spec
    from megahash.objectives import Objective

    path = tmp_path / "word_dropout.py"
    path.write_text(doc_block("docs/architecture.md", "## Worked example: add an objective"))
    spec = importlib.util.spec_from_file_location("megahash_example_word_dropout", path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)
    spec.loader.exec_module(module)
    try:
        assert objective_spec.objective_spec("clm-wdrop").next_token and "clm-wdrop" in objective_spec.names()
        tokens, codes = corpus_batches(n=1, b=8, s=512)[0]
        obj = Objective("clm-wdrop", seed=0)
        obj.set_step(0, 0)
        labels = torch.roll(tokens, -1, 1)
        out = obj.prepare({"tokens": tokens, "hash_codes": codes, "labels": labels})
        dropped = out["tokens"] != tokens
        words = int((tokens >= 5).sum())
        assert torch.equal(out["labels"], labels)  # bit-exact: integer labels pass through untouched
        assert not dropped[tokens < 5].any() and (out["tokens"][dropped] == module.UNK_ID).all()
        assert (out["hash_codes"][dropped] == 0).all() and torch.equal(
            out["hash_codes"][~dropped], codes[~dropped]
        )  # bit-exact: integer codes
        sigma = math.sqrt(words * module.P_DROP * (1 - module.P_DROP))
        assert abs(int(dropped.sum()) - words * module.P_DROP) < 4 * sigma
        obj.set_step(0, 0)
        assert torch.equal(
            obj.prepare({"tokens": tokens, "labels": labels})["tokens"], out["tokens"]
        )  # bit-exact: same generator seed, same draws
        run = tmp_path / "run"
        status, log = _main(
            [
                f"data.prefix=[{shakespeare_shards['prefix']}]",
                f"data.tokenizer={shakespeare_shards['tokenizer']}",
                *TINIER,
                "train.objective=clm-wdrop",
                "train.steps=2",
                f"train.save_dir={run}",
            ],
            capsys,
        )
        assert status == 0, log[-3000:]
        losses = [r["loss"] for r in _records(run).values()]
        assert len(losses) == 2 and all(math.isfinite(x) for x in losses)
    finally:
        objective_spec.unregister("clm-wdrop")
