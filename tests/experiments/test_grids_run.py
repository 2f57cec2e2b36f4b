"""The README's grids run (issue 28 item 3), cheaply enough for CI:

- every cell of every shipped grid (configs/grids/*.yaml, tiny and full), shrunk by command-line
  overrides to a tiny model and 2 steps ending in a save, trains from the very
  ``cell_config.yaml`` the sweep writes and runs (``megahash sweep`` plans the grid, then each cell
  runs through the pretraining entry point in this process: a fresh interpreter per cell would cost
  ~8 CPU-s of imports each). Cells whose resolved configs are equal but for ``train.seed`` and
  ``train.save_dir`` (a seed axis, the same variant in a tiny and a full grid) run once. The full
  grids' data needs (word shards with every side shard of Table 2.1) are built here;
- the README's command, ``megahash sweep --grid configs/grids/table4_1_tiny.yaml --launcher local``
  (shrunk), runs its hybrid and skip cells end to end: progress lines, evaluation on the offline
  tasks (``data/eval_tasks`` under its working directory, as README step 4 makes them), report;
- a failed cell is named with its one-line error at the end of the sweep and in the report."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, popen, run

GRIDS = sorted((ROOT / "configs" / "grids").glob("*.yaml"))
SHRINK = [
    "model.hidden_size=64",
    "model.num_layers=2",
    "model.num_heads=4",
    "model.ffn_hidden_size=128",
    "model.num_query_groups=0",
    "model.vocab_size=0",
    "model.max_position_embeddings=128",
    "model.attention.options.fixed_seq_length=64",
    "data.seq_length=64",
    "data.valid_samples=8",
    "train.steps=2",
    "train.save_interval=0",
    "train.eval_interval=2",
    "train.micro_batch_size=2",
    "train.global_batch_size=2",
    "train.warmup_steps=1",
    "train.log_interval=1",
    "train.precision=fp32",
    "logging.plot=false",
    "logging.tensorboard=false",
]


@pytest.fixture(scope="module")
def workdir(shakespeare_shards, tmp_path_factory):
    """A working directory with README step 4's offline tasks (data/eval_tasks) and a word-level shard
    set carrying every side shard the cells of the word-level grids (Table 2.1) read."""
    d = tmp_path_factory.mktemp("grids")
    from megahash.data.preprocess import make_eval_tasks

    assert (
        make_eval_tasks.main(
            [
                "--source",
                "shakespeare",
                "--out",
                str(d / "data" / "eval_tasks"),
                "--held-out-docs",
                "1100:",
                "--n",
                "8",
                "--ppl-docs",
                "1",
                "--seed",
                "7",
            ]
        )
        == 0
    )
    words = d / "words" / "shk"
    specs = ",".join(_word_specs())
    r = run(  # forked from the test fork server (tests/_forkserver.py): the preprocessing, not a fresh interpreter
        [
            sys.executable,
            "data_tools/preprocess_data.py",
            "--input",
            "shakespeare",
            "--output-prefix",
            str(words),
            "--tokenizer",
            "words",
            "--word-hashes",
            specs,
            "--workers",
            "1",
            "--max-docs",
            "60",
            "--quiet",
        ],
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    return {"dir": d, "words": str(words), "shards": shakespeare_shards}


def _word_specs() -> list[str]:
    """The hash specs of every cell of the word-level grids (their headers list them)."""
    from megahash import catalog
    from megahash.experiments.grid import cell_config, load_grid

    specs = set()
    for path in GRIDS:
        grid = load_grid(str(path), ["data.prefix=[unused]"])
        for cell in grid.cells:
            cfg = cell_config(grid, cell)
            if cfg.data.tokenizer == "words" and catalog.reads_hash_codes(cfg):
                specs.add(cfg.model.embed.hash_spec)
    text = {p.stem: p.read_text() for p in GRIDS}
    for spec in specs:  # the grid file's header names every side shard its cells need
        assert any(spec in t for t in text.values()), f"no grid header names the side shard {spec}"
    return sorted(specs)


def _data(path: Path, workdir) -> list[str]:
    """The grid's data, here: the word shards for a word-level grid, else the Shakespeare BPE shards."""
    import yaml

    words = (yaml.safe_load(path.read_text()).get("overrides") or {}).get("data.tokenizer") == "words"
    shards = workdir["shards"]
    return [
        f"data.prefix=[{workdir['words'] if words else shards['prefix']}]",
        f"data.tokenizer={'words' if words else shards['tokenizer']}",
    ]


def _distinct_cells(tmp_path, workdir):
    """(grid name, cell) of every cell of every shipped grid, planned by the sweep (``write_plan``),
    one per distinct resolved config (seed and save_dir aside)."""
    import yaml

    from megahash.experiments.grid import CELL_CONFIG, load_grid, write_plan

    seen, out, total = set(), [], 0
    for path in GRIDS:
        grid = load_grid(str(path), SHRINK + _data(path, workdir), str(tmp_path / path.stem))
        write_plan(grid)
        total += len(grid.cells)
        for cell in grid.cells:
            tree = yaml.safe_load((cell.dir / CELL_CONFIG).read_text())
            tree["train"].pop("seed"), tree["train"].pop("save_dir")
            key = json.dumps(tree, sort_keys=True)
            if key not in seen:
                seen.add(key)
                out.append((grid.name, cell))
    return out, total


