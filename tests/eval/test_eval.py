"""Evaluation on real checkpoints: the lm-eval ``megahash`` model (all request types), the offline
task suite, ``megahash eval`` / ``indicators`` / ``report`` end to end and their one-line errors.

One tiny vocab/mha decoder is trained for 150 steps on the Shakespeare shards (first 400
documents) and one is left untrained (1 step at lr 1e-9), both once per module; the tasks come
from held-out Shakespeare documents 1100+ (data_tools/make_eval_tasks.py)."""

import json
import math
import os

import pytest

import conftest

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

TINY = [  # a model that learns enough in a few hundred steps to beat chance
    *conftest.TINY,
    "data.seq_length=128",
    "model.max_position_embeddings=256",
    "train.micro_batch_size=8",
    "train.global_batch_size=16",
    "train.lr=4e-4",
    "train.beta2=0.99",
    "train.warmup_steps=10",
    "train.eval_interval=0",
    "train.log_interval=50",
]


@pytest.fixture(scope="module")
def runs(shakespeare_shards, tmp_path_factory):
    d = tmp_path_factory.mktemp("eval_runs")
    common = [
        f"data.prefix=[{shakespeare_shards['prefix']}]",
        f"data.tokenizer={shakespeare_shards['tokenizer']}",
        *TINY,
    ]
    jobs = {
        "trained": common
        + ["train.steps=150", "train.lr=5e-3", "train.min_lr=5e-4", f"train.save_dir={d / 'trained'}"],
        "untrained": common + ["train.steps=1", "train.lr=1e-9", "train.min_lr=0", f"train.save_dir={d / 'untrained'}"],
    }
    for k, v in jobs.items():
        r = conftest.pretrain_here(v)
        assert r.returncode == 0, (k, r.stdout[-2000:], r.stderr[-3000:])
    from megahash.data.preprocess import make_eval_tasks

    assert (
        make_eval_tasks.main(
            [
                "--source",
                "shakespeare",
                "--out",
                str(d / "tasks"),
                "--held-out-docs",
                "1100:",
                "--n",
                "100",
                "--ppl-docs",
                "8",
                "--seed",
                "7",
            ]
        )
        == 0
    )
    return {
        **shakespeare_shards,
        "trained": d / "trained",
        "untrained": d / "untrained",
        "tasks": d / "tasks",
        "dir": d,
    }


@pytest.fixture(scope="module")
def lms(runs):
    from megahash.accelerator import process_groups
    from megahash.eval.lm import MegahashEvalLM

    out = {name: MegahashEvalLM(checkpoint=str(runs[name]), batch_size=8) for name in ("trained", "untrained")}
    yield out
    process_groups.teardown()


def _req(kind, *args):
    from lm_eval.api.instance import Instance

    return Instance(request_type=kind, doc={}, arguments=tuple(args), idx=0)


def test_task_suite_is_deterministic_and_held_out(runs, tmp_path):
    from megahash.data.preprocess import make_eval_tasks

    assert (
        make_eval_tasks.main(
            [
                "--source",
                "shakespeare",
                "--out",
                str(tmp_path),
                "--held-out-docs",
                "1100:",
                "--n",
                "100",
                "--ppl-docs",
                "8",
                "--seed",
                "7",
            ]
        )
        == 0
    )
    names = ["shk_next", "shk_order", "shk_ppl", "shk_lastword", "shk_lastword_gen"]
    for n in names:
        assert (tmp_path / f"{n}.jsonl").read_bytes() == (runs["tasks"] / f"{n}.jsonl").read_bytes()
    manifest = json.loads((runs["tasks"] / "shk_manifest.json").read_text())
    assert manifest["held_out_docs"] == [1100, None] and manifest["tasks"]["shk_next"] == 100
    rows = [json.loads(l) for l in (runs["tasks"] / "shk_next.jsonl").read_text().splitlines()]
    assert all(len(r["endings"]) == 4 and 0 <= r["label"] < 4 for r in rows)
    assert len({r["label"] for r in rows}) == 4  # gold position varies
    lw = [json.loads(l)["text"] for l in (runs["tasks"] / "shk_lastword.jsonl").read_text().splitlines()]
    assert all(
        t.split(" ")[-1].isalpha() and t.split(" ")[-1].lower() in t.lower()[: -len(t.split(" ")[-1])] for t in lw
    )


