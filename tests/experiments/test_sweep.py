"""``megahash sweep``: a 2x2 grid (uniform:mha / uniform:mlp x seeds 1, 2) of tiny decoders on the
Shakespeare shards, run end to end locally and as a job array on a real local SLURM (two emulated
nodes, megahash/launching/local_slurm.py); reruns skip finished cells; the report has one row per cell, its
parameter counts equal the trained models' own counts, and the SLURM cells train exactly as the
local ones (same losses). Plus dry-run and one-line errors of bad grids.

The SLURM test needs root and the Debian SLURM packages (tests/launching/test_slurm.py installs them)
(LocalSlurm lets one cluster run per machine at a time)."""

import json
import re
import subprocess
import sys

import pytest
import yaml
from _slurm import clean_env

from conftest import ROOT, run, train_losses

TINY = {
    "model.hidden_size": 64,
    "model.num_layers": 2,
    "model.num_heads": 4,
    "model.ffn_hidden_size": 128,
    "model.vocab_size": 0,
    "data.seq_length": 64,
    "train.steps": 12,
    "train.micro_batch_size": 4,
    "train.global_batch_size": 4,
    "train.precision": "fp32",
    "train.warmup_steps": 2,
    "train.lr": 2e-3,
    "train.eval_interval": 6,
    "train.save_interval": 0,
    "train.log_interval": 6,
    "logging.plot": False,
    "logging.tensorboard": False,
}
SCHEDULES = ["uniform:mha", "uniform:mlp"]
SEEDS = [1, 2]
PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def grid(shakespeare_shards, tmp_path_factory):
    d = tmp_path_factory.mktemp("sweep")
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
                "20",
                "--ppl-docs",
                "2",
                "--seed",
                "7",
            ]
        )
        == 0
    )
    spec = {
        "name": "t2x2",
        "config": "quickstart.yaml",
        "overrides": {
            **TINY,
            "data.prefix": [shakespeare_shards["prefix"]],
            "data.tokenizer": shakespeare_shards["tokenizer"],
        },
        "axes": {"model.schedule": SCHEDULES, "train.seed": SEEDS},
        "standard": {"model.schedule": "uniform:mha"},
        "eval": {"tasks_dir": str(d / "tasks"), "tasks": ["shk_next", "shk_ppl"], "limit": 10, "batch_size": 8},
    }
    path = d / "grid.yaml"
    path.write_text(yaml.safe_dump(spec))
    return {"path": path, "dir": d}


def sweep(args, env=None, timeout=900):
    """``megahash sweep ARGS``: forked from the test fork server (tests/_forkserver.py) in the tests' environment,
    a fresh interpreter in a SLURM cluster's (``env``); the cells are the fresh processes the sweep starts."""
    cmd = [sys.executable, "-m", "megahash", "sweep", *args]
    if env is None:
        return run(cmd, timeout=timeout)
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def check_report(out_dir):
    """One row per cell in grid order; deltas against the standard row of the same seed."""
    rep = json.loads((out_dir / "report.json").read_text())
    rows = rep["rows"]
    assert [(r["values"]["model.schedule"], r["values"]["train.seed"]) for r in rows] == [
        (s, seed) for s in SCHEDULES for seed in SEEDS
    ]
    assert rep["missing"] == []
    md = (out_dir / "report.md").read_text().splitlines()
    table = [line for line in md if re.match(r"\| \d+ \| ", line)]
    assert len(table) == 4
    assert "shk_next acc % ↑" in md[2] and "shk_ppl word_perplexity ↓" in md[2] and "Avg. ↑" in md[2]
    assert "#params" in md[2] and "attn FLOPs/tok decode" in md[2] and "cache bytes" in md[2]
    assert [line.split(" | ")[1] for line in table] == ["uniform:mha (standard)"] * 2 + ["uniform:mlp"] * 2
    by = {(r["values"]["model.schedule"], r["values"]["train.seed"]): r for r in rows}
    for seed in SEEDS:
        std, mlp = by["uniform:mha", seed], by["uniform:mlp", seed]
        assert std["standard"] and not mlp["standard"] and mlp["standard_cell"] == std["cell"]
        assert mlp["display"]["shk_next"] == pytest.approx(100 * mlp["scores"]["shk_next"]["value"])
        assert mlp["delta"]["shk_next"] == pytest.approx(mlp["display"]["shk_next"] - std["display"]["shk_next"])
        assert mlp["delta"]["shk_ppl"] == pytest.approx(
            mlp["scores"]["shk_ppl"]["value"] - std["scores"]["shk_ppl"]["value"]
        )
        assert mlp["costs"]["cache_bytes"] == 0 < std["costs"]["cache_bytes"]  # no KV cache without attention
    for png in ("loss_curves.png", "scores.png"):
        assert (out_dir / png).read_bytes()[:8] == PNG
    return rows


