"""Token n-gram hash embeddings (issue 37 item 2, megahash/models/embeddings/ngram_hash.py): bucket ids against
a table computed by hand from the documented hash, a zero table leaves the model as it was (any embedding
kind), incremental decoding equals the parallel forward, `megahash params` counts it in closed form as the
meta-device model does, and a short DeepSpeed run trains it, checkpoints it and exports it to a Hugging Face
folder whose logits and greedy generation equal megahash's (fp32, then bf16 autocast on CPU).
TP=2 / TP=2+SP parity: the ``mha@ngram`` case of tests/models/test_attention.py::test_tp2_parity_all_kinds."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest
import torch

import conftest
from megahash.accelerator import process_groups, rng
from megahash.config import load_config

SMALL = [
    "model.hidden_size=32",
    "model.num_heads=4",
    "model.ffn_hidden_size=64",
    "data.seq_length=16",
    "model.max_position_embeddings=64",
    "model.tie_embeddings=false",
]
NGRAM = [
    "model.embed.options.ngram_hash_buckets=64",
    "model.embed.options.ngram_hash_dim=8",
]  # the old spelling (no .options): accepted
VOCAB = 96


@pytest.fixture
def one_rank():
    process_groups.init_distributed(1)
    yield
    process_groups.teardown()


def test_bucket_ids_equal_the_hand_computed_table():
    """h_n(i) = (XOR_j M_j t_{i-j}) mod (B-1), M = (36313, 27191, 51497); B-1 where i < n-1; order k's rows
    start at k*B. Tokens 5 7 2 9, B = 11 (Python integers, worked out once):
      i=1: 36313*7 = 254191, 27191*5 = 135955, 254191 ^ 135955 = 127996 -> bigram 6
      i=2: 36313*2 = 72626, 27191*7 = 190337, xor 261171 -> bigram 1; ^ 51497*5 (257485) = 4606 -> trigram 6
      i=3: 326817 ^ 54382 = 272591 -> bigram 1; ^ 51497*7 (360479) = 108752 -> trigram 2"""
    from megahash.models.embeddings.ngram_hash import NgramHashReference as R

    tok = torch.tensor([[5, 7, 2, 9]])
    rows = R.rows(tok, 0, (2, 3), 11)
    assert rows[0, :, 0].tolist() == [10, 6, 1, 1]
    assert rows[0, :, 1].tolist() == [11 + 10, 11 + 10, 11 + 6, 11 + 2]
    # a window that starts later in the sequence (decoding: the carried n-1 ids, then the new ones); its
    # positions with their n-1 previous ids inside it are exact: a bigram window from position 1
    assert R.rows(tok[:, 1:], 1, (2,), 11)[0, 1:, 0].tolist() == [1, 1]
    # ids beyond int32 products stay exact (int64): 36313 * 100000 = 3631300000 > 2^31
    big = torch.tensor([[100000, 99999]])
    assert R.rows(big, 0, (2,), 1001)[0, 1, 0].item() == ((36313 * 99999) ^ (27191 * 100000)) % 1000


@pytest.mark.parametrize("embedding", ["vocab", "bert-hash"])
def test_zero_table_is_the_model_without_it_and_decoding_equals_the_forward(one_rank, embedding):
    """The table starts at zero: same logits as the model without it, same other weights (its projection's
    draw leaves the global RNG alone). With a non-zero table, decoding token by token (previous ids carried)
    equals the parallel forward."""
    from megahash.models.megatron_model import DecodeState, build_model

    tok = torch.randint(5, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    models = []
    for extra in ([], NGRAM):
        rng.seed_all(0)
        models.append(
            build_model(
                load_config(None, [*SMALL, f"model.embedding={embedding}", *extra]), VOCAB, dtype=torch.float64
            ).eval()
        )
    plain, ngram = models
    assert ngram.ngram_hash.table.abs().max() == 0 and ngram.ngram_hash.table.is_embedding_or_output_parameter
    with torch.no_grad():
        # bit-exact: the same weights and kernels, plus an exact zero
        assert torch.equal(plain(tok), ngram(tok))
        ngram.ngram_hash.table.normal_(0, 1.0, generator=torch.Generator().manual_seed(2))
        full = ngram(tok)
        assert (full - plain(tok)).abs().max() > 1e-3
        state = DecodeState(len(ngram.decoder.layers))
        steps = [ngram(tok[:, :5], decode_state=state)] + [
            ngram(tok[:, i : i + 1], decode_state=state) for i in range(5, 12)
        ]
    # fp64: the same sums in another order (cached keys/values)
    assert (torch.cat(steps, dim=1) - full).abs().max() < 1e-10


def test_params_counts_it_in_closed_form_as_the_model_does(one_rank):
    """`megahash params`: K B d + h d more parameters (2 x 64 x 8 + 32 x 8 = 1,280), closed form = meta model."""
    from megahash.models.accounting import count_parameters
    from megahash.models.closed_form import closed_form_report

    cfg = load_config(None, [*SMALL, *NGRAM])
    plain = closed_form_report(load_config(None, SMALL), VOCAB)
    closed, measured = closed_form_report(cfg, VOCAB), count_parameters(cfg, VOCAB)
    assert closed["embedding_ngram"] == measured["embedding_ngram"] == 2 * 64 * 8 + 32 * 8
    assert closed["total"] == measured["total"] == plain["total"] + 1280


def test_bad_orders_are_one_line(one_rank):
    from megahash.errors import ConfigError
    from megahash.models.megatron_model import build_model

    with pytest.raises(ConfigError, match="ngram_hash_orders='2,5'"):
        build_model(load_config(None, [*SMALL, *NGRAM, "model.embed.options.ngram_hash_orders=2,5"]), VOCAB)


TINY = [
    *conftest.TINIER,
    "train.zero_stage=1",
    "train.micro_batch_size=2",
    "train.global_batch_size=2",
    "train.lr=3e-3",
    "train.warmup_steps=0",
    "model.tie_embeddings=false",
    "model.embed.options.ngram_hash_buckets=128",
    "model.embed.options.ngram_hash_dim=8",
]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_deepspeed_run_trains_checkpoints_and_exports_it(precision, shakespeare_shards, tmp_path, capsys):
    """3 DeepSpeed steps (1 rank, in process, ZeRO-1): finite losses, the table left zero and trained; the
    checkpoint reloads; its HF export (remote code) gives megahash's logits and greedy tokens."""
    import json

    from megahash.checkpoint.weights import load_for_inference
    from megahash.convert.export import export_hf
    from megahash.convert.verify import hf_logits, load_hf, megahash_greedy, megahash_logits
    from megahash.pretrain import main

    run = tmp_path / "run"
    status = main(
        [
            f"data.prefix=[{shakespeare_shards['prefix']}]",
            f"data.tokenizer={shakespeare_shards['tokenizer']}",
            *TINY,
            "train.steps=3",
            f"train.precision={precision}",
            f"train.save_dir={run}",
        ]
    )
    out = capsys.readouterr()
    assert status == 0, (out.out + out.err)[-3000:]
    assert precision != "bf16" or "torch.bfloat16" in out.out + out.err  # the run's dtype line
    losses = [
        json.loads(line)["loss"]
        for line in (run / "metrics.jsonl").read_text().splitlines()
        if json.loads(line)["split"] == "train"
    ]
    assert len(losses) == 3 and all(torch.isfinite(torch.tensor(losses)))
    cfg, model, ckpt = load_for_inference(run)
    assert model.ngram_hash.table.abs().max() > 0  # trained away from its zero start
    if precision == "bf16":
        return  # the export's check needs one precision only
    export_hf(ckpt, tmp_path / "hf")
    hf = load_hf(tmp_path / "hf")
    tok = torch.randint(5, 900, (2, 20), generator=torch.Generator().manual_seed(3))
    vocab = hf.config.vocab_size
    ref, got = megahash_logits(model, tok, vocab=vocab), hf_logits(hf, tok)
    assert (ref - got).abs().max().item() < 1e-4  # fp32, two implementations of the same sums (test_convert's bound)
    want = megahash_greedy(model, tok[0, :6].tolist(), 6, vocab, None)
    # greedy ids of two implementations whose logits agree to 1e-4 (fixed seed, no near-tie)
    assert hf.generate(tok[:1, :6], max_new_tokens=6, do_sample=False)[0, 6:].tolist() == want