def test_lm_eval_runs_every_output_type(runs, lms):
    """lm_eval.simple_evaluate through the registered model on the local suite: multiple_choice,
    loglikelihood_rolling, loglikelihood and generate_until all produce their metrics."""
    import lm_eval

    from megahash.eval.run import task_manager

    lm = lms["trained"]
    tasks = ["shk_next", "shk_order", "shk_ppl", "shk_lastword", "shk_lastword_gen"]
    res = lm_eval.simple_evaluate(
        model=lm, tasks=tasks, task_manager=task_manager(tasks, str(runs["tasks"])), limit=24, bootstrap_iters=0
    )["results"]
    want = {
        "shk_next": ["acc,none", "acc_norm,none"],
        "shk_order": ["acc,none", "acc_norm,none"],
        "shk_ppl": ["word_perplexity,none", "byte_perplexity,none", "bits_per_byte,none"],
        "shk_lastword": ["perplexity,none", "acc,none"],
        "shk_lastword_gen": ["exact_match,first_word"],
    }
    for task, metrics in want.items():
        for m in metrics:
            v = res[task][m]
            assert isinstance(v, float) and math.isfinite(v), (task, m, v)
    assert 1 < res["shk_ppl"]["byte_perplexity,none"] < 256
    assert res["shk_ppl"]["bits_per_byte,none"] == pytest.approx(
        math.log2(res["shk_ppl"]["byte_perplexity,none"]), rel=1e-6
    )
    assert lm.decode_mode == "incremental"  # every mha layer keeps a KV cache
    # the registered name and lm-eval's model_args string
    from lm_eval.api.registry import get_model

    from megahash.eval.lm import MegahashEvalLM

    assert get_model("megahash") is MegahashEvalLM
    lm2 = MegahashEvalLM.create_from_arg_string(
        f"checkpoint={runs['trained']},batch_size=2,max_length=64,incremental=false", {"batch_size": 16, "device": None}
    )
    assert (lm2.batch_size, lm2.max_length, lm2.incremental, lm.max_length) == (2, 64, False, 128)


def test_a_tokenizer_without_eos_conditions_on_bos_or_on_the_texts_first_token(lms):
    """The token a text is conditioned on is the eos the shards separate documents with, else bos, else none:
    the first token is then context only and scoring starts at the second (id 2 was taken before: an ordinary
    piece of a tokenizer without specials). Checked against the model's own log-probabilities."""
    import copy

    import torch

    lm = lms["trained"]
    text = "Now is the winter of our discontent made glorious summer by this sun of York."
    ids = lm.codec.encode(text).ids
    saved = lm.codec
    try:
        for eos, bos, prefix in ((2, 0, [2]), (None, 0, [0]), (None, None, [])):
            lm.codec = copy.copy(saved)
            lm.codec.special_ids = {**saved.special_ids, "eos": eos, "bos": bos}
            lm.codec.eos_id = eos
            assert lm.codec.prefix().ids == prefix
            full = prefix + ids
            with torch.no_grad():
                logp = lm.model(torch.tensor([full[:-1]]))[0, :, : lm.codec.vocab_size].log_softmax(-1)
            ref = sum(float(logp[t - 1, full[t]]) for t in range(1, len(full)))
            (rolling,) = lm.loglikelihood_rolling([_req("loglikelihood_rolling", text)])
            ((ll, _),) = lm.loglikelihood([_req("loglikelihood", "", text)])
            assert rolling == pytest.approx(ref, abs=1e-4) and ll == pytest.approx(ref, abs=1e-4), (eos, bos)
        from megahash.errors import DataError

        one = next(w for w in ("K", "I", "a", "t") if len(lm.codec.encode(w)) == 1)
        with pytest.raises(DataError, match="no eos or bos"):  # nothing to condition one token on
            lm.loglikelihood([_req("loglikelihood", "", one)])
    finally:
        lm.codec = saved


def test_scores_match_a_direct_forward_and_do_not_depend_on_batching(lms):
    import torch

    lm = lms["trained"]
    ctx, cont = "KING. My lord, the", " queen is dead"
    ((ll, greedy),) = lm.loglikelihood([_req("loglikelihood", ctx, cont)])
    ids = lm.codec.encode(ctx + cont).ids
    n_ctx = len(lm.codec.encode(ctx).ids)
    with torch.no_grad():
        logp = lm.model(torch.tensor([ids[:-1]]))[0, :, : lm.codec.vocab_size].log_softmax(-1)
    ref = sum(float(logp[t - 1, ids[t]]) for t in range(n_ctx, len(ids)))
    assert ll == pytest.approx(ref, abs=1e-4)
    reqs = [_req("loglikelihood", "To be, or not to be", c) for c in [" that", " is the question", " dog", ""]]
    reqs.append(_req("loglikelihood", "", "Hark"))
    lm.batch_size = 1
    one = lm.loglikelihood(reqs)
    lm.batch_size = 8
    many = lm.loglikelihood(reqs)
    assert [round(a, 4) for a, _ in one] == [round(b, 4) for b, _ in many]
    # rolling log-likelihood of a text shorter than max_length = loglikelihood("", text)
    text = "Now is the winter of our discontent made glorious summer by this sun of York."
    (rolling,) = lm.loglikelihood_rolling([_req("loglikelihood_rolling", text)])
    ((ll_all, _),) = lm.loglikelihood([_req("loglikelihood", "", text)])
    assert rolling == pytest.approx(ll_all, abs=1e-4)
    # a long text is scored in windows: every token exactly once
    long_text = " ".join([text] * 30)
    n_tok = len(lm.codec.encode(long_text).ids)
    assert n_tok > 2 * lm.max_length
    assert len(lm._rolling_windows(lm.codec.encode(long_text))) == math.ceil(n_tok / lm.max_length)


