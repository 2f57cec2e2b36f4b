"""The README's grids run (issue 28 item 3): every shipped grid (configs/grids/*.yaml, tiny and full)
goes through ``megahash sweep --launcher local`` with its cells shrunk by command-line overrides to a
tiny model and 2 steps with a save after step 1 (the machinery, not the scores): every variant of
each grid trains, saves, evaluates and is reported; a seed axis runs its first seed only
(``--cells``: the other seeds are the same config with another ``train.seed``, run by
tests/test_sweep.py's 2x2 grid). The tiny grids keep their own offline task suite (``data/eval_tasks``
under the sweep's working directory, as README's step 4 makes it); the full grids, whose lm-eval
tasks come from the Hugging Face Hub, take the same offline suite through ``--tasks``/``--tasks-dir``.
A failed cell is named with its one-line error at the end of the sweep and in the report."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, child_env

GRIDS = sorted((ROOT / "configs" / "grids").glob("*.yaml"))
SHRINK = ["model.hidden_size=64", "model.num_layers=2", "model.num_heads=4", "model.ffn_hidden_size=128",
          "model.num_query_groups=0", "model.vocab_size=0", "model.max_position_embeddings=128",
          "model.attention.fixed_seq_length=64", "data.seq_length=64", "data.valid_samples=8",
          "train.steps=2", "train.save_interval=1", "train.eval_interval=2", "train.eval_iters=1",
          "train.micro_batch_size=2", "train.global_batch_size=2", "train.warmup_steps=1", "train.log_interval=1",
          "train.precision=fp32", "logging.plot=false", "logging.tensorboard=false"]
TASKS = ["shk_next", "shk_ppl"]


@pytest.fixture(scope="module")
def workdir(shakespeare_shards, tmp_path_factory):
    """A working directory with README step 4's offline tasks (data/eval_tasks) and a word-level shard
    set carrying every side shard the full Table 2.1 grid names (its header)."""
    d = tmp_path_factory.mktemp("grids")
    from data_tools import make_eval_tasks

    assert make_eval_tasks.main(["--source", "shakespeare", "--out", str(d / "data" / "eval_tasks"), "--held-out-docs",
                                 "1100:", "--n", "8", "--ppl-docs", "1", "--seed", "7"]) == 0
    words = d / "words" / "shk"
    specs = "md5,lsh128,md5-bucket50000,md5-bucket1000,lsh-bucket50000,lsh-bucket1000"
    r = subprocess.run([sys.executable, "data_tools/preprocess_data.py", "--input", "shakespeare", "--output-prefix",
                        str(words), "--tokenizer", "words", "--word-hashes", specs, "--workers", "1", "--max-docs", "60",
                        "--quiet"], cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    return {"dir": d, "words": str(words), "shards": shakespeare_shards}


def _first_seed_cells(grid) -> list[int]:
    first = {k: grid.cells[0].values[k] for k in grid.seed_keys}
    return [c.index for c in grid.cells if all(c.values[k] == v for k, v in first.items())]


@pytest.mark.slow
@pytest.mark.parametrize("path", GRIDS, ids=[p.stem for p in GRIDS])
def test_every_cell_of_every_shipped_grid_runs_through_the_sweep(workdir, tmp_path, path):
    import yaml

    from megahash.experiments.sweep import load_grid

    spec = yaml.safe_load(path.read_text())
    words = spec.get("overrides", {}).get("data.tokenizer") == "words"
    shards = workdir["shards"]
    data = [f"data.prefix=[{workdir['words'] if words else shards['prefix']}]",
            f"data.tokenizer={'words' if words else shards['tokenizer']}"]
    out = tmp_path / path.stem
    grid = load_grid(str(path), SHRINK + data, str(out))
    cells = _first_seed_cells(grid)
    tiny = path.stem.endswith("_tiny")
    evaluation = ["--limit", "4"] if tiny else ["--tasks", ",".join(TASKS), "--tasks-dir",
                                                 str(workdir["dir"] / "data" / "eval_tasks"), "--limit", "4"]
    r = subprocess.run([sys.executable, "-m", "megahash", "sweep", "--grid", str(path), "--launcher", "local",
                        "--out", str(out), "--cells", ",".join(map(str, cells)), *evaluation, *SHRINK, *data],
                       cwd=workdir["dir"], env=child_env(), capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
    done = re.findall(r"sweep: \[(\d+)/(\d+)\] cell (\S+): done \(step 2\) in ", r.stdout)
    assert [int(i) for i, _, _ in done] == list(range(1, len(cells) + 1)), r.stdout[-3000:]
    assert [name for _, _, name in done] == [grid.cells[i].name for i in cells]
    rep = json.loads((out / "report.json").read_text())
    assert [row["cell"] for row in rep["rows"]] == [grid.cells[i].name for i in cells]
    tasks = spec["eval"]["tasks"] if tiny else TASKS
    for row in rep["rows"]:
        assert sorted(row["scores"]) == sorted(tasks) and row["valid_loss"] is not None, row["cell"]
        assert [s for s, _ in row["train_curve"]] == [1, 2], row["cell"]
    assert [c["cell"] for c in rep["not_done"]] == [c.name for c in grid.cells if c.index not in cells]


def test_a_failed_cell_is_named_with_its_error_at_the_end_and_in_the_report(workdir, tmp_path):
    """Two cells, the second of which cannot train (it resumes from a checkpoint that does not exist): the sweep
    goes on, ends with exit 1 naming the cell and its one-line error, and the report lists it."""
    import yaml

    shards = workdir["shards"]
    grid = {"name": "fails", "config": "quickstart.yaml",
            "overrides": SHRINK + [f"data.tokenizer={shards['tokenizer']}", f"data.prefix=[{shards['prefix']}]"],
            "variants": [{"name": "ok", "overrides": {}},
                         {"name": "broken", "overrides": {"train.resume": str(tmp_path / "nowhere")}}]}
    path = tmp_path / "fails.yaml"
    path.write_text(yaml.safe_dump(grid))
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "-m", "megahash", "sweep", "--grid", str(path), "--out", str(out)],
                       cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=900)
    assert r.returncode == 1, (r.stdout[-3000:], r.stderr[-3000:])
    assert re.search(r"sweep: \[1/2\] cell 000_ok: done \(step 2\) in \d+", r.stdout), r.stdout
    err = r.stderr.strip().splitlines()
    assert re.match(r"sweep: \[2/2\] cell 001_broken: FAILED after \d+s \(exit 2\): error: train.resume=.*nowhere", err[0]), err
    assert err[-2] == "sweep: 1 of 2 cell(s) failed:" and err[-1].startswith("  cell 001_broken: error: ")
    assert "not a complete megahash checkpoint" in err[-1] and "nowhere" in err[-1]
    assert "report of 1/2 cells" in r.stdout and "not done: 001_broken" in r.stdout
    rep = json.loads((out / "report.json").read_text())
    assert [c["cell"] for c in rep["not_done"]] == ["001_broken"] and rep["not_done"][0]["exit"] == 2
    assert rep["not_done"][0]["error"] == err[-1].split(": ", 1)[1]
    md = (out / "report.md").read_text()
    assert f"- 1 001_broken: failed (exit 2): {rep['not_done'][0]['error']}" in md
    # fixed and rerun: the cell trains, its failure record goes
    grid["variants"][1]["overrides"] = {"train.resume": "auto"}
    path.write_text(yaml.safe_dump(grid))
    r = subprocess.run([sys.executable, "-m", "megahash", "sweep", "--grid", str(path), "--out", str(out)],
                       cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=900)
    assert r.returncode == 0 and "already done, skipped" in r.stdout, r.stderr[-3000:]
    assert json.loads((out / "report.json").read_text())["not_done"] == []
    assert not (out / "cells" / "001_broken" / "sweep_failed.json").exists()
