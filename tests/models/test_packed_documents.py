"""Packed documents (issue 34: ``data.reset_position_ids``, ``data.reset_attention_mask``, ``data.eod_mask_loss``).

The independent facts: Megatron-core's own ``_get_ltor_masks_and_position_ids`` (document boundaries, positions,
loss mask), and a packed row giving the same logits, loss and gradients as each of its documents run alone
(positions from 0), for every registered attention kind (decoder and encoder) and embedding kind.
"""

from __future__ import annotations

import math
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import _kinds
import pytest
import torch
from numerics import needs_vector_isa
from test_attention import VOCAB, build, make_cfg

from megahash.accelerator import policy, rng
from megahash.data import documents

pytestmark = [pytest.mark.usefixtures("dist"), pytest.mark.numerics]

EOD = 2
# approx-thesis's literal denominator crosses zero (docs/attention.md, Numerics): its fp32 comparisons at 1e-5 use
# the positive one; the literal one is compared in fp64 by tests/ops/test_packed_documents_linear.py
KIND_OPTIONS = {"approx-thesis": ["model.attention.options.denominator=positive"]}
FLAGS = ["data.reset_attention_mask=true", "data.reset_position_ids=true", "data.eod_mask_loss=true"]


def _param(kind):
    return pytest.param(kind, id=kind)


def _docs(lengths=(5, 7, 4), seed=0):
    """Documents of random ordinary tokens (ids >= 5), each ending in EOD."""
    g = torch.Generator().manual_seed(seed)
    return [torch.cat([torch.randint(5, VOCAB, (n - 1,), generator=g), torch.tensor([EOD])]) for n in lengths]


def _doc_inputs(row):
    doc = documents.document_ids(row, EOD)
    return {"document_ids": doc, "position_ids": documents.position_ids(doc)}


def test_boundaries_equal_megatron_core():
    """document ids / positions / loss mask = megatron-core's GPTDataset helper (its [s, s] mask: True = masked)."""
    from megatron.core.datasets.gpt_dataset import _get_ltor_masks_and_position_ids

    row = torch.cat(_docs((3, 1, 6, 2)) + [torch.tensor([9, 10])])  # an unfinished last document
    mask, loss_mask, pos = _get_ltor_masks_and_position_ids(row, EOD, True, True, True, True)
    doc = documents.document_ids(row[None], EOD)
    from megahash.models.attention.document_mask import boolean_mask

    torch.testing.assert_close(boolean_mask(doc, 1, True, None)[0], ~mask, rtol=0, atol=0)
    assert documents.position_ids(doc)[0].tolist() == pos.tolist()
    assert documents.eod_loss_mask(row[None], torch.ones(1, row.numel()), EOD)[0].tolist() == loss_mask.tolist()
    assert doc[0].tolist() == [0, 0, 0, 1, 2, 2, 2, 2, 2, 2, 3, 3, 4, 4]  # the EOD belongs to the document it ends


def _packed_vs_alone(model, docs, **extra):
    """(packed logits, alone logits, packed grads, alone grads) of the loss sum over every token."""
    row = torch.cat(docs)[None]
    labels = torch.roll(row, -1, 1)
    model.zero_grad()
    packed_loss = model(row, labels=labels, **_doc_inputs(row), **extra)
    packed_loss.sum().backward()
    g_packed = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    alone_loss = torch.cat(
        [
            model(d[None], labels=labels[:, a : a + d.numel()], **extra)
            for d, a in zip(docs, torch.tensor([0] + [d.numel() for d in docs]).cumsum(0))
        ],
        1,
    )
    alone_loss.sum().backward()
    g_alone = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    with torch.no_grad():
        packed = model(row, **_doc_inputs(row), **extra)
        alone = torch.cat([model(d[None], **extra) for d in docs], 1)
    return (packed, alone, packed_loss, alone_loss), (g_packed, g_alone)