def test_greedy_generation_incremental_equals_recompute(lms):
    lm = lms["trained"]
    reqs = [
        _req("generate_until", "KING RICHARD. Now", {"until": ["\n"], "max_gen_toks": 10}),
        _req("generate_until", "My gracious lord,", {"until": ["."], "max_gen_toks": 10}),
        _req("generate_until", "What", {"until": [","], "max_gen_toks": 6}),
    ]
    inc = lm.generate_until(reqs)
    lm.decode_mode = "recompute"
    rec = lm.generate_until(reqs)
    lm.decode_mode = None
    assert inc == rec
    assert all(isinstance(t, str) for t in inc) and any(t.strip() for t in inc)
    assert "," not in inc[2] and "." not in inc[1]  # cut at the stop sequence


def test_trained_checkpoint_beats_untrained_and_chance(runs, lms):
    from megahash.eval.run import evaluate, summarise

    tasks = ["shk_ppl", "shk_order", "shk_lastword"]
    got = {name: summarise(evaluate(lm, tasks, str(runs["tasks"]), limit=100))["results"] for name, lm in lms.items()}
    t, u = got["trained"], got["untrained"]
    assert t["shk_ppl"]["word_perplexity"] < 0.5 * u["shk_ppl"]["word_perplexity"], (t, u)
    assert t["shk_ppl"]["bits_per_byte"] < u["shk_ppl"]["bits_per_byte"] - 0.3
    assert t["shk_lastword"]["perplexity"] < u["shk_lastword"]["perplexity"]
    assert t["shk_order"]["acc"] > 0.62, t  # 2-way: chance 0.5 (100 items: 2.4 sigma)
    print("\ntrained:", json.dumps(t), "\nuntrained:", json.dumps(u))


def test_an_evaluation_starts_no_subprocess_and_leaves_lm_eval_as_it_was(lms, runs, monkeypatch):
    """lm-eval's environment report (torch's collect_env: ``pip list`` and compiler probes in subprocesses,
    ~0.6 CPU-s) is skipped inside megahash's evaluation, recorded as skipped, and lm-eval's own function is
    back afterwards; git's commit hash (lm-eval's ``get_git_commit_hash``) is the one subprocess left."""
    import subprocess

    import lm_eval.evaluator as evaluator

    from megahash.eval.run import evaluate

    started = []
    popen = subprocess.Popen.__init__

    def spy(self, args, *a, **k):
        started.append(args)
        return popen(self, args, *a, **k)

    before = evaluator.add_env_info
    monkeypatch.setattr(subprocess.Popen, "__init__", spy)
    res = evaluate(lms["trained"], ["shk_order"], str(runs["tasks"]), limit=4)
    assert evaluator.add_env_info is before
    assert [a for a in started if "git" not in str(a)] == [], started
    assert res["pretty_env_info"].startswith("not collected") and res["lm_eval_version"]


def test_eval_cli_writes_json_and_markdown(runs, capsys, monkeypatch):
    """`megahash eval` in a fresh process, as the trainer's hook runs it inside a multi-rank job
    (evaluate_checkpoint(isolated=True): launcher variables stripped)."""
    from megahash.eval.run import evaluate_checkpoint

    out = runs["dir"] / "cli_eval" / "res.json"
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")  # as under the deepspeed launcher: must not reach the child
    rec = evaluate_checkpoint(runs["trained"], "shk_ppl,shk_order", str(runs["tasks"]), out, limit=10, batch_size=4)
    stdout = capsys.readouterr().out
    assert rec == json.loads(out.read_text())
    assert rec["megahash_eval"] == 1 and rec["step"] == 150 and rec["tasks"] == ["shk_ppl", "shk_order"]
    assert set(rec["results"]) == {"shk_ppl", "shk_order"} and rec["n_samples"]["shk_order"] == 10
    md = out.with_suffix(".md").read_text()
    assert "| shk_order | acc ↑ |" in md and "word_perplexity ↓" in md and "| shk_order | acc ↑ |" in stdout
    # the trainer's hook writes RUN_DIR/eval/STEP.json, which the report reads
    monkeypatch.delenv("RANK")
    monkeypatch.delenv("WORLD_SIZE")
    for name in ("trained", "untrained"):  # in this process
        evaluate_checkpoint(runs[name], ["shk_ppl", "shk_order"], str(runs["tasks"]), limit=20, quiet=True)
        assert (runs[name] / "eval" / f"step_{150 if name == 'trained' else 1:08d}.json").is_file()