@pytest.fixture(scope="module")
def local(grid):
    out = grid["dir"] / "local"
    r = sweep(["--grid", str(grid["path"]), "--out", str(out)])
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
    return {"out": out, "stdout": r.stdout}


@pytest.mark.slow
def test_local_sweep_runs_every_cell_and_reports_one_row_per_cell(local):
    out = local["out"]
    rows = check_report(out)
    cells = sorted((out / "cells").iterdir())
    assert len(cells) == 4 and all((c / "sweep_cell.json").is_file() for c in cells)
    cfgs = [yaml.safe_load((c / "resolved_config.yaml").read_text()) for c in cells]
    assert all(c["data"] == cfgs[0]["data"] for c in cfgs)  # same data and budget in every cell
    assert {c["train"]["steps"] for c in cfgs} == {12} and {c["train"]["global_batch_size"] for c in cfgs} == {4}
    assert [c["train"]["seed"] for c in cfgs] == SEEDS * 2
    for c, row in zip(cells, rows):
        # the report's parameter count (accounting from the config) = the trained model's own count
        m = re.search(r"megahash: ([\d,]+) parameters \(([\d,]+) embedding\)", (c / "sweep.log").read_text())
        assert row["params"]["total"] == int(m.group(1).replace(",", ""))
        assert row["params"]["embedding"] == int(m.group(2).replace(",", ""))
        assert sorted(train_losses(c)) == list(range(1, 13))
        ev = json.loads((c / "eval" / "step_00000012.json").read_text())
        assert ev["step"] == 12 and set(ev["results"]) == {"shk_next", "shk_ppl"}
    # same schedule, different seed: different runs
    assert train_losses(cells[0]) != train_losses(cells[1])


@pytest.mark.slow
def test_local_rerun_skips_finished_cells(grid, local):
    out = local["out"]
    before = {c.name: (c / "metrics.jsonl").stat().st_mtime_ns for c in (out / "cells").iterdir()}
    r = sweep(["--grid", str(grid["path"]), "--out", str(out)])
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count("already done, skipped") == 4 and "training" not in r.stdout
    assert {c.name: (c / "metrics.jsonl").stat().st_mtime_ns for c in (out / "cells").iterdir()} == before
    check_report(out)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.slurm
