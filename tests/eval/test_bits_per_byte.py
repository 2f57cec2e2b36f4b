"""Bits per byte (megahash/data/text_bytes.py, megahash/eval/bits_per_byte.py) against lm-eval's own
definition: the bytes megahash counts per token are ``len(text.encode())`` of the text (special-token
strings and non-ASCII included, sentencepiece and byte-level BPE), and megahash's bits per byte of a text
equals lm-eval's ``bits_per_byte`` of a wikitext-style ``loglikelihood_rolling`` task on the same
documents through megahash's lm-eval model."""

import json
import math
import os

import pytest
import torch

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

# special-token strings of both tokenizers, a tab, newlines, runs of spaces, accents, CJK, an emoji
TEXTS = [
    "Über naïve café: <s> and </s> are text, so are <pad>, <mask>, <unk> and <|endoftext|>.\n\tIndented  "
    "twice,   日本語のテキスト 😀 end.",
    " a text that starts with a space",
    "\nand one with a newline",
    "plain",
    "ß",
]


def _byte_level_tokenizer(tmp_path):
    """A byte-level BPE tokenizer.json (GPT-2's scheme) trained here on a few lines."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<|endoftext|>", "<pad>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(TEXTS * 20 + ["To be or not to be, that is the question."] * 20, trainer)
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    return str(path)


def test_bytes_per_token_are_the_texts_utf8_bytes(shakespeare_shards, tmp_path):
    from megahash.data.text_bytes import TokenBytes
    from megahash.tokenization import load_tokenizer

    for spec in (shakespeare_shards["tokenizer"], _byte_level_tokenizer(tmp_path)):
        tok = load_tokenizer(spec)
        counter = TokenBytes(tok)
        eos = tok.eos_id if tok.eos_id is not None else tok.special_ids["bos"]
        for text in TEXTS:
            ids = tok.encode(text)
            assert tok.decode(ids) == text  # lossless: the byte count's premise
            assert counter.count(ids) == len(text.encode("utf-8")), (spec, text)
        # the training path: a packed stream (documents after end-of-document ids), bytes per label
        stream = [eos]
        for text in TEXTS:
            stream += tok.encode(text) + [eos]
        s = torch.tensor(stream)
        got = int(counter.label_bytes(s[:-1], s[1:]).sum())
        assert got == sum(len(t.encode("utf-8")) for t in TEXTS), spec


def _task(tmp_path, docs):
    """A wikitext-style local task (make_eval_tasks.py's ``ppl`` kind): rolling log-likelihood of ``page``."""
    import yaml

    data = tmp_path / "pages.jsonl"
    data.write_text("".join(json.dumps({"page": d}) + "\n" for d in docs))
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "pages.yaml").write_text(
        yaml.safe_dump(
            {
                "task": "bpb_pages",
                "dataset_path": "json",
                "dataset_name": None,
                "dataset_kwargs": {"data_files": {"test": str(data)}},
                "test_split": "test",
                "output_type": "loglikelihood_rolling",
                "doc_to_text": "",
                "doc_to_target": "{{page}}",
                "metric_list": [{"metric": "bits_per_byte"}, {"metric": "byte_perplexity"}],
            }
        )
    )
    return str(tmp_path / "tasks")


def _tiny_lm(shards, window: int, seed: int, *extra: str):
    """An untrained one-layer model of the quickstart shards' tokenizer behind megahash's lm-eval model
    (``extra``: more config overrides)."""
    from megahash.accelerator import rng
    from megahash.config import load_config
    from megahash.eval.lm import MegahashEvalLM
    from megahash.eval.text import load_codec
    from megahash.models.megatron_model import build_model

    cfg = load_config(
        None,
        [
            f"data.prefix=[{shards['prefix']}]",
            f"data.tokenizer={shards['tokenizer']}",
            "model.hidden_size=32",
            "model.num_layers=1",
            "model.num_heads=2",
            "model.ffn_hidden_size=64",
            f"data.seq_length={window}",
            "model.max_position_embeddings=64",
            *extra,
        ],
    )
    codec = load_codec(cfg)
    rng.seed_all(seed)
    model = build_model(cfg, codec.vocab_size).eval()
    return MegahashEvalLM.from_model(cfg, model, codec, batch_size=4, max_length=window)


