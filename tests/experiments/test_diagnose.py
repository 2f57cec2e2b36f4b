"""``megahash diagnose``: the synthetic recall tasks are what they claim (checked by a plain loop over
the generated sequences), and at the default tiny budget softmax attention learns multi-query
associative recall (Zoology) while a model without token mixing (``uniform:mlp``) stays at chance.

Thresholds from measured runs (docs/experiments.md, 2-core CPU): ``uniform:mha`` reaches MQAR
accuracy 1.00 at the default budget (600 steps, 4 pairs, 8 keys/values); ``uniform:mlp`` stays at
chance (1/8 = 0.125) because each sequence binds keys to values afresh. The test asserts mha >= 0.9,
mlp <= chance + 0.1 and a margin of at least 0.6 between them."""

import json

import pytest

from conftest import megahash_here


def test_mqar_and_copy_sequences_are_well_formed():
    import torch

    from megahash.experiments.diagnose import IGNORE, MQAR, Copy

    task = MQAR(pairs=4, queries=3, keys=8, values=8)
    tokens, labels = task.batch(torch.Generator().manual_seed(0), 64)
    assert tokens.shape == labels.shape == (64, task.seq_length) and task.seq_length == 14
    for t, lab in zip(tokens.tolist(), labels.tolist()):
        kv = dict(zip(t[0:8:2], t[1:8:2]))
        assert len(kv) == 4 and all(1 <= k <= 8 < v <= 16 for k, v in kv.items())  # distinct keys, value ids
        answered = [(i, y) for i, y in enumerate(lab) if y != IGNORE]
        assert [i for i, _ in answered] == [8, 10, 12]
        for i, y in answered:
            assert y == kv[t[i]] and t[i + 1] == y  # the answer is the value bound to the queried key
        assert len({t[i] for i, _ in answered}) == 3  # each key queried at most once
    copy = Copy(length=5, values=8)
    tokens, labels = copy.batch(torch.Generator().manual_seed(0), 8)
    for t, lab in zip(tokens.tolist(), labels.tolist()):
        assert t[5] == 9 and t[:5] == t[6:]
        assert lab[5:10] == t[:5] and all(y == IGNORE for y in lab[:5] + lab[10:])


@pytest.mark.slow
def test_default_budget_separates_attention_from_no_mixing(tmp_path):
    out = tmp_path / "diag.json"
    r = megahash_here(["diagnose", "--kinds", "mha,mlp", "--tasks", "mqar", "--out", str(out)])  # in this process
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    acc = {row["schedule"]: row["tasks"]["mqar"]["accuracy"] for row in res["rows"]}
    chance = res["rows"][0]["tasks"]["mqar"]["chance"]
    assert chance == pytest.approx(1 / 8) and res["budget"]["steps"] == 600
    assert acc["uniform:mha"] >= 0.9, acc
    assert acc["uniform:mlp"] <= chance + 0.1, acc
    assert acc["uniform:mha"] - acc["uniform:mlp"] >= 0.6, acc
    md = (tmp_path / "diag.md").read_text()
    assert md.startswith("| schedule | #params | mqar acc ↑ |") and "| uniform:mlp |" in md


def test_unknown_kind_is_one_line_error(capsys):
    from megahash.experiments import diagnose

    assert diagnose.main(["--kinds", "mha,softmaxx"]) == 2
    cap = capsys.readouterr()
    lines = cap.err.strip().splitlines()
    assert cap.out == "" and len(lines) == 1, cap.err
    assert lines[0].startswith("error: unknown attention kind 'softmaxx' (known: approx, ") and "mlp" in lines[0]


def test_an_out_that_cannot_be_written_is_one_line_before_training(tmp_path, capsys):
    """--out a folder, under a file, or with the .md suffix of the table written beside it: one line before the
    first kind trains (they were a traceback, or the JSON overwritten by the table, after every kind had trained)."""
    from megahash.experiments import diagnose

    (tmp_path / "afile").write_text("x")
    for out, expect in (
        (tmp_path, "is a folder"),
        (tmp_path / "afile" / "r.json", "is a file, not a folder"),
        (tmp_path / "r.md", "name the .json file"),
    ):
        assert diagnose.main(["--kinds", "mha", "--steps", "1", "--out", str(out)]) == 2
        cap = capsys.readouterr()
        lines = cap.err.strip().splitlines()
        assert cap.out == "" and len(lines) == 1 and lines[0].startswith("error: --out ") and expect in lines[0], cap


def test_one_progress_line_per_kind_before_it_trains(capsys):
    """Each kind says it is training before its minutes of training (issue 29: silent until done)."""
    from megahash.experiments import diagnose

    assert (
        diagnose.main(
            ["--kinds", "mha,mlp", "--tasks", "copy", "--steps", "2", "--eval-samples", "4", "--copy-length", "4"]
        )
        == 0
    )
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("diagnose: ")]
    assert [line.split()[1:3] for line in lines] == [
        ["[1/2]", "uniform:mha:"],
        ["uniform:mha", "copy"],
        ["[2/2]", "uniform:mlp:"],
        ["uniform:mlp", "copy"],
    ], lines
    assert lines[0].endswith("training on copy (2 steps each)")