def test_slurm_array_sweep_matches_local_and_rerun_submits_nothing(cluster, grid, local):
    out = grid["dir"] / "slurm"
    env = cluster.env(clean_env())
    sbatch = ["--sbatch=--cpus-per-task=1", "--sbatch=--time=20"]
    r = sweep(["--grid", str(grid["path"]), "--launcher", "slurm", "--wait", "--out", str(out), *sbatch], env=env)
    logs = "\n".join(p.read_text() for p in sorted((out / "slurm").glob("*.out"))) if (out / "slurm").is_dir() else ""
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:], logs[-5000:])
    job = re.search(r"submitted job array (\d+) \(4 cells\)", r.stdout).group(1)
    outs = sorted((out / "slurm").glob(f"{job}_*.out"))
    assert len(outs) == 4
    for i, p in enumerate(sorted(outs, key=lambda p: int(p.stem.split("_")[1]))):
        text = p.read_text()
        assert f"array task {i}: cell " in text and "ranks exited with status 0" in text, text[-3000:]
        assert "trained; evaluating" in text and "done (step 12)" in text, text[-3000:]
    check_report(out)
    for c in (out / "cells").iterdir():  # the array tasks train exactly as the local runs
        # bit-exact: one path (the same cell, ranks and threads on this machine): the launcher changes nothing
        assert train_losses(c) == train_losses(local["out"] / "cells" / c.name), c.name
    r = sweep(["--grid", str(grid["path"]), "--launcher", "slurm", "--wait", "--out", str(out), *sbatch], env=env)
    assert r.returncode == 0 and "every cell is done; nothing submitted" in r.stdout, r.stderr[-2000:]


def test_dry_run_prints_cells_and_commands(grid, capsys):
    from megahash.experiments import sweep as sw

    out = grid["dir"] / "dry"
    assert sw.main(["--grid", str(grid["path"]), "--out", str(out), "--dry-run"]) == 0
    text = capsys.readouterr().out
    assert "grid t2x2: 4 cells" in text and text.count("  train: ") == 4 and text.count("  eval:  ") == 4
    assert "model.schedule=uniform:mlp train.seed=2" in text and not out.exists()
    assert sw.main(["--grid", str(grid["path"]), "--out", str(out), "--dry-run", "--launcher", "slurm"]) == 0
    assert "--array=0-3" in capsys.readouterr().out


def test_report_only_before_any_cell_finished_says_so(grid, capsys):
    """docs/experiments.md's ``--report-only`` on a grid none of whose cells has finished: one line saying there is
    no report yet, exit 0, nothing written but the plan (before: no output at all)."""
    from megahash.experiments import sweep as sw

    out = grid["dir"] / "nothing_done"
    assert sw.main(["--grid", str(grid["path"]), "--out", str(out), "--report-only"]) == 0
    assert capsys.readouterr().out == f"sweep: no report: none of the 4 cells of t2x2 in {out} is finished yet\n"
    assert not (out / "report.md").exists()


@pytest.mark.parametrize(
    "edit, message",
    [
        ({"axs": {"model.schedule": ["uniform:mha"]}}, "unknown grid key 'axs' in"),
        ({"axes": {"model.schedul": ["uniform:mha"]}}, "unknown config key 'model.schedul' (did you mean 'schedule'?)"),
        ({"axes": {"model.schedule": ["uniform:mha", "uniform:nosuch"]}}, "unknown attention kind 'nosuch'"),
        (
            {"variants": [{"name": "a", "overrides": {}}, {"name": "b", "overrides": {"train.steps": 7}}]},
            "changes train.steps (12 -> 7) without an axis",
        ),
        ({"standard": {"train.lr": 1.0}}, "standard names 'train.lr', which is not an axis"),
        # a cell that would run twice, rows merged, a report without a standard row: they ran silently before
        ({"axes": {"model.schedule": ["uniform:mha", "uniform:mlp", "uniform:mha"]}}, "lists 'uniform:mha' twice"),
        (
            {"variants": [{"name": "a", "overrides": {}}, {"name": "a", "overrides": {"train.lr": 1e-3}}]},
            "two variants are named 'a'",
        ),
        (
            {
                "variants": [
                    {"name": "a", "overrides": {}},
                    {"name": "b", "overrides": {"model.schedule": "uniform:mha"}},
                ]
            },
            "cells 000_a and 001_b resolve to the same config",
        ),
        ({"standard": {"model.schedule": "uniform:gqa"}}, "standard model.schedule='uniform:gqa' is no cell's value"),
        # sections of another shape: ValueError/AttributeError/TypeError tracebacks before
        ({"eval": {"batch_size": "abc"}}, "eval.batch_size must be a whole number >= 1"),
        ({"eval": {"tasks": 5}}, "eval.tasks must be a task name or a list of task names"),
        ({"eval": {"limit": "all"}}, "eval.limit must be a positive number"),
        ({"launch": [1]}, "launch must be a mapping"),
        ({"launch": {"ranks": -3}}, "launch.ranks must be a whole number >= 1"),
        ({"slurm": {"sbatch": 5}}, "slurm.sbatch must be a list of sbatch options"),
        # a million cells: counted before the product is built (the dry run ran for hours before)
        (
            {"axes": {"train.seed": list(range(100)), "data.seed": list(range(100)), "train.lr": [1e-3] * 100}},
            "the grid has 1,000,000 cells",
        ),
    ],
)
def test_bad_grid_is_one_line_error(grid, tmp_path, capsys, edit, message):
    spec = yaml.safe_load(grid["path"].read_text())
    if "standard" not in edit:
        spec.pop("standard")
    spec.update(edit)
    if "variants" in edit:
        spec["axes"] = {}
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(spec))
    from megahash.experiments import sweep as sw

    assert sw.main(["--grid", str(path), "--dry-run"]) == 2
    cap = capsys.readouterr()
    lines = cap.err.strip().splitlines()
    assert cap.out == "" and len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], cap.err


