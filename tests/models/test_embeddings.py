"""Hash embeddings ([Xue25] ch. 2, [Cohn23], [NeuML25]): parameter counts against the papers, the equations
themselves, special tokens, unseen words, LSH locality, TP/SP parity, and a short training run."""

from __future__ import annotations

import hashlib
import hmac
import math
import os
import warnings

os.environ.setdefault("OMP_NUM_THREADS", "1")
warnings.filterwarnings("ignore")

import _emb_helpers as H
import numpy as np
import pytest
import torch

from megahash.launching.env import free_port

torch.set_num_threads(1)


pytestmark = [pytest.mark.usefixtures("dist"), pytest.mark.numerics]  # one-rank world (conftest)


def build_emb(kind, overrides=(), vocab=50304, hidden=768, seed=0):
    from megatron.core.utils import init_method_normal

    from megahash.config import load_config
    from megahash.models import registry
    from megahash.models.megatron_model import transformer_config

    cfg = load_config(
        None,
        [
            f"model.hidden_size={hidden}",
            f"model.num_heads={12 if hidden % 12 == 0 else 4}",
            f"model.embedding={kind}",
            *overrides,
        ],
    )
    config = transformer_config(cfg)
    config.init_method = init_method_normal(cfg.model.init_std)
    registry.load_kinds()
    torch.manual_seed(seed)
    return registry.spec("embedding", kind).build(config, cfg, vocab)


def words_to_batch(words, spec):
    codes = torch.from_numpy(H.codes_for(words, spec)).view(1, len(words), -1)
    tokens = torch.full((1, len(words)), 5, dtype=torch.long)
    return tokens, codes


def embed(emb, words, spec):
    tokens, codes = words_to_batch(words, spec)
    with torch.no_grad():
        return emb(tokens, codes)[:, 0].double()  # [n, h]


# ------------------------------------------------------------------------------ parameter counts

D, T, K = 768, 128, 10


def kilo(n):
    return f"{n / 1000:.1f}K"


@pytest.mark.parametrize(
    "kind,overrides,paper,table",
    [
        ("proj", ["model.embed.hash_spec=lsh128"], T * D, "99.1K"),  # eq. 2.15
        ("add", ["model.embed.hash_spec=md5"], 2 * T * D, "197.4K"),  # eq. 2.14
        (
            "pool",
            ["model.embed.hash_spec=md5", "model.embed.options.pool_bits=10"],
            (math.ceil(T / K) + 2**K) * D,
            "797.2K",
        ),  # eq. 2.13
    ],
)
def test_compressed_counts_match_eq_and_table_2_2(kind, overrides, paper, table):
    from megahash.models.embeddings import embedding_param_report

    emb = build_emb(kind, overrides)
    assert paper in (98_304, 196_608, 796_416)
    rep = embedding_param_report(emb)
    # the equation's parameters ...
    assert sum(p.numel() for n, p in emb.named_parameters() if n not in ("special", "word_row")) == paper
    # ... plus the one h-wide row every ordinary word adds (row 5 of the reference's 6-row special
    # table; [Xue25] sec. 2.8 counts it and excludes the 5 special rows): Table 2.2 exactly
    assert rep == {"embedding": paper + D, "special": 5 * D}
    assert kilo(rep["embedding"]) == table


@pytest.mark.parametrize(
    "spec,overrides,n",
    [
        ("md5-bucket50000", [], 50_000),
        ("lsh-bucket1000", [], 1000),
        ("md5", ["model.embed.num_buckets=1000"], 1000),
    ],
)
def test_hash_emb_count_is_N_times_d(spec, overrides, n):
    from megahash.models.embeddings import embedding_param_report

    emb = build_emb("hash-emb", [f"model.embed.hash_spec={spec}", *overrides])
    assert embedding_param_report(emb) == {"embedding": n * D, "special": 5 * D}  # eq. 2.12