def _assert_same(outs, grads, atol):
    packed, alone, lp, la = outs
    scale = alone.abs().max().item()
    torch.testing.assert_close(packed, alone, rtol=0, atol=atol * max(1.0, scale))
    torch.testing.assert_close(lp, la, rtol=0, atol=atol * max(1.0, la.abs().max().item()))
    gp, ga = grads
    assert gp.keys() == ga.keys() and gp
    for n in ga:
        torch.testing.assert_close(gp[n], ga[n], rtol=0, atol=atol * max(1.0, ga[n].abs().max().item()), msg=n)


@pytest.mark.parametrize("kind", [_param(k) for k in _kinds.variants(decoder=True)])
def test_packed_row_equals_each_document_alone(kind):
    """Decoder: logits, per-token loss and every parameter gradient of a packed row = each document alone
    (fp32: 1e-5 relative to the largest value, sums of a few hundred fp32 products)."""
    model = build(make_cfg(kind, *FLAGS, *KIND_OPTIONS.get(_kinds.kind(kind), [])), dtype=torch.float32)
    outs, grads = _packed_vs_alone(model, _docs())
    _assert_same(outs, grads, 1e-5)


@pytest.mark.parametrize("kind", [_param(k) for k in _kinds.variants(encoder=True)])
def test_encoder_packed_row_with_padding_equals_each_document_alone(kind):
    """Encoder: block-diagonal, non-causal, plus padding at the row's end (after a finished document: the padding
    forms a document of its own, whose queries see themselves and stay finite)."""
    model = build(
        make_cfg(kind, "model.arch=encoder", *FLAGS, *KIND_OPTIONS.get(_kinds.kind(kind), [])), dtype=torch.float32
    ).eval()
    docs = _docs((6, 5))
    row = torch.cat(docs + [torch.full((5,), 1)])[None]
    pad = row != 1
    with torch.no_grad():
        packed = model.hidden_states(row, padding_mask=pad, **_doc_inputs(row))
        alone = torch.cat([model.hidden_states(d[None]) for d in docs], 0)
    assert torch.isfinite(packed).all()
    torch.testing.assert_close(packed[:11], alone, rtol=0, atol=1e-5 * max(1.0, alone.abs().max().item()))


@pytest.mark.parametrize("kind", [_param(k) for k in _kinds.variants(decoder=True, exportable=True)])
def test_exported_model_keeps_packed_documents_apart(kind):
    """The plain-torch model of the export (its documents from the EOD tokens under the run's data.reset_* flags)
    gives megahash's logits of a packed row: every kind keeps the documents apart there too (fp64, 1e-10)."""
    from megahash.convert.reference import reference_model

    model = build(make_cfg(kind, *FLAGS, *KIND_OPTIONS.get(_kinds.kind(kind), []))).eval()
    row = torch.cat(_docs())[None]
    with torch.no_grad():
        ours = model(row, **_doc_inputs(row))[..., :VOCAB]
        theirs = reference_model(model.cfg, model).eval()(input_ids=row).logits
    torch.testing.assert_close(theirs, ours, rtol=0, atol=1e-10)


@pytest.mark.parametrize("kind", [_param(k) for k in ("mha", "gqa", "mhe-mul", "sha", "approx")])
def test_packed_row_under_bf16_autocast(kind):
    """bf16 autocast (the GPU default, CPU here): packed = alone within accelerator.policy.compute_tolerance."""
    model = build(make_cfg(kind, *FLAGS, "train.precision=bf16"), dtype=torch.float32).eval()
    docs = _docs()
    row = torch.cat(docs)[None]
    with torch.no_grad(), torch.autocast(**policy.autocast_args("bf16", "cpu")):
        packed = model(row, **_doc_inputs(row)).float()
        alone = torch.cat([model(d[None]) for d in docs], 1).float()
    tol = policy.compute_tolerance("bf16", "cpu")
    torch.testing.assert_close(packed, alone, rtol=0, atol=tol * alone.abs().max().item())