def test_bits_per_byte_equals_lm_eval(dist, shakespeare_shards, tmp_path):
    """Documents longer than the window (several rolling windows each) on a tiny untrained model."""
    from lm_eval.api.metrics import bits_per_byte as lm_eval_bpb

    from megahash.eval.bits_per_byte import text_metrics
    from megahash.eval.run import evaluate, summarise

    lm = _tiny_lm(shakespeare_shards, 32, seed=5)
    docs = [TEXTS[0] * 2, "To be, or not to be: that is the question. " * 3, TEXTS[1]]
    ours = text_metrics(lm, docs)
    assert ours["bytes"] == sum(len(d.encode("utf-8")) for d in docs)
    # lm-eval's metric on lm-eval's items: (log-likelihood, bytes of the document text)
    lls = lm.loglikelihood_rolling([type("R", (), {"args": (d,)})() for d in docs])
    items = [(ll, len(d.encode("utf-8"))) for ll, d in zip(lls, docs)]
    # the same fp32 log-likelihoods summed in another order: fp64 rounding only
    assert ours["bpb"] == pytest.approx(lm_eval_bpb(items), rel=1e-9)
    # and lm-eval's own task: its requests, its byte count, its aggregation
    res = summarise(evaluate(lm, ["bpb_pages"], _task(tmp_path, docs)))["results"]["bpb_pages"]
    assert ours["bpb"] == pytest.approx(res["bits_per_byte"], rel=1e-9)
    assert res["byte_perplexity"] == pytest.approx(2 ** ours["bpb"], rel=1e-9)
    assert ours["ppl"] == pytest.approx(math.exp(ours["nll"] / ours["tokens"]), rel=1e-12)