def test_bert_hash_count_is_seed_002():
    from megahash.models.embeddings import embedding_param_report

    emb = build_emb("bert-hash", ["model.embed.options.projections=5"], vocab=30_522)
    assert embedding_param_report(emb)["embedding"] == 30_522 * 5 + 5 * 768 == 156_450


def test_rolling_has_no_table_and_vocab_report():
    from megahash.models.embeddings import embedding_param_report
    from megahash.models.megatron_model import MegahashLM

    lin = build_emb("rolling", ["model.embed.hash_spec=rolling3"])
    assert embedding_param_report(lin) == {"embedding": D * D, "special": 5 * D}  # only Linear(d -> h)
    nolin = build_emb("rolling", ["model.embed.hash_spec=rolling3", "model.embed.options.rolling_linear=false"])
    assert embedding_param_report(nolin) == {"embedding": 0, "special": 5 * D}
    cfg = H.tiny_cfg("vocab", seq=16)
    assert embedding_param_report(MegahashLM(cfg, 256)) == {"embedding": 256 * 64, "special": 0}


def test_bert_base_config_builds_with_every_embedding():
    from megahash.config import load_config
    from megahash.models.embeddings import embedding_param_report
    from megahash.models.megatron_model import build_model

    for kind, (spec, more) in H.KINDS.items():
        cfg = load_config(
            None,
            [
                "model.size=bert-base",
                f"model.embedding={kind}",
                f"model.embed.hash_spec={spec}",
                *[m for m in more if "rolling_dim" not in m],
                "train.objective=sr",
            ],
        )
        m = cfg.model
        assert (m.arch, m.num_layers, m.hidden_size, m.num_heads, m.ffn_hidden_size, m.max_position_embeddings) == (
            "encoder",
            12,
            768,
            12,
            3072,
            512,
        )
        with torch.device("meta"):
            model = build_model(cfg, 30_522, init=False)
        assert model.output_layer is None and model.head.linear.out_features == 3
        assert embedding_param_report(model)["special"] == (0 if kind == "vocab" else 5 * 768)


# ------------------------------------------------------------------------------ the equations


def random_codes(n, width, seed=0):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (1, n, width), generator=g, dtype=torch.uint8)
    codes[0, 0] = 0  # constant bit vectors: no correlation
    codes[0, 1] = 255
    return codes


def bits_of(codes):
    return torch.from_numpy(np.unpackbits(codes.numpy(), axis=-1)).double()[0]  # [n, T]


def test_proj_is_pearson_eq_2_3():
    emb = build_emb("proj", ["model.embed.hash_spec=md5"], hidden=32)
    with torch.no_grad():
        emb.word_row.normal_()
    codes = random_codes(40, 16)
    out = emb(torch.full((1, 40), 7), codes)[:, 0].double()
    tau = bits_of(codes)
    w = emb.weight.detach().double()  # [d, T]
    tc = tau - tau.mean(1, keepdim=True)
    wc = w - w.mean(1, keepdim=True)
    num = tc @ wc.t()
    den = tc.norm(dim=1, keepdim=True) * wc.norm(dim=1)[None]
    pcc = torch.where(den > 0, num / den.clamp_min(1e-300), torch.zeros_like(num))
    expect = pcc + emb.word_row.detach().double()
    assert torch.allclose(out, expect, atol=1e-5)
    assert pcc[2:].abs().max() <= 1 + 1e-9 and torch.allclose(pcc[:2], torch.zeros_like(pcc[:2]))


def test_add_is_eq_2_2():
    emb = build_emb("add", ["model.embed.hash_spec=lsh64", "model.embed.num_bits=64"], hidden=32)
    codes = random_codes(30, 8)
    out = emb(torch.full((1, 30), 9), codes)[:, 0].double()
    tau = bits_of(codes).long()
    b = emb.codebooks.detach().double()  # [T, 2, d]
    expect = torch.stack([sum(b[j, tau[n, j]] for j in range(64)) / math.sqrt(64) for n in range(30)])
    assert torch.allclose(out, expect + emb.word_row.detach().double(), atol=1e-6)


