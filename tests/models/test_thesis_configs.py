"""Shipped configs against [Xue25]: Emb(N) sizes of Table 2.2, the Table 4.9 LR schedule (cosine,
0.5 cycles, to 0; checked against transformers' scheduler), and FixedSeqQK's default fixed text."""

from __future__ import annotations

import math

import pytest

from megahash.config import load_config


@pytest.mark.parametrize(
    "snippet,rows,printed",
    [
        ("md5-emb-1k", 1038, "797.2K"),
        ("lsh-emb-1k", 1038, "797.2K"),
        ("md5-emb-50k", 50260, "38.6M"),
        ("lsh-emb-50k", 50260, "38.6M"),
    ],
)
def test_emb_n_sizes_of_table_2_2(snippet, rows, printed):
    """#Emb Params of Table 2.2 at d = 768: Emb(1K) 797.2K = 1,038 rows, Emb(50K) 38.6M = 50,260 rows."""
    from megahash.models.embeddings.base import bucket_count

    cfg = load_config(f"configs/embeddings/{snippet}.yaml", ["model.size=bert-base"])
    n, _ = bucket_count(cfg, "model.embedding=hash-emb")
    assert n == rows
    params = n * cfg.model.hidden_size
    value, unit = float(printed[:-1]), {"K": 1e3, "M": 1e6}[printed[-1]]
    assert round(params / unit, 1) == value


@pytest.mark.parametrize("recipe", ["configs/pretrain_500m_hybrid.yaml", "configs/pretrain_1.7b.yaml"])
def test_thesis_recipes_lr_is_cosine_half_cycle_to_zero(recipe):
    """Table 4.9: CosineLRScheduler with 0.5 cycles after 2000 warmup steps, i.e. transformers'
    get_cosine_schedule_with_warmup(num_cycles=0.5), which ends at 0."""
    import torch
    from transformers import get_cosine_schedule_with_warmup

    from megahash.training.lr_schedule import lambda_for

    cfg = load_config(recipe)
    t = cfg.train
    assert t.decay == "cosine" and t.min_lr == 0.0 and t.warmup_steps == 2000
    ours = lambda_for(t)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    theirs = get_cosine_schedule_with_warmup(opt, t.warmup_steps, t.steps, num_cycles=0.5).lr_lambdas[0]
    for step in list(range(t.warmup_steps, t.steps + 1, 997)) + [t.steps - 1, t.steps]:
        assert math.isclose(ours(step), theirs(step), rel_tol=1e-9, abs_tol=1e-12), step
    assert ours(t.steps) == 0.0


def test_fixedseqqk_default_text_is_shakespeare(tmp_path):
    """model.attention.options.fixed_text defaults to the shakespeare package's text (stand-in for the
    [Xue25] FineWeb sample), tokenised with the run's sentencepiece model outside megahash.models;
    token-id files still work; bad values fail with one line."""
    import sentencepiece as spm

    from megahash.data.text_source import shakespeare_text, token_ids
    from megahash.errors import ConfigError

    def fixed_token_ids(cfg, vocab_size=None):  # what the fixedseqqk input's prepare hook reads
        o = cfg.model.attention.options
        return token_ids(o.fixed_text, cfg, o.fixed_seq_length, vocab_size, key="model.attention.options.fixed_text")

    text = shakespeare_text(max_chars=20_000)
    assert text.startswith("ALL'S WELL THAT ENDS WELL")  # first play in sorted order
    corpus = tmp_path / "c.txt"
    corpus.write_text(text)
    spm.SentencePieceTrainer.train(
        input=str(corpus), model_prefix=str(tmp_path / "sp"), vocab_size=300, model_type="bpe", minloglevel=2
    )
    sp = spm.SentencePieceProcessor(model_file=str(tmp_path / "sp.model"))
    cfg = load_config(
        None,
        [
            "model.schedule=uniform:fixedseqqk",
            f"data.tokenizer={tmp_path / 'sp.model'}",
            "model.attention.options.fixed_seq_length=64",
        ],
    )
    assert cfg.model.attention.options.fixed_text == "shakespeare"
    ids = fixed_token_ids(cfg, vocab_size=300)
    assert len(ids) == 64 and ids == sp.encode(text)[:64]
    (tmp_path / "ids.tok").write_text(" ".join(map(str, range(10, 80))))
    cfg.model.attention.options.fixed_text = str(tmp_path / "ids.tok")
    assert fixed_token_ids(cfg) == list(range(10, 74))
    with pytest.raises(ConfigError, match="outside the vocabulary"):
        fixed_token_ids(cfg, vocab_size=20)
    cfg.model.attention.options.fixed_text = str(tmp_path / "missing.bin")
    with pytest.raises(ConfigError, match="neither 'shakespeare' nor an existing file"):
        fixed_token_ids(cfg)
