"""Efficiency formulas of megahash report against the [Xue25] worked numbers: Table 2.2 (PCR_All,
PCR_Emb, PoEP), Tables 3.1/3.2 (PRR direct and inverse, PEoP), Table 3.13 (per-block memory of
BERT-base), and the report table built from run records."""

import pytest

from megahash.eval import efficiency as eff


@pytest.mark.parametrize(
    "row, total, emb, pcr_all, pcr_emb, poep",
    [
        # Table 2.2, baseline BERT (Emb 50K row: 124.6M total, 38.6M embedding)
        ("HashFormers-Proj", 86.1e6, 99.1e3, 30.9, 99.7, 0.1),
        ("HashFormers-Add", 86.2e6, 197.4e3, 30.8, 99.5, 0.2),
        ("CANINE-C", 121.0e6, 12.3e6, 2.9, 68.1, 10.2),
        ("ProFormer", 15.1e6, 322.6e3, 87.9, 99.2, 2.1),
        ("Emb (50K)", 124.6e6, 38.6e6, 0.0, 0.0, 31.0),
    ],
)
def test_table_2_2_compression_ratios(row, total, emb, pcr_all, pcr_emb, poep):
    assert round(100 * eff.pcr_all(total, 124.6e6), 1) == pcr_all
    assert round(100 * eff.pcr_emb(emb, 38.6e6), 1) == pcr_emb
    assert round(100 * eff.poep(emb, total), 1) == poep


def test_table_3_1_and_3_2_retention_and_elasticity():
    from megahash.models.costs import block_params

    # 12 BERT-base blocks (n = 12 heads of d = 64) with the output projection: 8.85M SHA, 28.32M MHA, 8.88M MHE
    sha, mha, mhe = (12 * block_params(k, 12, 64) for k in ("sha", "mha", "mhe-mul"))
    assert (round(sha / 1e6, 2), round(mha / 1e6, 2), round(mhe / 1e6, 2)) == (8.85, 28.31, 8.88)
    # direct indicator (Table 3.1 GLUE: SHA 79.2 vs MHA 81.9 -> PRR 96.7)
    assert round(100 * eff.prr(79.2, 81.9), 1) == 96.7
    assert round(eff.peop(81.9, 79.2, mha, sha), 2) == 0.02
    # inverse indicator (Table 3.2 WikiText-103 perplexity: SHA 62.0, MHA 43.0, MHE-ADD 54.0, MHE-MUL 53.8)
    assert round(100 * eff.prr(62.0, 43.0, higher_is_better=False), 1) == 55.8
    assert round(100 * eff.prr(53.8, 43.0, higher_is_better=False), 1) == 74.9
    assert round(eff.peop(53.8, 62.0, mhe, sha, higher_is_better=False), 2) == 42.32
    assert round(eff.peop(54.0, 62.0, mhe, sha, higher_is_better=False), 2) == 41.29
    assert round(eff.peop(43.0, 62.0, mha, sha, higher_is_better=False), 2) == 0.14
    assert eff.peop(70.0, 62.0, sha, sha) is None  # equal sizes: undefined (the [Xue25] "-")


@pytest.mark.parametrize(
    "kind, weights, total, saving",
    [
        ("sha", 4423680, 39911424, 44.84),
        ("mha", 14155776, 72351744, 0.00),
        ("el-att", 7077888, 48758784, 32.61),
        ("mqa", 7667712, 50724864, 29.89),
        ("skv", 10616832, 60555264, 16.30),
        ("mhe-mul", 4437504, 39957504, 44.77),
    ],
)
def test_table_3_13_memory_per_block(kind, weights, total, saving):
    from megahash.models.costs import memory_saving_ratio, memory_usage

    m = memory_usage(kind)  # BERT-base: 12 heads of 64, batch 32, sequence 512, fp16 mixed precision
    assert m["weights"] == m["gradients"] == weights
    assert m["activations"] == 25165824 and m["total"] == total
    assert round(memory_saving_ratio(kind), 2) == saving