def test_pool_is_eq_2_1():
    emb = build_emb("pool", ["model.embed.hash_spec=md5", "model.embed.options.pool_bits=10"], hidden=32)
    codes = random_codes(25, 16)
    out = emb(torch.full((1, 25), 5), codes)[:, 0].double()
    b, w = emb.codebook.detach().double(), emb.chunk_logits.detach().double()
    w_hat = torch.softmax(w, dim=0)  # (2.1a)
    expect = []
    for row in codes[0].numpy():
        bits = "".join(format(int(x), "08b") for x in row)  # MSB first, as the reference parses it
        chunks = [int(bits[i : i + 10], 2) for i in range(0, 128, 10)]  # 12 x 10 bits + 8 bits
        assert len(chunks) == 13 and chunks[-1] < 256
        expect.append(sum(b[c] * w_hat[i] for i, c in enumerate(chunks)))  # (2.1b)
    assert torch.allclose(out, torch.stack(expect), atol=1e-6)
    # bit-exact: integer chunk ids
    assert torch.equal(
        emb.codewords(codes[0]),
        torch.tensor(
            [
                [int("".join(format(int(x), "08b") for x in r)[i : i + 10], 2) for i in range(0, 128, 10)]
                for r in codes[0].numpy()
            ]
        ),
    )


def test_hash_emb_md5_modulo_equals_bucket_spec():
    words = H.corpus_words()[:300]
    a = build_emb("hash-emb", ["model.embed.hash_spec=md5-bucket997"], hidden=16, seed=3)
    b = build_emb("hash-emb", ["model.embed.hash_spec=md5", "model.embed.num_buckets=997"], hidden=16, seed=3)
    assert torch.equal(
        embed(a, words, "md5-bucket997"), embed(b, words, "md5")
    )  # bit-exact: row gathers (copied, not computed)
    ids = torch.from_numpy(H.codes_for(words, "md5-bucket997")[:, 0]).long()
    assert torch.equal(embed(a, words, "md5-bucket997"), a.weight.detach().double()[ids])  # bit-exact: a row gather


def test_rolling_matches_numpy_reference_and_seed_001_layout():
    from megahash.hashing.rolling import rolling_codes, rolling_embedding_from_codes

    emb = build_emb(
        "rolling", ["model.embed.hash_spec=rolling3", "model.embed.options.rolling_linear=false"], hidden=96
    )
    words = ["play", "plays", "played", "a", "of", "antidisestablishmentarianism", "naïve", "play"]
    out = embed(emb, words, "rolling3")
    ref = np.stack([rolling_embedding_from_codes(r, 96) for r in rolling_codes(words)])
    assert np.abs(out.numpy() - ref).max() < 1e-6
    assert out.abs().max() <= 1 and torch.equal(
        out[0], out[-1]
    )  # bit-exact: features computed once per distinct word, then copied
    assert torch.equal(
        out[3, 16:], torch.zeros(80, dtype=out.dtype)
    )  # bit-exact: exact zeros (nothing summed); "a": no 2-/3-grams -> zero partitions


# ------------------------------------------------------------------------------ specials, unseen words