def test_document_kernel_is_flex_only_where_flex_attention_runs():
    """FlexAttention where it runs: CUDA, no dropout, heads of at least 16 dims (torch's CUDA kernel raises
    "NYI: embedding dimension ... must be at least 16"), fp32/bf16/fp16; SDPA with the mask everywhere else."""
    pick = policy.document_attention_kernel
    assert pick("cuda", False, 16, torch.float32) == "flex" and pick("cuda", False, 64, torch.bfloat16) == "flex"
    assert pick("cuda", False, 128, torch.float16) == "flex" and pick("cuda") == "flex"
    assert pick("cuda", False, 8, torch.float32) == "sdpa" and pick("cuda", False, 15, torch.bfloat16) == "sdpa"
    assert pick("cuda", False, 64, torch.float64) == "sdpa"
    assert pick("cuda", True, 64, torch.bfloat16) == "sdpa"
    assert pick("cpu", False, 64, torch.float32) == "sdpa"


@pytest.mark.parametrize(
    "compiled,head_dim", [(False, 8), pytest.param(True, 16, marks=needs_vector_isa)], ids=["eager", "compiled"]
)
def test_kernels_agree_flex_and_sdpa(compiled, head_dim):
    """FlexAttention with a BlockMask (the CUDA kernel; on CPU eager, and compiled by inductor's CPU FlexAttention
    with the block mask built compiled, as on CUDA; forward only: CPU FlexAttention has no backward) = SDPA with
    the boolean mask, causal and encoder with padding (fp32, 1e-5)."""
    from megahash.models.attention import document_mask

    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 2, 256, head_dim, generator=g) for _ in range(3))
    doc = torch.tensor([[0] * 50 + [1] * 130 + [2] * 76, [0] * 256])
    keep = torch.ones(2, 256, dtype=torch.bool)
    keep[0, 200:] = False
    flex = policy.flex_attention("cpu", compiled=compiled)
    for causal, kp in ((True, None), (False, keep)):
        sd = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=document_mask.boolean_mask(doc, 2, causal, kp)
        )
        fx = flex(q, k, v, block_mask=document_mask.block_mask(doc, 2, causal, kp, compiled=compiled))
        torch.testing.assert_close(fx, sd, rtol=0, atol=1e-5)


@needs_vector_isa
def test_packed_forward_through_flex_attention_equals_sdpa(monkeypatch):
    """The model's packed forward with the kernel choice forced to FlexAttention (its CUDA branch of
    ``document_mask.attend``, eager on CPU) = the SDPA branch's logits, decoder and encoder (fp32, 1e-5)."""
    for extra in ([], ["model.arch=encoder"]):
        model = build(make_cfg("mha", *FLAGS, *extra), dtype=torch.float32).eval()
        row = torch.cat(_docs())[None]
        with torch.no_grad():
            sdpa = model(row, **_doc_inputs(row))
            monkeypatch.setattr(policy, "document_attention_kernel", lambda *a, **k: "flex")
            flex = model(row, **_doc_inputs(row))
            monkeypatch.undo()
        torch.testing.assert_close(flex, sdpa, rtol=0, atol=1e-5 * max(1.0, sdpa.abs().max().item()))


@pytest.mark.parametrize("kind", _kinds.embeddings())
def test_embeddings_read_per_token_codes_so_packing_keeps_them(kind):
    """Every embedding kind maps (token, codes) position by position: the codes of a word come from the side shard
    of its own document (words never span an EOD), so a packed row's embeddings = each document's."""
    import _emb_helpers

    spec, _ = _emb_helpers.KINDS[kind]
    cfg = _emb_helpers.tiny_cfg(kind, ["model.num_layers=1", "model.schedule=uniform:mha", *FLAGS], hidden=32, seq=16)
    from megahash.models.megatron_model import build_model

    rng.seed_all(0)
    model = build_model(cfg, 1000).eval()
    tok, codes = _emb_helpers.word_batches(spec, 1, 17, 1, vocab_size=200)[0]
    tok, codes = tok[:, 1:], codes[:, 1:]
    tok[0, 6] = EOD
    codes[0, 6] = 0  # a special's codes are zero (data stage)
    with torch.no_grad():
        packed = model(tok, hash_codes=codes, **_doc_inputs(tok))
        alone = torch.cat([model(tok[:, :7], hash_codes=codes[:, :7]), model(tok[:, 7:], hash_codes=codes[:, 7:])], 1)
    torch.testing.assert_close(packed, alone, rtol=0, atol=1e-5 * max(1.0, alone.abs().max().item()))