def _run(name, total, emb, attn, scores):
    return {
        "run": name,
        "run_dir": name,
        "checkpoint": name,
        "schedule": "uniform:mha",
        "embedding_kind": "vocab",
        "params": {"total": total, "embedding": emb, "attention": attn},
        "poep": eff.poep(emb, total),
        "costs": {"prefill_flops_per_token": 1e6, "decode_flops_per_token": 2e5, "cache_bytes": 4096, "context": 128},
        "scores": {
            t: {"metric": m, "value": v, "higher_is_better": h, "step": 1, "file": ""}
            for t, (m, v, h) in scores.items()
        },
    }


def test_report_compares_runs_against_baseline_and_lower_bound():
    from megahash.eval.report import compare, markdown

    mha = _run(
        "mha",
        124_600_000,
        38_600_000,
        28_320_000,
        {"glue": ("acc", 0.819, True), "wiki": ("word_perplexity", 43.0, False)},
    )
    sha = _run(
        "sha",
        105_100_000,
        38_600_000,
        8_850_000,
        {"glue": ("acc", 0.792, True), "wiki": ("word_perplexity", 62.0, False)},
    )
    mhe = _run(
        "mhe", 105_130_000, 99_100, 8_880_000, {"glue": ("acc", 0.806, True), "wiki": ("word_perplexity", 53.8, False)}
    )
    runs = [mha, sha, mhe]
    compare(runs, mha, sha, "attention")
    assert mhe["prr"]["glue"] == pytest.approx(0.806 / 0.819)
    assert mhe["prr"]["wiki"] == pytest.approx(1 - (53.8 - 43.0) / 43.0)
    assert mhe["prr_mean"] == pytest.approx((mhe["prr"]["glue"] + mhe["prr"]["wiki"]) / 2)
    assert mhe["peop"]["wiki"] == pytest.approx(-(53.8 / 62.0 - 1) / (8.88 / 8.85 - 1))
    assert mhe["pcr_emb"] == pytest.approx(1 - 99_100 / 38_600_000) and mha["pcr_all"] == 0.0
    assert sha["peop_mean"] is None  # the lower bound against itself
    table = markdown(runs, mha, sha, "attention")
    lines = table.splitlines()
    assert lines[0].startswith("| run | schedule | embedding | #params |") and "glue acc ↑" in lines[0]
    assert "wiki word_perplexity ↓" in lines[0]
    assert lines[2].startswith("| mha (baseline) |") and lines[3].startswith("| sha (lower bound) |")
    assert "| 99.7 |" in lines[4]  # PCR_Emb of the hashed-embedding run
    # --peop-params total|embedding: eq. 2.7's parameter ratio of that count, the header naming it
    for count, (p_run, p_lower) in {"total": (105_130_000, 105_100_000), "embedding": (99_100, 38_600_000)}.items():
        compare(runs, mha, sha, count)
        assert mhe["peop"]["wiki"] == pytest.approx(-(53.8 / 62.0 - 1) / (p_run / p_lower - 1))
        assert f"PEoP ({count})" in markdown(runs, mha, sha, count).splitlines()[0]


def test_report_says_why_a_cell_is_empty():
    from megahash.eval.report import compare, markdown

    base = _run("base", 1_000_000, 100_000, 50_000, {"glue": ("acc", 0.8, True)})
    noeval = _run("noeval", 900_000, 100_000, 40_000, {})
    other = _run("other", 900_000, 100_000, 50_000, {"wiki": ("word_perplexity", 50.0, False)})
    compare([base, noeval, other], base, base, "attention")
    notes = markdown([base, noeval, other], base, base, "attention").split("\n\n", 1)[1]
    assert "Empty scores, PRR and PEoP of noeval: no `megahash eval` results in noeval/eval/" in notes
    assert "Empty glue of other: not evaluated" in notes and "Empty wiki of base: not evaluated" in notes
    assert "Empty PRR of other: no task scored with the same metric by the baseline base." in notes
    assert "Empty PEoP of base: it is the lower bound." in notes
    assert "Empty PEoP of other: same attention parameter count as the lower bound base" in notes