def test_report_table_across_runs(runs, capsys):
    from megahash.cli import main

    if not (runs["untrained"] / "eval").is_dir():
        from megahash.eval.run import evaluate_checkpoint

        for name in ("trained", "untrained"):
            evaluate_checkpoint(runs[name], ["shk_ppl", "shk_order"], str(runs["tasks"]), limit=20, quiet=True)
    out = runs["dir"] / "report.md"
    assert main(["report", "--runs", str(runs["untrained"]), str(runs["trained"]), "--out", str(out)]) == 0
    table = out.read_text()
    assert "| untrained (baseline) |" in table and "| trained |" in table
    assert "shk_order acc ↑" in table and "shk_ppl word_perplexity ↓" in table
    data = json.loads(out.with_suffix(".json").read_text())
    tr = next(r for r in data["runs"] if r["run"] == "trained")
    assert tr["params"]["total"] == 148160 and tr["params"]["embedding"] == 65536
    assert tr["pcr_all"] == 0.0 and tr["poep"] == pytest.approx(65536 / 148160)
    assert tr["prr"]["shk_ppl"] > 1.0 and tr["prr_mean"] > 1.0  # lower perplexity than the baseline
    assert tr["costs"]["cache_bytes"] > 0 and tr["costs"]["prefill_flops_per_token"] > 0


def test_dynamic_evaluation_from_the_cli_and_the_runs_config(runs, capsys, monkeypatch):
    """``megahash eval --text``: ``--dynamic-lr`` adds a line and a ``dynamic`` record beside the static one
    (unchanged, and printed before the slower dynamic pass starts), and a run's ``eval.dynamic_lr`` does the same
    without the flag; ``--dynamic-lr 0`` turns it off."""
    from megahash.cli import main
    from megahash.eval import dynamic

    out = runs["dir"] / "dyn.json"
    base = ["eval", "--checkpoint", str(runs["trained"]), "--text", "shakespeare", "--limit", "2", "--stride", "0"]
    assert main([*base, "--out", str(out), "--overwrite"]) == 0
    static = json.loads(out.read_text())
    assert "dynamic" not in static
    capsys.readouterr()
    printed_before = []
    real = dynamic.dynamic_nll

    def recording(*args, **kw):  # what the user has seen when the dynamic pass starts
        printed_before.append(capsys.readouterr().out)
        return real(*args, **kw)

    monkeypatch.setattr(dynamic, "dynamic_nll", recording)
    assert main([*base, "--out", str(out), "--overwrite", "--dynamic-lr", "0.05", "--dynamic-clip", "2"]) == 0
    assert f"bpb {static['bpb']:.4f} (disjoint windows" in printed_before[0]
    assert "dynamic evaluation (disjoint windows, SGD lr 0.05, clip 2" in capsys.readouterr().out
    rec = json.loads(out.read_text())
    assert rec["bpb"] == pytest.approx(static["bpb"], rel=1e-9)
    dyn = rec["dynamic"]
    assert dyn["lr"] == 0.05 and dyn["clip"] == 2 and dyn["bpb"] > 0 and dyn["bpb"] != pytest.approx(rec["bpb"])
    cfg = [
        *base,
        "--out",
        str(out),
        "--overwrite",
        "--override",
        "eval.dynamic_lr=0.05",
        "--override",
        "eval.dynamic_clip=2",
    ]
    assert main(cfg) == 0
    assert json.loads(out.read_text())["dynamic"]["bpb"] == pytest.approx(dyn["bpb"], rel=1e-6)
    assert main([*cfg, "--dynamic-lr", "0"]) == 0 and "dynamic" not in json.loads(out.read_text())


def test_eval_text_limit_fraction_and_invalid_utf8(runs, capsys):
    """``megahash eval --text``: ``--limit`` below 1 is a fraction of the documents (lm-eval's rule, rounded up);
    bytes that are not UTF-8 are scored as U+FFFD, with a warning and their count in the JSON record."""
    from megahash.cli import main

    src = runs["dir"] / "four_docs.txt"
    src.write_bytes(
        b"To be, or not to be.\n\nThat is the question.\n\nWhether tis nobler.\n\nIn the mind \xff\xfe to suffer.\n"
    )
    out = runs["dir"] / "frac.json"
    base = ["eval", "--checkpoint", str(runs["trained"]), "--text", str(src), "--out", str(out), "--overwrite"]
    assert main([*base, "--limit", "0.5"]) == 0
    rec = json.loads(out.read_text())
    assert rec["documents"] == 2  # ceil(4 x 0.5)
    assert main([*base, "--limit", "0.6"]) == 0 and json.loads(out.read_text())["documents"] == 3
    capsys.readouterr()
    assert main(base) == 0
    rec = json.loads(out.read_text())
    assert rec["documents"] == 4 and rec["replaced_invalid_utf8_chars"] == 2
    assert "2 invalid UTF-8 byte(s) read as U+FFFD" in capsys.readouterr().err


def test_eval_text_default_results_of_two_texts_do_not_collide(runs, capsys):
    """docs/eval.md's ``--text`` examples one after another on one checkpoint, no ``--out``: each text's record
    is its own file, named after the text (before, every text wrote ``STEP_text.json`` and the second command
    stopped with "already exists; pass --overwrite")."""
    from megahash.checkpoint.resolve import resolve_for_inference
    from megahash.cli import main

    ckpt = resolve_for_inference(str(runs["trained"]))
    first, second = runs["dir"] / "first_play.txt", runs["dir"] / "second_play.jsonl"
    first.write_text("To be, or not to be.\n\nThat is the question.\n")
    second.write_text(json.dumps({"text": "Whether tis nobler in the mind to suffer."}) + "\n")
    outs = [ckpt.parent / "eval" / f"{ckpt.name}_text_{name}.json" for name in ("first_play", "second_play")]
    try:
        for src in (first, second):
            assert main(["eval", "--checkpoint", str(runs["trained"]), "--text", str(src), "--stride", "0"]) == 0
        assert [json.loads(o.read_text())["text"] for o in outs] == [str(first), str(second)]
        assert [json.loads(o.read_text())["documents"] for o in outs] == [2, 1]
        # the same text again is still refused without --overwrite (one line, exit 2)
        assert main(["eval", "--checkpoint", str(runs["trained"]), "--text", str(first)]) == 2
        assert "already exists; pass --overwrite" in capsys.readouterr().err
    finally:
        for o in outs:
            o.unlink(missing_ok=True)