@pytest.mark.parametrize("kind", list(H.KINDS))
def test_specials_use_their_own_rows(kind):
    """A hash embedding (one with a ``special`` table) gives the five specials their own rows whatever their
    codes; every embedding's rows ignore other positions' codes. (Before: every kind but ``vocab`` was
    assumed to have the table, so a new token-table embedding failed with AttributeError: 'special'.)"""
    cfg = H.tiny_cfg(kind, seq=16)
    from megahash.models.megatron_model import MegahashLM

    emb = MegahashLM(cfg, 256).embedding
    spec = H.KINDS[kind][0]
    tokens, codes = words_to_batch(["to", "be", "or", "not", "to", "be"], spec)
    tokens[0, [0, 3, 5]] = torch.tensor([0, 4, 2])
    garbage = codes.clone()
    garbage[0, [0, 3, 5]] = (torch.arange(codes.shape[-1], dtype=torch.int64) % 7 + 1).to(codes.dtype)  # any code
    out = emb(tokens, garbage)[:, 0]
    assert torch.equal(
        out[[1, 2, 4]], emb(tokens, codes)[:, 0][[1, 2, 4]]
    )  # bit-exact: one path (same call, same shapes): other rows' codes must not leak
    if not hasattr(emb, "special"):  # a token table (vocab, a factorised table): the specials are rows of it
        return
    assert torch.equal(out[[0, 3, 5]], emb.special.detach()[[0, 4, 2]])  # bit-exact: the special rows, copied
    emb.zero_grad()
    out[[1, 2, 4]].sum().backward()
    assert emb.special.grad.abs().sum() == 0  # ordinary words never touch the special table


@pytest.mark.parametrize(
    "kind,spec", [("hash-emb", "md5-bucket50000"), ("pool", "md5"), ("add", "md5"), ("proj", "md5")]
)
def test_unseen_word_gets_its_own_embedding(kind, spec):
    seen = sorted(set(H.corpus_words()))
    new = "megahashification"
    assert new not in seen
    digest = hmac.new(b"en", new.encode(), hashlib.md5).digest()  # HMAC-MD5, key "en" (DESIGN.md)
    assert bytes(H.codes_for([new], "md5")[0]) == digest
    emb = build_emb(kind, [f"model.embed.hash_spec={spec}"], hidden=64)
    e_new = embed(emb, [new], spec)[0]
    assert not torch.allclose(e_new, emb.special.detach().double()[3])  # not <unk>
    if kind == "hash-emb":  # Emb(N) is many-to-one by design: the word gets the row of its own bucket
        assert torch.equal(
            e_new, emb.weight.detach().double()[int.from_bytes(digest, "big") % 50_000]
        )  # bit-exact: a row gather
        return
    e_seen = embed(emb, seen[:3000], spec)
    assert (e_seen - e_new).abs().max(dim=1).values.min() > 1e-4  # distinct from every seen word


@pytest.mark.parametrize("kind", ["proj", "add"])
def test_lsh_keeps_morphological_neighbours_close_at_init(kind):
    emb = build_emb(kind, ["model.embed.hash_spec=lsh128"], hidden=256)
    e = embed(emb, ["play", "plays", "played", "the", "king", "sword", "night", "heaven", "o"], "lsh128")
    e = e / e.norm(dim=1, keepdim=True)
    cos = e @ e.t()
    for near in (1, 2):
        assert cos[0, near] > cos[0, 3:].max() + 0.05, cos[0]


def test_state_dict_roundtrip_every_embedding():
    from megahash.accelerator import rng
    from megahash.models.megatron_model import build_model

    for kind, (spec, _) in H.KINDS.items():
        cfg = H.tiny_cfg(kind, seq=16)
        models = []
        for seed in (0, 1):
            rng.seed_all(seed)
            models.append(build_model(cfg, 256))
        models[1].load_state_dict(models[0].state_dict())
        tok, codes = H.word_batches(spec, 2, 16, 1, vocab_size=200)[0]
        with torch.no_grad():
            assert torch.equal(models[0](tok, codes), models[1](tok, codes)), (
                kind
            )  # bit-exact: the same weights through the same path


# ------------------------------------------------------------------------------ TP / SP parity