@pytest.mark.slow
def test_every_cell_of_every_shipped_grid_trains_and_saves(workdir, tmp_path, capsys):
    from megahash.experiments.grid import CELL_CONFIG
    from megahash.pretrain import main

    cells, total = _distinct_cells(tmp_path, workdir)
    assert total == sum(len(load(p)) for p in GRIDS) and len(cells) >= 40, (total, len(cells))
    failed = []
    for grid, cell in cells:
        status = main(["--config", str(cell.dir / CELL_CONFIG)])
        cap = capsys.readouterr()
        ok = status == 0 and (cell.dir / "latest").read_text() == "step_00000002"
        if not ok:
            failed.append(f"{grid} {cell.name}: exit {status}: {(cap.err.strip().splitlines() or ['?'])[-1]}")
    assert not failed, "\n".join(failed)


def load(path: Path) -> list:
    """The cells of a grid file (no config checks)."""
    import yaml

    spec = yaml.safe_load(path.read_text())
    n = 1
    for values in (spec.get("axes") or {}).values():
        n *= len(values)
    return [None] * (n * max(1, len(spec.get("variants") or [])))


@pytest.mark.slow
def test_the_readme_grid_runs_through_the_sweep(workdir, tmp_path):
    """README step 8's command on its hybrid and skip cells (the skip cell could never save before)."""
    from megahash.experiments.grid import load_grid

    path = ROOT / "configs" / "grids" / "table4_1_tiny.yaml"
    data = _data(path, workdir)
    out = tmp_path / "t41"
    grid = load_grid(str(path), SHRINK + data, str(out))
    cells = [c.index for c in grid.cells if c.label in ("standard", "hybrid rndembqk", "skip rndembqk")]
    assert len(cells) == 3
    p = popen(  # the sweep forked from the test fork server; its cells are fresh interpreters, as the sweep starts them
        [
            sys.executable,
            "-m",
            "megahash",
            "sweep",
            "--grid",
            str(path),
            "--launcher",
            "local",
            "--out",
            str(out),
            "--cells",
            ",".join(map(str, cells)),
            "--limit",
            "4",
            *SHRINK,
            *data,
        ],
        subprocess.PIPE,
        subprocess.PIPE,
        cwd=workdir["dir"],
    )
    stdout, stderr = p.communicate(timeout=1800)
    r = subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr)
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
    started = re.findall(r"sweep: \[(\d)/3\] cell (\S+): training \(", r.stdout)
    done = re.findall(r"sweep: \[(\d)/3\] cell (\S+): done \(step 2\) in \d+", r.stdout)
    names = [grid.cells[i].name for i in cells]
    assert started == done == [(str(k + 1), n) for k, n in enumerate(names)], r.stdout[-3000:]
    rep = json.loads((out / "report.json").read_text())
    assert [row["cell"] for row in rep["rows"]] == names
    spec_tasks = ["shk_next", "shk_order", "shk_lastword", "shk_ppl"]
    for row in rep["rows"]:
        assert sorted(row["scores"]) == sorted(spec_tasks) and row["valid_loss"] is not None, row["cell"]
        assert [s for s, _ in row["train_curve"]] == [1, 2], row["cell"]
    assert [c["cell"] for c in rep["not_done"]] == [c.name for c in grid.cells if c.index not in cells]
    assert all(c["error"] is None for c in rep["not_done"])  # not run: no error to name


def test_a_failed_cell_is_named_with_its_error_at_the_end_and_in_the_report(workdir, tmp_path):
    """Two cells, the second of which cannot train (it resumes from a checkpoint that does not exist): the sweep
    goes on, ends with exit 1 naming the cell and its one-line error, and the report lists it."""
    import yaml

    shards = workdir["shards"]
    grid = {
        "name": "fails",
        "config": "quickstart.yaml",
        "overrides": SHRINK + [f"data.tokenizer={shards['tokenizer']}", f"data.prefix=[{shards['prefix']}]"],
        "variants": [
            {"name": "ok", "overrides": {}},
            {"name": "broken", "overrides": {"train.resume": str(tmp_path / "nowhere")}},
        ],
    }
    path = tmp_path / "fails.yaml"
    path.write_text(yaml.safe_dump(grid))
    out = tmp_path / "out"
    r = run([sys.executable, "-m", "megahash", "sweep", "--grid", str(path), "--out", str(out)], timeout=900)
    assert r.returncode == 1, (r.stdout[-3000:], r.stderr[-3000:])
    assert re.search(r"sweep: \[1/2\] cell 000_ok: done \(step 2\) in \d+", r.stdout), r.stdout
    err = r.stderr.strip().splitlines()
    assert re.match(
        r"sweep: \[2/2\] cell 001_broken: FAILED after \d+s \(exit 2\): error: train.resume=.*nowhere", err[0]
    ), err
    assert err[-2] == "sweep: 1 of 2 cell(s) failed:" and err[-1].startswith("  cell 001_broken: error: ")
    assert "not a complete megahash checkpoint" in err[-1] and "nowhere" in err[-1]
    assert "report of 1/2 cells" in r.stdout and "not done: 001_broken" in r.stdout
    rep = json.loads((out / "report.json").read_text())
    assert [c["cell"] for c in rep["not_done"]] == ["001_broken"] and rep["not_done"][0]["exit"] == 2
    assert rep["not_done"][0]["error"] == err[-1].split(": ", 1)[1]
    md = (out / "report.md").read_text()
    assert f"- 1 001_broken: failed (exit 2): {rep['not_done'][0]['error']}" in md
    # fixed and rerun: the cell trains, its failure record goes
    grid["variants"][1]["overrides"] = {"train.resume": "auto", "model.init_std": 0.03}  # not 000_ok's config again
    path.write_text(yaml.safe_dump(grid))
    r = run([sys.executable, "-m", "megahash", "sweep", "--grid", str(path), "--out", str(out)], timeout=900)
    assert r.returncode == 0 and "already done, skipped" in r.stdout, r.stderr[-3000:]
    assert json.loads((out / "report.json").read_text())["not_done"] == []
    assert not (out / "cells" / "001_broken" / "sweep_failed.json").exists()