def test_sr_shuffles_within_documents_and_mlm_spares_eod():
    """S+R with document ids permutes tokens only inside their document; MLM never selects the EOD (a special)."""
    from megahash.objectives import mlm, shuffle_random

    row = torch.cat(_docs((20, 30, 14), seed=3))[None].repeat(2, 1)
    doc = documents.document_ids(row, EOD)
    sid = {"bos": 0, "pad": 1, "eos": EOD, "unk": 3, "mask": 4}
    out = shuffle_random.corrupt(
        row, None, torch.Generator().manual_seed(0), sid, shuffle_prob=0.5, random_prob=0.0, document_ids=doc
    )
    moved = out["labels"] == shuffle_random.SHUFFLED
    assert moved.sum() > 10
    for b in range(2):
        for d in doc[b].unique():
            where = moved[b] & (doc[b] == d)
            assert sorted(out["tokens"][b][where].tolist()) == sorted(row[b][where].tolist())
    m = mlm.corrupt(row, None, torch.Generator().manual_seed(0), sid, mask_prob=1.0)
    assert not m["loss_mask"][row == EOD].any() and (m["tokens"][row == EOD] == EOD).all()


def test_config_flags_and_kind_refusal(monkeypatch):
    """Defaults off; a kind whose caps say it cannot keep to documents is refused in one line."""
    from megahash.catalog import AttentionCaps
    from megahash.config_checks import check_documents
    from megahash.errors import ConfigError

    assert not documents.enabled(make_cfg("mha").data)
    cfg = make_cfg("mha", *FLAGS)
    assert documents.enabled(cfg.data)
    check_documents(cfg, ["mha"], lambda k: AttentionCaps())
    with pytest.raises(ConfigError, match=r"attention kind 'x' cannot keep attention inside documents"):
        check_documents(cfg, ["mha", "x"], lambda k: AttentionCaps(documents=k != "x"))


@pytest.mark.parametrize("kind", ["mha", "mha-megatron", "rndembqk", "fixedseqqk"])
def test_selective_recompute_keeps_the_documents(kind):
    """``train.recompute=selective`` re-runs the token mixing in backward (megahash's and megatron-core's own
    recomputation): the recomputed attention keeps to the documents, so gradients still equal each document's.
    The fixed-Q/K kinds carry their fixed sequence as one more batch row under recompute; its Q, K take that
    row's own positions, not the packed row's reset ones."""
    model = build(make_cfg(kind, *FLAGS, "train.recompute=selective"), dtype=torch.float32)
    outs, grads = _packed_vs_alone(model, _docs())
    _assert_same(outs, grads, 1e-5)


@pytest.mark.parametrize("kind", ["mha-megatron", "approx", "nonapprox", "approx-thesis", "rndembqk", "fixedseqqk"])
def test_full_recompute_keeps_the_documents(kind):
    """``train.recompute=full`` re-runs whole layers in backward: the forward's state (its document ids) reaches
    the recomputed layers too (megahash's block; megatron-core's own full recompute hands them none), so the
    gradients of a packed row still equal each document's (fp32, as the selective test)."""
    model = build(
        make_cfg(kind, *FLAGS, *KIND_OPTIONS.get(_kinds.kind(kind), []), "train.recompute=full"), dtype=torch.float32
    )
    outs, grads = _packed_vs_alone(model, _docs())
    _assert_same(outs, grads, 1e-5)


