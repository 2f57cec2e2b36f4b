"""Shuffle+Random random replacements as the authors' collators define them (HUIYINXUE/hashformer,
src/model/data_collator.py): random bit arrays of random density (Proj/Add), uniform codeword ids
(Pool), random buckets (Emb), random vocabulary ids (vocab); never equal to the original."""

from __future__ import annotations

import _emb_helpers as H
import numpy as np
import pytest
import torch

from megahash.config import load_config


def batches(spec="md5", n=12, b=8, s=64):
    out = []
    for tok, codes in H.word_batches(spec, b, s, n, vocab_size=2000):
        tok, codes = tok.clone(), codes.clone()
        tok[1, -7:] = 1  # <pad>
        codes[tok < 5] = 0
        out.append((tok, codes))
    return out


def unpack(codes: torch.Tensor, bits: int) -> np.ndarray:
    return np.unpackbits(codes.numpy().astype(np.uint8), axis=-1)[..., :bits]


def run(mode, spec="md5", **kw):
    from megahash.objectives import shuffle_random as sr

    gen = torch.Generator().manual_seed(0)
    for tok, codes in batches(spec):
        out = sr.corrupt(tok, codes, gen, random=mode, **kw)
        lab = out["labels"]
        rnd = lab == 2
        assert torch.equal(lab == -100, tok < 5)  # bit-exact: ids, codes, masks; specials ignored and untouched
        assert torch.equal(out["tokens"][tok < 5], tok[tok < 5])  # bit-exact: ids, codes, masks
        assert torch.equal(out["tokens"][lab == 0], tok[lab == 0]) and torch.equal(
            out["hash_codes"][lab == 0], codes[lab == 0]
        )  # bit-exact: ids, codes, masks
        yield tok, codes, out, rnd


@pytest.mark.parametrize("mode", ["bits-density", "bits-uniform"])
def test_random_bit_arrays(mode):
    """Proj/Add: per token a density p ~ U(0, 1), bits ~ Bernoulli(p): the fraction of ones per
    token is spread like U(0, 1) (std ~0.29); Pool: uniform codeword ids = uniform bits (std of the
    fraction sqrt(1/4/128) ~ 0.044). Never the original code; the token id stays."""
    fractions = []
    for tok, codes, out, rnd in run(mode, num_bits=128):
        assert rnd.any()
        new, old = out["hash_codes"][rnd], codes[rnd]
        assert not (new == old).all(-1).any()  # never identical
        assert torch.equal(out["tokens"][rnd], tok[rnd])  # bit-exact: ids, codes, masks; the collators keep input_ids
        fractions += unpack(new, 128).mean(-1).tolist()
    f = np.array(fractions)
    assert abs(f.mean() - 0.5) < 0.03
    if mode == "bits-density":
        assert 0.25 < f.std() < 0.33 and (f < 0.1).mean() > 0.05 and (f > 0.9).mean() > 0.05
    else:
        assert f.std() < 0.06


def test_random_buckets_and_token_ids():
    """Emb: a uniform bucket of the N other than the original; vocab: a uniform ordinary id."""
    seen = []
    for _, codes, out, rnd in run("bucket", spec="md5-bucket7", num_buckets=7):
        new, old = out["hash_codes"][rnd][:, 0], codes[rnd][:, 0]
        assert ((0 <= new) & (new < 7) & (new != old)).all()
        seen += new.tolist()
    counts = np.bincount(seen, minlength=7) / len(seen)
    assert np.abs(counts - 1 / 7).max() < 0.04
    for tok, _, out, rnd in run("token", vocab_size=2000):
        new = out["tokens"][rnd]
        assert ((new >= 5) & (new < 2000) & (new != tok[rnd])).all()


def test_never_identical_with_few_bits():
    """With T = 2 bits (4 codes) a fresh draw often equals the original: it is redrawn."""
    from megahash.objectives.shuffle_random import random_bits

    orig = torch.tensor([[0b01000000]] * 500 + [[0b11000000]] * 500, dtype=torch.uint8)
    for density in (True, False):
        new = random_bits(orig, 2, density, torch.Generator().manual_seed(1))
        assert not (new == orig).all(-1).any()
        assert set(new[:, 0].tolist()) <= {0b00000000, 0b01000000, 0b10000000, 0b11000000}


@pytest.mark.parametrize(
    "overrides,want",
    [
        (["model.embedding=proj", "model.embed.hash_spec=lsh128"], {"random": "bits-density", "num_bits": 128}),
        (["model.embedding=add"], {"random": "bits-density", "num_bits": 128}),
        (["model.embedding=pool"], {"random": "bits-uniform", "num_bits": 128}),
        (
            ["model.embedding=hash-emb", "model.embed.hash_spec=md5-bucket1038"],
            {"random": "bucket", "num_buckets": 1038},
        ),
        (["model.embedding=vocab"], {"random": "token", "vocab_size": 4000}),
        (["model.embedding=rolling", "model.embed.hash_spec=rolling3"], {"random": "batch"}),
        (["model.embedding=proj", "train.sr_random=batch"], {"random": "batch"}),
    ],
)
def test_default_is_the_collators_and_batch_stays_an_option(overrides, want):
    from megahash.objectives import build_objective

    cfg = load_config(None, ["train.objective=sr", *overrides])
    assert build_objective(cfg, type("D", (), {"vocab_size": 4000})()).options == want