@pytest.mark.multiprocess
def test_tp_sp_parity_every_embedding(tmp_path):
    """One 2-rank gloo launch: every embedding (and the S+R / hash heads) at TP=1, TP=2, TP=2+SP:
    same loss, same global gradients of the embedding and head parameters, and replicated
    parameters with identical gradients on both TP ranks."""
    import torch.multiprocessing as mp

    out = tmp_path / "parity.pt"
    mp.spawn(H.parity_worker, args=(2, free_port(), str(out)), nprocs=2, join=True)
    res = torch.load(out)
    for i, (kind, extra) in enumerate(H.PARITY_CASES):
        loss1, g1 = res[(i, 1, False)]
        for tp, sp in ((2, False), (2, True)):
            loss2, g2 = res[(i, tp, sp)]
            assert abs(loss1 - loss2) < 1e-4, (kind, extra, tp, sp, loss1, loss2)
            for name, g in g1.items():
                if name.endswith("@tp_spread"):
                    continue
                scale = float(g.abs().max()) + 1e-12
                assert float((g2[name] - g).abs().max()) / scale < 1e-4, (kind, extra, tp, sp, name)
                assert g2.get(name + "@tp_spread", 0.0) <= 1e-6 * scale, (kind, extra, tp, sp, name)


# ------------------------------------------------------------------------------ short training runs


@pytest.mark.parametrize("arch", ["decoder", "encoder"])
def test_every_embedding_learns(arch):
    """30 AdamW steps on 4 batches of Shakespeare words: decoder with CLM, encoder with MLM."""
    from megahash.accelerator import rng
    from megahash.models.megatron_model import build_model
    from megahash.objectives import clm, mlm

    obj = "clm" if arch == "decoder" else "mlm"
    seq = 33 if obj == "clm" else 32
    for kind in H.KINDS:
        cfg = H.tiny_cfg(kind, [f"model.arch={arch}", f"train.objective={obj}"], seq=32)
        rng.seed_all(0)
        model = build_model(cfg, 1000)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
        batches = H.word_batches(H.KINDS[kind][0], 8, seq, 4, vocab_size=1000)
        gen = torch.Generator().manual_seed(0)
        losses = []
        for step in range(30):
            tok, codes = batches[step % 4]
            b = clm.corrupt(tok, codes) if obj == "clm" else mlm.corrupt(tok, codes, gen)
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
        assert sum(losses[-4:]) / 4 < losses[0] - 1.0, (arch, kind, losses[0], losses[-4:])


@pytest.mark.parametrize("k", [10, 7, 16])
def test_pool_codewords_are_exact_under_bf16_autocast(k):
    """Pool's chunk integers came from a GEMM that bf16 autocast rounds to 8 significant bits: 46% of the 10-bit
    codewords were other codebook rows, and 1023 became 1024 (an index error in backward) in every bf16 run.
    They equal the integers read from the bit string, under autocast as without, in training's embedding and
    in the export's reference."""
    from types import SimpleNamespace

    from megahash.models.embeddings.base import bit_shifts
    from megahash.models.embeddings.pool import PoolEmbedding, PoolReference, chunk_weights
    from megahash.models.reference_ops import chunk_integers, unpack_code_bits

    g = torch.Generator().manual_seed(k)
    codes = torch.randint(0, 256, (2048, 16), generator=g, dtype=torch.uint8)
    codes[0] = 255  # every chunk at its largest value (1023 for k = 10)
    bits = "".join(f"{b:08b}" for b in codes.reshape(-1).tolist())
    want = torch.tensor(
        [[int(bits[r * 128 + s : r * 128 + min(s + k, 128)], 2) for s in range(0, 128, k)] for r in range(2048)]
    )
    train = SimpleNamespace(shifts=bit_shifts(), chunk_w=chunk_weights(128, k))
    ref = SimpleNamespace(num_bits=128, k=k, num_chunks=-(-128 // k))
    for autocast in (False, True):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            got = PoolEmbedding.codewords(train, codes)
            ref_w = PoolReference.chunk_weights(ref, "cpu")
            got_ref = chunk_integers(unpack_code_bits(codes), ref_w)
        assert torch.equal(got, want) and torch.equal(got_ref, want), autocast  # bit-exact: integer codeword ids
        assert int(got.max()) == 2**k - 1