def test_grid_trust_task_code_reaches_the_eval_command(grid, tmp_path, capsys):
    """``eval: {trust_task_code: true}`` passes ``--trust-task-code`` to each cell's ``megahash eval``
    (docs/security.md); absent, it does not; a value that is not a boolean is one line."""
    from megahash.experiments import sweep as sw

    spec = yaml.safe_load(grid["path"].read_text())
    for value, flagged in ((True, 4), (None, 0), ("yes", None)):
        spec["eval"].pop("trust_task_code", None)
        if value is not None:
            spec["eval"]["trust_task_code"] = value
        path = tmp_path / "g.yaml"
        path.write_text(yaml.safe_dump(spec))
        status = sw.main(["--grid", str(path), "--out", str(tmp_path / "out"), "--dry-run"])
        cap = capsys.readouterr()
        if flagged is None:
            assert status == 2 and cap.err.count("\n") == 1 and "eval.trust_task_code must be true or false" in cap.err
        else:
            assert status == 0 and cap.out.count(" --trust-task-code") == flagged, cap.out


def test_grid_tasks_are_checked_before_any_cell_trains(grid, tmp_path, capsys):
    """A task folder that is not there, or task files that run Python without trust_task_code, is one line before
    the first cell trains (before: every cell trained in full, then each failed its evaluation with that line)."""
    from megahash.experiments import sweep as sw

    code_dir = tmp_path / "code_tasks"
    code_dir.mkdir()
    (code_dir / "shk_next.yaml").write_text("task: shk_next\nprocess_docs: !function utils.process\n")
    for args, message in (
        (["--tasks-dir", str(tmp_path / "nowhere")], "is not a directory"),
        (["--tasks-dir", str(code_dir)], "--trust-task-code"),
    ):
        out = tmp_path / "out"
        assert sw.main(["--grid", str(grid["path"]), "--out", str(out), *args]) == 2
        cap = capsys.readouterr()
        lines = cap.err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: grid t2x2, eval: ") and message in lines[0], cap.err
        assert "nothing was run" in lines[0] and "training" not in cap.out and not out.exists()


def test_an_out_that_is_a_file_is_one_line(grid, tmp_path, capsys):
    """--out naming a file, or a folder under a file: one line before anything, in a dry run too (was a
    FileExistsError / NotADirectoryError traceback when the plan was written; the dry run did not notice)."""
    from megahash.experiments import sweep as sw

    (tmp_path / "afile").write_text("x")
    for out, dry, expect in (
        (tmp_path / "afile", [], "is a file; name a folder"),
        (tmp_path / "afile" / "sub", ["--dry-run"], "afile is a file, not a folder"),
    ):
        assert sw.main(["--grid", str(grid["path"]), "--out", str(out), *dry]) == 2
        cap = capsys.readouterr()
        lines = cap.err.strip().splitlines()
        assert cap.out == "" and len(lines) == 1 and lines[0].startswith("error: --out ") and expect in lines[0], cap
    assert (tmp_path / "afile").read_text() == "x"