def test_eval_records_of_another_shape_are_passed_over(tmp_path, capsys):
    """RUN_DIR/eval/*.json that claim to be megahash eval records but hold a string step, results or
    higher_is_better that are not objects of task objects, or a score that is not a number, are passed over
    with one warning each (TypeError/AttributeError tracebacks of ``megahash report`` before); a file nested
    past the recursion limit is passed over like any file that is not JSON (a RecursionError before). The
    well-formed record beside them is read."""
    import json

    from megahash.eval.report import read_evals

    d = tmp_path / "eval"
    d.mkdir()
    good = {"megahash_eval": 1, "step": 3, "results": {"t": {"acc": 0.5}}}
    bad = {
        "step": {**good, "step": "x"},
        "results": {**good, "results": [1]},
        "metrics": {**good, "results": {"t": [1]}},
        "score": {**good, "results": {"t": {"acc": "high"}}},
        "hib": {**good, "higher_is_better": [1]},
    }
    for name, rec in bad.items():
        (d / f"{name}.json").write_text(json.dumps(rec))
    (d / "nested.json").write_text("[" * 100000 + "]" * 100000)
    (d / "good.json").write_text(json.dumps(good))
    found = read_evals(tmp_path)
    assert found == {
        "t": {"metric": "acc", "value": 0.5, "higher_is_better": True, "step": 3, "file": str(d / "good.json")}
    }
    warnings = capsys.readouterr().err.strip().splitlines()
    assert len(warnings) == len(bad) and all(w.startswith("warning: ") for w in warnings), warnings


def test_runs_of_one_folder_name_are_told_apart():
    """Two runs named ``quick`` in different places (and cells of two sweeps) were two rows called ``quick``: each
    is named by as many trailing path parts as tell them apart; a unique name, or one run given twice, stays."""
    from megahash.eval.report import compare, markdown, name_apart

    dirs = ["/r/a/quick", "/r/b/quick", "/s/x/cells/000_mha", "/s/y/cells/000_mha", "/r/base", "/r/base"]
    runs = [{**_run(d.rsplit("/", 1)[1], 1_000_000, 100_000, 50_000, {}), "run_dir": d} for d in dirs]
    name_apart(runs)
    assert [r["run"] for r in runs] == ["a/quick", "b/quick", "x/cells/000_mha", "y/cells/000_mha", "base", "base"]
    compare(runs, runs[0], runs[0], "attention")
    rows = markdown(runs, runs[0], runs[0], "attention").splitlines()[2:6]
    assert [row.split(" | ")[0] for row in rows] == [
        "| a/quick (baseline)",
        "| b/quick",
        "| x/cells/000_mha",
        "| y/cells/000_mha",
    ]


def test_scores_of_an_older_step_than_the_row_are_said():
    """A run evaluated during training at step 3 that went on to step 6 (or a killed run's older results): its row
    describes step 6, its scores are step 3's. Said in a note naming the tasks and steps (it was silent)."""
    from megahash.eval.report import compare, markdown

    run = {**_run("late", 1_000_000, 100_000, 50_000, {"glue": ("acc", 0.8, True), "wiki": ("ppl", 9.0, False)})}
    run["step"], run["run_dir"] = 6, "/r/late"
    run["scores"]["wiki"]["step"] = 6
    fresh = {**_run("fresh", 1_000_000, 100_000, 50_000, {"glue": ("acc", 0.7, True)}), "step": 1}
    compare([run, fresh], run, run, "attention")
    notes = markdown([run, fresh], run, run, "attention").split("\n\n", 1)[1].splitlines()
    stale = [n for n in notes if n.startswith("Scores of ")]
    assert stale == [
        "Scores of late not of its newest checkpoint (step 6): glue of step 1 "
        "(`megahash eval --checkpoint /r/late` scores step 6)."
    ]