def test_indicators_cli_on_checkpoint(runs, capsys):
    from megahash.cli import main
    from megahash.data.preprocess.sources import open_source, select_documents

    text = runs["dir"] / "held_out.txt"
    text.write_text("\n\n".join(select_documents(open_source("shakespeare"), 1150, 1152)))
    out = runs["dir"] / "ind"
    assert (
        main(
            [
                "indicators",
                "--checkpoint",
                str(runs["trained"]),
                "--text",
                str(text),
                "--out",
                str(out),
                "--max-tokens",
                "96",
                "--windows",
                "2",
            ]
        )
        == 0
    )
    rec = json.loads((out / "indicators.json").read_text())
    assert rec["windows"] == 2 and len(rec["layers"]) == 2
    for layer in rec["layers"]:
        assert len(layer["heads"]["entropy"]) == 4 and layer["seq_len"] == 96
        assert 0 <= layer["mean"]["sink"] <= 1 and 0 <= layer["head_div"] <= 1
        assert 0 < layer["mean"]["conc"] <= math.sqrt(96) and 0 < layer["mean"]["entropy"] <= sum(
            math.log(i) for i in range(1, 97)
        )
        assert layer["logits"]["count"] == 2 * 4 * 96 * 97 // 2
    for png in ("indicators_heads.png", "indicators_layers.png", "logits.png"):
        assert (out / png).stat().st_size > 5000
    assert "| 1 | mha |" in capsys.readouterr().out