def test_array_script_outside_slurm_is_one_line_error():
    r = subprocess.run(
        ["bash", "slurm/sweep_array.sh"], cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 2 and r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: slurm/sweep_array.sh must run inside a SLURM job"), r.stderr


@pytest.mark.parametrize(
    "name, cells",
    [
        ("table4_1", 19),
        ("table4_1_tiny", 8),
        ("table2_1", 33),
        ("table2_1_tiny", 6),
        ("table3_2", 35),
        ("table3_2_tiny", 7),
    ],
)
def test_shipped_grids_resolve(name, cells, tmp_path):
    """Every shipped grid resolves to valid cell configs; variants with a config snippet get its keys."""
    from megahash.experiments.grid import cell_config, load_grid

    grid = load_grid(str(ROOT / "configs" / "grids" / f"{name}.yaml"), out=str(tmp_path))
    assert len(grid.cells) == cells and any(
        all(c.values.get(k) == v for k, v in grid.standard.items()) for c in grid.cells
    )
    cfgs = {c.label: cell_config(grid, c) for c in grid.cells if not c.seed or c.seed == grid.cells[0].seed}
    if name.startswith("table2_1"):
        pool = cfgs["MD5 Pool"]
        assert (pool.model.embedding, pool.model.embed.hash_spec, pool.model.embed.options.pool_bits) == (
            "pool",
            "md5",
            10,
        )
        assert {c.train.objective for c in cfgs.values()} == {"sr"} and {c.model.arch for c in cfgs.values()} == {
            "encoder"
        }
    if name.startswith("table4_1"):
        skip = [c for label, c in cfgs.items() if label.startswith("skip")]
        assert skip and all(c.model.attention.skip_nonstandard and c.model.schedule.startswith("hybrid:") for c in skip)
    if name == "table3_2":
        assert {c.model.hidden_size for c in cfgs.values()} == {768} and len(cfgs) == 7


SHORT = ["train.steps=2", "train.eval_interval=2"]


@pytest.fixture(scope="module")
def trained_cell(grid, tmp_path_factory):
    """Cell 0 of the 2x2 grid (uniform:mha, seed 1) trained for 2 steps: a template that the report tests copy
    into the cells they mark done."""
    from conftest import pretrain_here
    from megahash.experiments.grid import load_grid, write_plan

    g = load_grid(str(grid["path"]), SHORT, str(tmp_path_factory.mktemp("template")))
    write_plan(g)
    r = pretrain_here(["--config", str(g.cells[0].dir / "cell_config.yaml")])
    assert r.returncode == 0, r.stderr[-2000:]
    return g.cells[0].dir


def _two_done_cells(grid, trained_cell, out):
    """The grid planned into ``out`` with cells 0 (uniform:mha, the standard) and 2 (uniform:mlp) of seed 1 done:
    the template's checkpoint, metrics and a done record in each (the row's label and values are the cell's)."""
    import shutil

    from megahash.experiments.grid import DONE_FILE, load_grid, write_plan

    g = load_grid(str(grid["path"]), SHORT, str(out))
    write_plan(g)
    for c in (g.cells[0], g.cells[2]):
        shutil.copytree(trained_cell, c.dir, dirs_exist_ok=True, ignore=shutil.ignore_patterns("cell_config.yaml"))
        (c.dir / DONE_FILE).write_text(json.dumps({"cell": c.name, "step": 2}))
    return g, g.cells[0], g.cells[2]


def test_a_diverged_cell_is_nan_in_the_table_and_null_in_standard_json(grid, trained_cell, tmp_path):
    """A cell whose losses went NaN / inf (metrics.jsonl holds the bare words NaN and Infinity): report.md shows
    nan without a delta, report.json is standard JSON (null; it held NaN / Infinity, which strict parsers refuse),
    and the finite numbers agree with metrics.jsonl."""
    from megahash.experiments.grid import cell_config
    from megahash.experiments.grid_report import write_report

    g, std, cell = _two_done_cells(grid, trained_cell, tmp_path / "out")
    path = cell.dir / "metrics.jsonl"
    recs = [json.loads(line) for line in path.read_text().splitlines()]
    lines = []
    for rec in recs:
        line = json.dumps(rec)
        if rec.get("split") in ("train", "valid") and rec["step"] == 2:
            line = line.replace(json.dumps(rec["loss"]), "NaN" if rec["split"] == "valid" else "Infinity")
        lines.append(line)
    path.write_text("\n".join(lines) + "\n")
    assert cell_config(g, cell).model.schedule == "uniform:mlp"
    write_report(g)

    def strict(c):
        raise ValueError(f"not JSON: {c}")

    rep = json.loads((g.out / "report.json").read_text(), parse_constant=strict)
    rows = {r["cell"]: r for r in rep["rows"]}
    valid = [rec["loss"] for rec in recs if rec.get("split") == "valid" and rec["step"] == 2]
    assert rows[std.name]["valid_loss"] == valid[-1] and rows[cell.name]["valid_loss"] is None
    assert rows[cell.name]["train_curve"][1] == [2, None] and rows[cell.name]["delta_valid_loss"] is None
    table = [l for l in (g.out / "report.md").read_text().splitlines() if l.startswith(f"| {cell.index} |")]
    assert table and table[0].endswith("| nan |"), table


def test_a_finished_cell_whose_checkpoint_is_gone_is_listed_and_the_rest_reported(grid, trained_cell, tmp_path, capsys):
    """A finished cell whose checkpoints were removed (to free the disk) or damaged: the report of the other cells is
    written, the cell is listed under "Cells not done" with the one-line reason, the sweep names it and ends 1.
    Before: `--report-only` was that one line and exit 2, no report of any cell."""
    import shutil

    from megahash.experiments import sweep as sw

    out = tmp_path / "out"
    g, std, cell = _two_done_cells(grid, trained_cell, out)
    shutil.rmtree(cell.dir / "step_00000002")
    assert sw.main(["--grid", str(grid["path"]), "--out", str(out), "--report-only", *SHORT]) == 1
    cap = capsys.readouterr()
    rep = json.loads((out / "report.json").read_text())
    assert [r["cell"] for r in rep["rows"]] == [std.name]
    gone = next(c for c in rep["not_done"] if c["cell"] == cell.name)
    assert "finished, but its checkpoint cannot be read" in gone["error"] and "holds no complete" in gone["error"]
    assert f"- {cell.index} {cell.name}: {gone['error']}" in (out / "report.md").read_text()
    assert "report of 1/4 cells" in cap.out and f"sweep: cell {cell.name}: {gone['error']}" in cap.err


def test_the_loss_curve_average_passes_over_a_bad_step():
    """loss_curves.png's moving average of a run with one NaN / inf step (skipped by the step guard, the run went
    on): a gap at that step, and after it the average of the finite losses alone (every later point was NaN)."""
    import math

    from megahash.experiments.grid_report import ema

    losses = [4.0, 3.0, math.nan, 2.0, math.inf, 1.0]
    finite = [4.0, 0.9 * 4.0 + 0.1 * 3.0]
    finite += [0.9 * finite[-1] + 0.1 * 2.0]
    finite += [0.9 * finite[-1] + 0.1 * 1.0]
    got = ema(losses)
    assert math.isnan(got[2]) and math.isnan(got[4])
    assert [got[i] for i in (0, 1, 3, 5)] == pytest.approx(finite)