def test_sliding_windows_score_each_token_with_its_window_of_context(dist, shakespeare_shards):
    """``--stride``: at stride = the window the strided log-likelihood is lm-eval's disjoint windows'
    (transformers' sliding-window perplexity reduces to it); at stride 1 every token is scored with the
    ``max_length`` tokens before it (or all of them), checked token by token against the model run on
    exactly that context; ``text_metrics`` reports both schemes over the same tokens and bytes; a stride
    outside 1..window is one line."""
    from megahash.errors import ConfigError
    from megahash.eval.bits_per_byte import text_metrics

    window = 16
    lm = _tiny_lm(shakespeare_shards, window, seed=7)
    model, codec = lm.model, lm.codec
    doc = "To be, or not to be: that is the question. Whether 'tis nobler in the mind to suffer. " * 2
    ids = [codec.eos_id, *codec.encode(doc).ids]
    assert len(ids) > 3 * window  # several windows

    disjoint = lm.loglikelihood_rolling([type("R", (), {"args": (doc,)})()])[0]
    assert lm.loglikelihood_sliding([doc], window)[0] == pytest.approx(disjoint, rel=1e-6)

    with torch.no_grad():  # the oracle: token t given ids[max(0, t - window):t], one forward per token
        oracle = 0.0
        for t in range(1, len(ids)):
            ctx = torch.tensor([ids[max(0, t - window) : t]])
            logp = model(ctx)[0, -1, : codec.vocab_size].double().log_softmax(-1)
            oracle += logp[ids[t]].item()
    one = lm.loglikelihood_sliding([doc], 1)[0]
    assert one == pytest.approx(oracle, rel=1e-5)

    half = text_metrics(lm, [doc], stride=window // 2)
    assert half["tokens"] == len(ids) - 1 and half["sliding"]["stride"] == window // 2
    assert half["nll"] == pytest.approx(-disjoint, rel=1e-9)
    assert half["sliding"]["bpb"] == pytest.approx(half["bpb"] * half["sliding"]["nll"] / half["nll"], rel=1e-9)
    for bad in (0, window + 1):
        with pytest.raises(ConfigError, match="--stride"):
            lm.loglikelihood_sliding([doc], bad)


@pytest.mark.parametrize(
    "embedding",
    [[], ["model.embedding=add", "model.embed.hash_spec=md5"], ["train.precision=bf16"]],
    ids=["vocab", "hash-add", "bf16"],
)
def test_dynamic_evaluation_scores_each_window_then_steps_on_it(dist, shakespeare_shards, embedding):
    """Dynamic evaluation (megahash/eval/dynamic.py) against the update written out: every one of lm-eval's
    disjoint windows (the static number's) is scored by the weights adapted on the windows before it only, then
    theta <- theta - lr min(1, clip / |g|) g with g the gradient of the window's mean NLL (autograd here, the
    norm and the step by hand on a copy of the model). lr = 0 is the static score; the weights and their
    ``requires_grad`` are the checkpoint's afterwards; a repeated document scores lower the second time;
    hash embeddings (the windows' codes) too."""
    from megahash.eval.bits_per_byte import text_metrics
    from megahash.eval.dynamic import dynamic_nll

    window, lr, clip = 16, 0.3, 0.5
    lm = _tiny_lm(shakespeare_shards, window, 11, *embedding)
    doc = "To be, or not to be: that is the question. Whether 'tis nobler in the mind to suffer. " * 2
    docs = [doc, TEXTS[0]]
    before = {k: v.clone() for k, v in lm.model.state_dict().items() if torch.is_tensor(v)}
    flags = [p.requires_grad for p in lm.model.parameters()]

    oracle_model = _tiny_lm(shakespeare_shards, window, 11, *embedding).model  # the same draw: a copy
    # bit-exact: the same seeded draw in the same process (no arithmetic between them)
    assert all(torch.equal(oracle_model.state_dict()[k], v) for k, v in before.items())
    params = [p for p in oracle_model.parameters() if p.is_floating_point()]
    oracle, steps = 0.0, 0
    for d in docs:
        full = lm.codec.encode(d)
        for enc, n, codes in lm._rolling_windows(full):
            codes = lm.codec.codes(enc) if codes is None else codes
            tok = torch.tensor([enc.ids[:-1]])
            cod = None if codes is None else lm._code_tensor(codes[:-1])[None]
            with lm._compute():  # bf16 autocast for a bf16 run, as the evaluation's
                logits = oracle_model(tok, hash_codes=cod)[0, -n:, : lm.codec.vocab_size]
            nll = -logits.double().log_softmax(-1).gather(-1, torch.tensor(enc.ids[-n:])[:, None]).sum()
            oracle += nll.item()
            grads = torch.autograd.grad(nll / n, params, allow_unused=True)
            norm = math.sqrt(sum(float((g.double() ** 2).sum()) for g in grads if g is not None))
            with torch.no_grad():
                for p, g in zip(params, grads):
                    if g is not None:
                        p -= lr * min(1.0, clip / (norm + 1e-6)) * g
            steps += 1
    assert steps > 4  # several windows per document
    got = dynamic_nll(lm, docs, lr, clip)
    # the same operations in fp32 (fp64 log-softmax here): reduction order only; bf16: its rounding, compounded
    assert got == pytest.approx(oracle, rel=1e-5 if lm.precision != "bf16" else 2e-3)
    for k, v in before.items():
        # bit-exact: the weights are copied back, not recomputed: the promise
        assert torch.equal(lm.model.state_dict()[k], v), k
    assert [p.requires_grad for p in lm.model.parameters()] == flags

    static = text_metrics(lm, docs)
    assert dynamic_nll(lm, docs, 0.0) == pytest.approx(static["nll"], rel=1e-6)
    assert got < static["nll"]  # it learns from what it has scored
    both = text_metrics(lm, docs, dynamic_lr=lr, dynamic_clip=clip)
    assert both["nll"] == pytest.approx(static["nll"], rel=1e-9)  # the static number is untouched
    assert both["dynamic"]["nll"] == pytest.approx(got, rel=1e-6) and both["dynamic"]["lr"] == lr
    assert both["dynamic"]["bpb"] == pytest.approx(both["bpb"] * got / both["nll"], rel=1e-5)
    twice = dynamic_nll(lm, [doc, doc], lr, clip) - dynamic_nll(lm, [doc], lr, clip)
    assert twice < text_metrics(lm, [doc])["nll"]  # the second copy is scored after the steps on the first


def test_dynamic_evaluation_refuses_what_it_cannot_do(dist, shakespeare_shards):
    """One-line errors: a step size or clipping norm that cannot be meant, a step that diverges (the weights
    put back all the same), a head that scores hash codes."""
    from megahash.errors import ConfigError
    from megahash.eval.bits_per_byte import text_metrics
    from megahash.eval.dynamic import dynamic_nll

    lm = _tiny_lm(shakespeare_shards, 16, 3)
    doc = "To be, or not to be: that is the question. " * 4
    for lr, clip, match in (
        (-0.1, 1.0, "--dynamic-lr"),
        (float("nan"), 1.0, "--dynamic-lr"),
        (0.1, 0.0, "--dynamic-clip"),
    ):
        with pytest.raises(ConfigError, match=match):
            text_metrics(lm, [doc], dynamic_lr=lr, dynamic_clip=clip)
    before = {k: v.clone() for k, v in lm.model.state_dict().items() if torch.is_tensor(v)}
    with pytest.raises(ConfigError, match="diverged .* lower it"):
        dynamic_nll(lm, [doc], 1e30, 1e30)
    # bit-exact: the weights are copied back, not recomputed: the promise
    assert all(torch.equal(lm.model.state_dict()[k], v) for k, v in before.items())
    lm.hash_head = True  # as a run with a hash-code head sets it (MegahashEvalLM._setup)
    with pytest.raises(ConfigError, match="vocabulary heads"):
        dynamic_nll(lm, [doc], 0.1)
    lm.loglikelihood_rolling = lambda *a: pytest.fail("the static pass ran before the refusal")
    with pytest.raises(ConfigError, match="vocabulary heads"):  # refused before the (long) static pass
        text_metrics(lm, [doc], dynamic_lr=0.1)