def test_task_suite_refuses_to_overwrite_without_the_flag(tmp_path, capsys):
    """make_eval_tasks into a folder that holds a suite of the same name: one line, exit 2, nothing
    touched; --overwrite replaces it; another --name sits beside it (issue 29: overwrote silently)."""
    from megahash.data.preprocess import make_eval_tasks

    args = [
        "--source",
        "shakespeare",
        "--out",
        str(tmp_path),
        "--held-out-docs",
        "1100:",
        "--n",
        "10",
        "--ppl-docs",
        "3",
    ]
    assert make_eval_tasks.main(args) == 0
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    capsys.readouterr()
    assert make_eval_tasks.main(args + ["--seed", "9"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "pass --overwrite" in err[0], err
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before
    assert make_eval_tasks.main(args + ["--seed", "9", "--overwrite"]) == 0
    assert (tmp_path / "shk_next.jsonl").read_bytes() != before["shk_next.jsonl"]
    assert make_eval_tasks.main(args + ["--name", "other"]) == 0 and (tmp_path / "other_manifest.json").is_file()


def test_eval_refuses_to_overwrite_without_the_flag(runs, capsys):
    from megahash.cli import main

    out = runs["dir"] / "overwrite" / "res.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text("earlier results\n")
    argv = [
        "eval",
        "--checkpoint",
        str(runs["trained"]),
        "--tasks",
        "shk_order",
        "--tasks-dir",
        str(runs["tasks"]),
        "--limit",
        "4",
        "--out",
        str(out),
    ]
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: {out} already exists; pass --overwrite to replace it (or --out for another file)"], err
    assert out.read_text() == "earlier results\n"
    assert main(argv + ["--overwrite"]) == 0
    assert json.loads(out.read_text())["n_samples"]["shk_order"] == 4


@pytest.mark.parametrize(
    "argv, expect",
    [
        (
            ["eval", "--checkpoint", "/nonexistent/run", "--tasks", "shk_ppl"],
            "checkpoint /nonexistent/run does not exist",
        ),
        (
            ["eval", "--checkpoint", "TRAINED", "--overwrite", "--tasks", "shk_pple", "--tasks-dir", "TASKS"],
            "unknown task 'shk_pple' (did you mean 'shk_ppl'?)",
        ),
        (
            [
                "eval",
                "--checkpoint",
                "TRAINED",
                "--overwrite",
                "--tasks",
                "shk_ppl",
                "--tasks-dir",
                "TASKS",
                "--override",
                "model.hidden_size=128",
            ],
            "do not fit the model of its config",
        ),
        (
            [
                "eval",
                "--checkpoint",
                "TRAINED",
                "--overwrite",
                "--tasks",
                "shk_ppl",
                "--tasks-dir",
                "TASKS",
                "--tokenizer",
                "/nonexistent/x.model",
            ],
            "tokenizer model '/nonexistent/x.model' not found",
        ),
        (
            [
                "eval",
                "--checkpoint",
                "TRAINED",
                "--overwrite",
                "--tasks",
                "hub_task",
                "--tasks-dir",
                "HUBDIR",
                "--limit",
                "2",
            ],
            "offline, evaluate local tasks",
        ),
        (
            ["indicators", "--checkpoint", "TRAINED", "--text", "/nonexistent.txt"],
            "--text /nonexistent.txt does not exist",
        ),
        (["indicators", "--checkpoint", "/nonexistent/run", "--text", "TASKS/shk_manifest.json"], "does not exist"),
        (["report", "--runs", "/nonexistent/run"], "checkpoint /nonexistent/run does not exist"),
        (["eval", "--checkpoint", "TRAINED", "--stride", "8", "--tasks", "x"], "--stride scores raw text"),
        (["eval", "--checkpoint", "TRAINED", "--dynamic-lr", "0.1", "--tasks", "x"], "--dynamic-clip score raw text"),
        (
            ["eval", "--checkpoint", "TRAINED", "--text", "shakespeare", "--limit", "1", "--dynamic-lr", "-1"],
            "--dynamic-lr -1.0 must be a finite number >= 0",
        ),
        (
            ["eval", "--checkpoint", "TRAINED", "--text", "shakespeare", "--override", "eval.dynamic_clip=0"],
            "config key 'eval.dynamic_clip' must be > 0.0",
        ),
        (  # an override is held to its range, as at training
            ["eval", "--checkpoint", "TRAINED", "--text", "shakespeare", "--override", "eval.batch_size=0"],
            "config key 'eval.batch_size' must be >= 1",
        ),
        (  # --out under a file, or a folder: tracebacks after the evaluation before
            [
                "eval",
                "--checkpoint",
                "TRAINED",
                "--text",
                "shakespeare",
                "--limit",
                "1",
                "--out",
                "TASKS/shk_ppl.yaml/r.json",
            ],
            "shk_ppl.yaml is a file, not a folder",
        ),
        (
            ["eval", "--checkpoint", "TRAINED", "--text", "shakespeare", "--limit", "1", "--out", "TASKS"],
            "is a folder; name",
        ),
        (
            [
                "indicators",
                "--checkpoint",
                "TRAINED",
                "--text",
                "TASKS/shk_manifest.json",
                "--out",
                "TASKS/shk_ppl.yaml",
            ],
            "shk_ppl.yaml is a file; name a folder",
        ),
        (["report", "--runs", "TRAINED", "--out", "TASKS/shk_ppl.yaml/r.md"], "shk_ppl.yaml is a file, not a folder"),
        (
            ["eval", "--checkpoint", "TRAINED", "--text", "shakespeare", "--limit", "1", "--stride", "100000"],
            "--stride 100000 must be between 1 and the window",
        ),
        (
            ["eval", "--checkpoint", "TRAINED", "--text", "shakespeare", "--limit", "inf"],
            "--limit inf must be a finite",
        ),
        (
            ["eval", "--checkpoint", "TRAINED", "--text", "shakespeare", "--limit", "nan"],
            "--limit nan must be a finite",
        ),
        (["eval", "--checkpoint", "TRAINED", "--text", "shakespeare", "--max-length", "-5"], "--max-length -5 must"),
        (["eval", "--checkpoint", "TRAINED", "--text", "shakespeare", "--max-length", "0"], "--max-length 0 must"),
        (["eval", "--checkpoint", "TRAINED", "--text", "shakespeare", "--batch-size", "0"], "--batch-size 0 must"),
        (["eval", "--checkpoint", "TRAINED", "--text", ""], "--text is empty"),
        (["eval", "--checkpoint", "TRAINED", "--text", "shakespeare", "--tasks", "shk_ppl"], "--text or --tasks"),
        (  # a clipping norm for a pass that does not run (the run's eval.dynamic_lr is 0)
            ["eval", "--checkpoint", "TRAINED", "--text", "shakespeare", "--limit", "1", "--dynamic-clip", "2"],
            "which is off here (eval.dynamic_lr 0): pass --dynamic-lr",
        ),
        (["eval", "--checkpoint", "TRAINED", "--text", "shakespeare", "--artifact", "TASKS"], "is not a file"),
        (["eval", "--checkpoint", "TASKS/shk_ppl.yaml", "--tasks", "shk_ppl"], "is a file; pass a run directory"),
    ],
)
def test_cli_errors_are_one_line(runs, capsys, argv, expect):
    from megahash.cli import main

    hub = runs["dir"] / "hub_tasks"  # a task whose data lives on the Hugging Face Hub (unreachable offline)
    hub.mkdir(exist_ok=True)
    (hub / "hub_task.yaml").write_text(
        "task: hub_task\ndataset_path: megahash-test/not-on-this-machine\n"
        "output_type: loglikelihood\ntest_split: test\ndoc_to_text: '{{a}}'\n"
        "doc_to_target: '{{b}}'\nmetric_list:\n  - metric: acc\n"
    )
    argv = [
        a.replace("TRAINED", str(runs["trained"])).replace("TASKS", str(runs["tasks"])).replace("HUBDIR", str(hub))
        for a in argv
    ]
    assert main(argv) == 2
    err = [l for l in capsys.readouterr().err.strip().splitlines() if l.strip()]
    errors = [l for l in err if l.startswith("error: ")]
    assert len(errors) == 1 and expect in errors[0], err
    assert not any("Traceback" in l for l in err)


@pytest.fixture
def read_only_run(runs, tmp_path):
    """A copy of the untrained run in a folder nothing can be written into: ``chattr +i`` as root (whose permission
    bits are bypassed), mode 0o555 otherwise; skipped where neither holds (a write is tried to be sure)."""
    import shutil
    import subprocess

    run = tmp_path / "ro run ü"
    shutil.copytree(runs["untrained"], run, ignore=shutil.ignore_patterns("eval", "indicators"))
    if os.geteuid() == 0:
        locked = subprocess.run(["chattr", "+i", str(run)], capture_output=True).returncode == 0
        unlock = ["chattr", "-i", str(run)]
    else:
        run.chmod(0o555)
        locked, unlock = True, None
    try:
        (run / "probe").touch()
        (run / "probe").unlink()
        locked = False
    except OSError:
        pass
    if not locked:
        pytest.skip("no read-only folder here (chattr +i needs root and a file system with the attribute)")
    yield run
    if unlock:
        subprocess.run(unlock, capture_output=True)
    else:
        run.chmod(0o755)


@pytest.mark.parametrize(
    "argv",
    [
        ["eval", "--checkpoint", "RUN", "--tasks", "shk_order", "--tasks-dir", "SUITE", "--limit", "2"],
        ["eval", "--checkpoint", "RUN", "--text", "TASKS/shk_held_out.txt", "--limit", "1"],
        ["indicators", "--checkpoint", "RUN", "--text", "TASKS/shk_held_out.txt", "--max-tokens", "16"],
        ["report", "--runs", "RUN", "--out", "RUN/report.md"],
    ],
    ids=["eval", "eval-text", "indicators", "report"],
)
def test_a_read_only_run_folder_is_one_line_before_the_work(runs, read_only_run, capsys, argv):
    """Results written beside a run that cannot take them (a read-only mount, another user's folder): one line
    naming the folder and --out, exit 2, before the model is run (was an OSError traceback after the work)."""
    from megahash.cli import main

    (read_only_run.parent / "shk_held_out.txt").write_text("To be, or not to be, that is the question.\n" * 40)
    argv = [
        a.replace("RUN", str(read_only_run))
        .replace("TASKS", str(read_only_run.parent))
        .replace("SUITE", str(runs["tasks"]))
        for a in argv
    ]
    assert main(argv) == 2
    cap = capsys.readouterr()
    err = [l for l in cap.err.strip().splitlines() if l.startswith("error: ")]
    assert len(err) == 1 and "Traceback" not in cap.err, cap.err
    assert f"{read_only_run} is " in err[0] and (
        "--out FILE elsewhere" in err[0] or "--out DIR elsewhere" in err[0] or "name another --out" in err[0]
    ), err
    assert sorted(p.name for p in read_only_run.iterdir()) == sorted(
        p.name for p in runs["untrained"].iterdir() if p.name not in ("eval", "indicators")
    )


def test_out_and_the_file_written_beside_it_are_two_files(runs, tmp_path, capsys):
    """``megahash eval`` writes ``--out`` (JSON) and the table beside it (.md); ``megahash report`` the table
    (``--out``) and the numbers beside it (.json). ``--out`` with the other's suffix was one file overwritten by
    the other (eval: the JSON results gone, so the report found none); a folder of that name was a traceback
    after the work with the first file already replaced. Now one line each, before the checkpoint is read."""
    from megahash.cli import main

    (tmp_path / "taken.json").mkdir()
    cases = [
        (["report", "--runs", str(runs["trained"]), "--out", str(tmp_path / "r.json")], "name the .md file"),
        (["report", "--runs", str(runs["trained"]), "--out", str(tmp_path / "taken.md")], "is a folder"),
        (
            ["eval", "--checkpoint", str(runs["trained"]), "--tasks", "shk_order", "--tasks-dir", str(runs["tasks"])]
            + ["--limit", "2", "--out", str(tmp_path / "e.md")],
            "name the .json file",
        ),
    ]
    for argv, expect in cases:
        assert main(argv) == 2
        err = [l for l in capsys.readouterr().err.strip().splitlines() if l.strip()]
        assert len(err) == 1 and err[0].startswith("error: --out ") and expect in err[0], err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken.json"]  # nothing written


def _fail_half_way(monkeypatch, what: str):
    """Every text write (``what`` text) or figure save (figure) writes half its bytes, then fails as a full disk
    does (fault injection)."""
    import errno
    import io
    import pathlib

    import matplotlib.figure

    def write_text(self, data, *a, **k):
        with open(self, "w") as f:
            f.write(data[: len(data) // 2])
        raise OSError(errno.ENOSPC, "No space left on device")

    real_savefig = matplotlib.figure.Figure.savefig

    def savefig(self, fname, *a, **k):
        buf = io.BytesIO()
        real_savefig(self, buf, *a, **{**k, "format": "png"})
        pathlib.Path(fname).write_bytes(buf.getvalue()[: len(buf.getvalue()) // 2])
        raise OSError(errno.ENOSPC, "No space left on device")

    if what == "text":
        monkeypatch.setattr(pathlib.Path, "write_text", write_text)
    else:
        monkeypatch.setattr(matplotlib.figure.Figure, "savefig", savefig)


def test_a_failed_write_leaves_the_previous_report_and_indicators_whole(runs, tmp_path, monkeypatch, capsys):
    """report --out (table and numbers) and indicators (JSON and PNGs) write each file under a temp name and rename
    it: a write that fails half way (a full disk, a killed job) leaves the previous file as it was and no temp file.
    Before, the table, indicators.json and the PNGs were written in place: half a file."""
    from megahash.cli import main

    text = tmp_path / "held_out.txt"
    text.write_text("To be, or not to be, that is the question.\n" * 40)
    ind = tmp_path / "ind"
    report = [["report", "--runs", str(runs["trained"]), "--out", str(tmp_path / "r.md")]]
    indicators = [["indicators", "--checkpoint", str(runs["trained"]), "--text", str(text), "--out", str(ind)]]
    for argv in report + [indicators[0] + ["--max-tokens", "16"]]:
        assert main(argv) == 0
    capsys.readouterr()
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file() and p != text}
    assert {p.name for p in before} >= {"r.md", "r.json", "indicators.json", "indicators_heads.png", "logits.png"}
    for what, argvs in (("text", report + indicators), ("figure", indicators)):
        with monkeypatch.context() as m:
            _fail_half_way(m, what)
            for argv in argvs:
                with pytest.raises(OSError, match="No space left"):
                    main([*argv, "--max-tokens", "8"] if argv[0] == "indicators" else argv)
        after = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file() and p != text}
        if what == "figure":  # indicators.json was written whole (the 8-token windows) before the plot failed
            assert json.loads(after[ind / "indicators.json"])["window_tokens"] == 8
            after[ind / "indicators.json"] = before[ind / "indicators.json"]
        assert after == before, what  # the same files, byte for byte: nothing half-written, no temp file left


def test_an_unfinished_save_is_named_not_read(runs, tmp_path, capsys):
    """``step_N.tmp`` (a save its run was killed in, or is writing now): eval and report refuse it in one line that
    names the run directory and its newest complete checkpoint. Before, eval read a .tmp that had its state file
    (results as eval/step_N.tmp.json) and said "holds no complete checkpoint" of one that had not."""
    import shutil

    from megahash.cli import main

    run = tmp_path / "killed run"
    shutil.copytree(runs["untrained"], run, ignore=shutil.ignore_patterns("eval", "indicators"))
    shutil.copytree(run / "step_00000001", run / "step_00000002.tmp")
    (tmp_path / "half").mkdir()
    for tmp in (run / "step_00000002.tmp", tmp_path / "half" / "step_00000009.tmp"):
        tmp.mkdir(exist_ok=True)
        for argv in (
            ["eval", "--checkpoint", str(tmp), "--tasks", "shk_order", "--tasks-dir", str(runs["tasks"])],
            ["report", "--runs", str(tmp)],
        ):
            assert main(argv) == 2
            err = [l for l in capsys.readouterr().err.strip().splitlines() if l.strip()]
            assert len(err) == 1 and f"error: {tmp} is an unfinished save" in err[0], err
            assert f"name the run directory {tmp.parent}" in err[0]
            assert ("newest complete checkpoint is step_00000001" in err[0]) == (tmp.parent == run), err
    assert not (run / "eval").exists()


def test_a_checkpoint_config_key_of_a_newer_release_says_so(runs, tmp_path, capsys):
    """A checkpoint whose resolved_config.yaml has a key this megahash does not know (saved by a newer release; its
    manifest agrees, so it is not damaged): the one line now says where such a key comes from and what to do (it
    named the key and listed the valid ones, no more)."""
    import shutil

    import yaml

    from megahash.checkpoint.manifest import write_manifest
    from megahash.checkpoint.origin import sign
    from megahash.cli import main

    run = tmp_path / "newer"
    shutil.copytree(runs["untrained"], run, ignore=shutil.ignore_patterns("eval", "indicators"))
    step = run / "step_00000001"
    tree = yaml.safe_load((step / "resolved_config.yaml").read_text())
    tree["model"]["frobnicate"] = 3
    (step / "resolved_config.yaml").write_text(yaml.safe_dump(tree))
    write_manifest(step, True)  # as the newer release wrote it: the manifest vouches for the file
    sign(step)
    assert main(["report", "--runs", str(run)]) == 2
    err = [l for l in capsys.readouterr().err.strip().splitlines() if l.strip()]
    assert len(err) == 1 and "unknown config key 'model.frobnicate'" in err[0], err
    assert "saved by a newer megahash" in err[0] and "upgrade" in err[0]