@pytest.mark.parametrize(
    "kind,extra",
    [("mha", []), ("mhe-mul", []), ("mha", ["model.arch=encoder", "model.layout=roberta"])],
    ids=["mha", "mhe-mul", "roberta-encoder"],
)
def test_exported_model_honours_the_saved_flags(kind, extra):
    """The Hugging Face export's model reads the flags from the run's config it carries (``megahash_config``):
    its logits of a packed row = the library's with the batch's document ids = each document alone (fp64)."""
    from megahash.convert.reference import reference_model

    model = build(make_cfg(kind, *FLAGS, *extra)).eval()
    ref = reference_model(model.cfg, model).eval()
    docs = _docs()
    row = torch.cat(docs)[None]
    with torch.no_grad():
        ours = model(row, **_doc_inputs(row))
        hf = ref(input_ids=row).logits
        alone = torch.cat([ref(input_ids=d[None]).logits for d in docs], 1)
    torch.testing.assert_close(hf, ours, rtol=0, atol=1e-9)  # float64 models: the parity tests' bound
    torch.testing.assert_close(hf, alone, rtol=0, atol=1e-9)


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("heads,kernel", [(2, "flex"), (4, "sdpa")], ids=["head-dim-16", "head-dim-8"])
def test_packed_row_on_cuda(precision, heads, kernel):
    """On CUDA a packed row's logits and gradients = each document alone (fp32 within 1e-5 of the scale; bf16
    autocast within accelerator.policy.compute_tolerance): through compiled FlexAttention with a BlockMask at head dim 16,
    through SDPA with the mask at head dim 8 (below FlexAttention's CUDA minimum, where it raised NYI)."""
    import contextlib

    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    assert policy.document_attention_kernel("cuda", False, 32 // heads, dtype) == kernel
    model = build(make_cfg("mha", *FLAGS, heads=heads), dtype=torch.float32).cuda()
    docs = [d.cuda() for d in _docs()]
    ctx = torch.autocast(**policy.autocast_args("bf16", "cuda")) if precision == "bf16" else contextlib.nullcontext()
    with ctx:
        outs, grads = _packed_vs_alone(model, docs)
    tol = 1e-5 if precision == "fp32" else policy.compute_tolerance("bf16", "cuda")
    _assert_same(tuple(o.float() for o in outs), grads, tol)


@pytest.mark.slow
@pytest.mark.parametrize(
    "precision,model",
    [("fp32", []), ("bf16", []), ("bf16", ["model.arch=encoder", "train.objective=sr"])],
    ids=["fp32", "bf16", "bf16-encoder-sr"],
)
def test_training_with_all_flags_through_deepspeed(precision, model, shakespeare_shards, tmp_path, capsys, monkeypatch):
    """(Last in this file: the in-process run tears down the module's one-rank world.) The real DeepSpeed engine
    (1 rank, in process) trains and validates with the three flags on (a decoder in fp32 and bf16; an S+R encoder,
    whose corruption gets the batch's document ids); the dataset's samples carry what the model consumes."""
    import functools
    import json

    from test_batch_ramp import _main

    from conftest import TINIER
    from megahash.objectives import shuffle_random

    seen = []
    real = shuffle_random.corrupt

    @functools.wraps(real)
    def corrupt(*a, **kw):
        seen.append(kw.get("document_ids"))
        return real(*a, **kw)

    monkeypatch.setattr(shuffle_random, "corrupt", corrupt)

    data = [f"data.prefix=[{shakespeare_shards['prefix']}]", f"data.tokenizer={shakespeare_shards['tokenizer']}"]
    args = [
        *data,
        *TINIER,
        *FLAGS,
        "train.steps=2",
        "train.micro_batch_size=2",
        "train.global_batch_size=2",
        "data.seq_length=128",
        "data.valid_samples=4",
        "train.eval_interval=2",
        f"train.precision={precision}",
        *model,
        f"train.save_dir={tmp_path / 'run'}",
    ]
    status, out = _main(args, capsys)
    assert status == 0, out[-3000:]
    recs = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert {r["split"] for r in recs} >= {"train", "valid"}
    assert all(math.isfinite(r["loss"]) for r in recs if "loss" in r)
    if "train.objective=sr" in model:  # every corrupted micro-batch (train and valid) kept to its documents
        assert seen and all(d is not None and d.shape[-1] == 128 for d in seen)
    from megahash.data.dataset import HashGPTDataset

    cfg = HashGPTDataset.documents[0]
    assert cfg.reset_attention_mask and cfg.reset_position_ids and cfg.eod_mask_loss
