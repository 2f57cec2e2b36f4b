"""``megahash sweep``: a grid of configs run, evaluated and reported as one reproducible unit.

    megahash sweep --grid configs/grids/table4_1_tiny.yaml [--launcher local|slurm] [--dry-run]
                   [--out DIR] [--wait] [--report-only] [--sbatch=--time=4:00:00 ...] [--cells 0-3,7]
                   [--tasks T1,T2|none] [--tasks-dir DIR] [--limit N] [key=value ...]

A grid file (YAML) is a base config plus axes::

    name: table4_1_tiny
    config: ../quickstart.yaml            # base config (relative to the grid file, or to configs/)
    overrides: {train.steps: 100}         # on top of the base, for every cell (mapping or key=value list)
    axes:                                 # cartesian product of dotted keys -> lists of values
      model.schedule: [uniform:mha, uniform:mlp]
      train.seed: [1234, 1235]            # an axis whose key ends in "seed" is a repetition, not a variant
    variants:                             # optional, crossed with the axes: named override sets, each
      - {name: md5-pool, config: embeddings/md5-pool.yaml, overrides: {train.objective: sr}}  # + a snippet
    standard: {model.schedule: uniform:mha}   # the row deltas are measured against (default: first values)
    eval: {tasks_dir: data/eval_tasks, tasks: [shk_next, shk_order], limit: 100, batch_size: 8}
    launch: {ranks: 1}                    # ranks per cell (local: deepspeed launcher when > 1)
    slurm: {sbatch: [--time=04:00:00]}    # extra sbatch options of the array job
    out: runs/grids/table4_1_tiny         # default runs/grids/NAME

Every cell resolves to one config (base + overrides + trailing command-line overrides + the cell's
values + ``train.save_dir=OUT/cells/CELL``): the same data, seed and budget unless an axis changes
them (checked: cells that differ in any data.*, train.steps/global_batch_size/seed key that is not an
axis are refused). The resolved config is written to ``OUT/cells/CELL/cell_config.yaml``.

- ``--launcher local`` (default): cells run one after another through the normal pretraining entry
  (``megahash/pretrain.py``, resumable: ``train.resume=auto``), then ``megahash eval`` on the grid's
  tasks, one progress line as each cell starts and ends (elapsed time, status); a finished cell has
  ``OUT/cells/CELL/sweep_cell.json`` and is skipped on rerun. A failed cell does not stop the sweep:
  its exit status and one-line error go to ``OUT/cells/CELL/sweep_failed.json``, the end of the
  sweep lists every failed cell with its error, and so does the report (exit status 1).
- ``--launcher slurm``: one SLURM job array (``slurm/sweep_array.sh``, one task per cell): each task
  is a normal megahash SLURM training (slurm/_common.sh: signal -> checkpoint -> requeue -> resume),
  then evaluates its cell; finished cells exit at once. ``--wait`` waits for the array and writes
  the report; otherwise rerun with ``--report-only`` (or rerun the sweep locally: it skips finished
  cells) when the array is done.
- ``--dry-run`` prints the cells and the commands without running anything.
- ``--cells 0-3,7`` runs only those cells (indices as ``--dry-run`` prints them); the others keep
  their state. ``--tasks``/``--tasks-dir``/``--limit`` replace the grid's evaluation (``--tasks none``:
  validation loss only), e.g. the offline task suite on a machine without the Hugging Face Hub.

When cells are finished, ``OUT/report.{md,json}`` ([Xue25] Table 4.1 layout: rows = cells, columns =
tasks + average with deltas against the standard row, parameter and cost columns) and
``OUT/loss_curves.png`` / ``OUT/scores.png`` are written (:mod:`megahash.experiments.grid_report`).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from megahash import safe_yaml
from megahash.atomic_write import write_text_atomic
from megahash.config_files import CONFIG_ROOT
from megahash.errors import ConfigError, MegahashError, one_line
from megahash.experiments.cell_failures import FAILED_FILE, error_line, failure, record_failure

ROOT = Path(__file__).resolve().parent.parent.parent
DONE_FILE = "sweep_cell.json"
CELL_CONFIG = "cell_config.yaml"
GRID_KEYS = {
    "name",
    "config",
    "overrides",
    "axes",
    "variants",
    "standard",
    "eval",
    "launch",
    "slurm",
    "out",
    "description",
    "expected",
}
SAME_BUDGET = (
    "train.steps",
    "train.global_batch_size",
    "train.seed",
    "data.seed",
    "data.seq_length",
    "data.prefix",
    "data.split",
    "data.tokenizer",
)


@dataclass
class Cell:
    index: int
    name: str
    label: str  # the variant (every non-seed value)
    seed: str  # the repetition ("" without a seed axis)
    values: dict  # dotted key (or "variant") -> value
    overrides: list[str]
    dir: Path

    @property
    def done(self) -> bool:
        """Trained (and evaluated): its DONE_FILE exists."""
        return (self.dir / DONE_FILE).is_file()


@dataclass
class Grid:
    name: str
    path: Path | None
    base: str | None
    overrides: list[str]
    cells: list[Cell]
    standard: dict
    eval: dict
    ranks: int
    sbatch: list[str]
    out: Path
    expected: str = ""
    seed_keys: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        return {
            "megahash_sweep": 1,
            "name": self.name,
            "grid": str(self.path) if self.path else None,
            "base": self.base,
            "overrides": self.overrides,
            "standard": self.standard,
            "eval": self.eval,
            "ranks": self.ranks,
            "sbatch": self.sbatch,
            "out": str(self.out),
            "seed_keys": self.seed_keys,
            "expected": self.expected,
            "cells": [
                {
                    "index": c.index,
                    "name": c.name,
                    "label": c.label,
                    "seed": c.seed,
                    "values": c.values,
                    "overrides": c.overrides,
                    "dir": str(c.dir),
                }
                for c in self.cells
            ],
        }

    @classmethod
    def from_json(cls, d: dict) -> Grid:
        cells = [
            Cell(c["index"], c["name"], c["label"], c["seed"], c["values"], c["overrides"], Path(c["dir"]))
            for c in d["cells"]
        ]
        return cls(
            d["name"],
            Path(d["grid"]) if d.get("grid") else None,
            d["base"],
            d["overrides"],
            cells,
            d["standard"],
            d["eval"],
            d["ranks"],
            d["sbatch"],
            Path(d["out"]),
            d.get("expected", ""),
            d.get("seed_keys", []),
        )


# ------------------------------------------------------------------------------------------ grid


def override_text(key: str, value) -> str:
    """``key=value`` that :func:`megahash.config.parse_override` reads back as ``value``."""
    if isinstance(value, str):
        try:
            if safe_yaml.load(value, f"grid value of {key}") == value:
                return f"{key}={value}"
        except yaml.YAMLError:
            pass
    return f"{key}={json.dumps(value)}"


def _overrides(spec, where: str) -> list[str]:
    if spec is None:
        return []
    if isinstance(spec, dict):
        return [override_text(k, v) for k, v in spec.items()]
    if isinstance(spec, list) and all(isinstance(x, str) and "=" in x for x in spec):
        return list(spec)
    raise ConfigError(f"{where} must be a mapping of dotted keys to values or a list of key=value strings")


def _flatten(tree: dict, prefix: str = "") -> list[str]:
    out = []
    for k, v in tree.items():
        if isinstance(v, dict):
            out += _flatten(v, f"{prefix}{k}.")
        else:
            out.append(override_text(f"{prefix}{k}", v))
    return out


def _snippet(name: str | None, grid_dir: Path) -> list[str]:
    """A variant's ``config:`` (a YAML snippet, e.g. embeddings/md5-pool.yaml) as dotted overrides."""
    if not name:
        return []
    from megahash.config import _load_yaml_tree

    return _flatten(_load_yaml_tree(Path(_resolve_base(name, grid_dir))))


def _slug(value) -> str:
    text = value if isinstance(value, str) else json.dumps(value)
    out = "".join(ch if ch.isalnum() or ch in "-_." else ("+" if ch == "," else "-") for ch in text)
    return out.strip("-") or "x"


def _resolve_base(name: str | None, grid_dir: Path) -> str | None:
    if not name:
        return None
    for cand in (grid_dir / name, CONFIG_ROOT / name, Path(name)):
        if cand.is_file():
            return str(cand.resolve())
    raise ConfigError(f"grid config {name!r} not found (looked beside the grid file and in {CONFIG_ROOT})")


def load_grid(path: str, extra: Sequence[str] = (), out: str | None = None) -> Grid:
    """Read a grid YAML into its cells (each cell's config is resolved and checked)."""
    from megahash.config import read_yaml_mapping

    p = Path(path)
    data = read_yaml_mapping(path, "grid")
    unknown = sorted(set(data) - GRID_KEYS)
    if unknown:
        import difflib

        close = difflib.get_close_matches(unknown[0], sorted(GRID_KEYS), n=1)
        raise ConfigError(
            f"unknown grid key {unknown[0]!r} in {path}"
            + (f" (did you mean {close[0]!r}?)" if close else f" (valid: {', '.join(sorted(GRID_KEYS))})")
        )
    name = str(data.get("name") or p.stem)
    base = _resolve_base(data.get("config"), p.parent)
    overrides = _overrides(data.get("overrides"), f"{path}: overrides") + list(extra)
    axes = data.get("axes") or {}
    if not isinstance(axes, dict) or not all(isinstance(v, list) and v for v in axes.values()):
        raise ConfigError(f"{path}: axes must map dotted config keys to non-empty lists of values")
    variants = data.get("variants") or []
    if not isinstance(variants, list) or not all(isinstance(v, dict) and v.get("name") for v in variants):
        raise ConfigError(f"{path}: variants must be a list of {{name: ..., overrides: {{...}}}}")
    if not axes and not variants:
        raise ConfigError(f"{path}: a grid needs axes (dotted key -> list) or variants")
    seed_keys = [k for k in axes if k.split(".")[-1].endswith("seed")]
    out_dir = Path(out or data.get("out") or f"runs/grids/{name}").resolve()
    cells: list[Cell] = []
    keys = list(axes)
    var_list = variants or [None]
    for var, combo in itertools.product(var_list, itertools.product(*(axes[k] for k in keys))):
        values = dict(zip(keys, combo))
        if var is not None:
            values = {"variant": var["name"], **values}
        label = " · ".join(str(v) for k, v in values.items() if k not in seed_keys) or "cell"
        seed = ",".join(str(values[k]) for k in seed_keys)
        slug = "__".join(f"{k.split('.')[-1]}={_slug(v)}" if k != "variant" else _slug(v) for k, v in values.items())
        cell_dir = out_dir / "cells" / f"{len(cells):03d}_{slug}"[:200]
        ov = list(overrides)
        if var is not None:
            ov += _snippet(var.get("config"), p.parent) + _overrides(
                var.get("overrides"), f"{path}: variant {var['name']}"
            )
        ov += [override_text(k, v) for k, v in values.items() if k != "variant"]
        ov.append(f"train.save_dir={cell_dir}")
        cells.append(Cell(len(cells), cell_dir.name, label, seed, values, ov, cell_dir))
    standard = data.get("standard")
    if standard is None:
        standard = {k: v[0] for k, v in axes.items() if k not in seed_keys}
        if variants:
            standard = {"variant": variants[0]["name"], **standard}
    if not isinstance(standard, dict):
        raise ConfigError(f"{path}: standard must map axis keys to values")
    bad = [k for k in standard if k not in axes and k != "variant"]
    if bad:
        raise ConfigError(f"{path}: standard names {bad[0]!r}, which is not an axis ({', '.join(axes)})")
    ev = data.get("eval") or {}
    if not isinstance(ev, dict):
        raise ConfigError(f"{path}: eval must be a mapping (tasks, tasks_dir, limit, batch_size)")
    tasks = ev.get("tasks") or []
    ev = {
        "tasks": [tasks] if isinstance(tasks, str) else list(tasks),
        "tasks_dir": ev.get("tasks_dir"),
        "limit": ev.get("limit"),
        "batch_size": int(ev.get("batch_size", 8)),
        "trust_task_code": ev.get("trust_task_code") is True,  # task files that run Python (docs/security.md)
    }
    if ev["tasks_dir"] and not Path(ev["tasks_dir"]).is_absolute():
        ev["tasks_dir"] = str((Path.cwd() / ev["tasks_dir"]).resolve())
    launch = data.get("launch") or {}
    slurm = data.get("slurm") or {}
    grid = Grid(
        name,
        p.resolve(),
        base,
        overrides,
        cells,
        standard,
        ev,
        int(launch.get("ranks", 1)),
        [str(x) for x in slurm.get("sbatch", [])],
        out_dir,
        str(data.get("expected") or ""),
        seed_keys,
    )
    check_cells(grid, set(axes))
    return grid


def cell_config(grid: Grid, cell: Cell):
    from megahash.config import load_config

    try:
        return load_config(grid.base, cell.overrides)
    except ConfigError as e:
        raise ConfigError(f"grid {grid.name}, cell {cell.name}: {e}") from None


def check_cells(grid: Grid, axis_keys: set) -> None:
    """Every cell's config resolves, and cells share data, seed and budget unless an axis varies them."""

    def get(tree, dotted):
        for part in dotted.split("."):
            tree = tree[part]
        return tree

    from megahash.models.registry import schedule_kinds

    ref = None
    for cell in grid.cells:
        cfg = cell_config(grid, cell)
        try:
            schedule_kinds(cfg)  # unknown attention kinds / bad schedules fail before anything runs
        except ConfigError as e:
            raise ConfigError(f"grid {grid.name}, cell {cell.name}: {e}") from None
        tree = cfg.to_dict()
        same = {k: get(tree, k) for k in SAME_BUDGET if k not in axis_keys}
        if ref is None:
            ref = same
        elif same != ref:
            k = next(k for k in same if same[k] != ref[k])
            raise ConfigError(
                f"grid {grid.name}: cell {cell.name} changes {k} ({ref[k]!r} -> {same[k]!r}) "
                f"without an axis; every cell must get the same data, seed and budget"
            )


# ------------------------------------------------------------------------------------------ cells


def is_done(cell: Cell) -> bool:
    return cell.done


def select_cells(grid: Grid, spec: str | None) -> list[Cell]:
    """The cells of ``--cells`` (``0-3,7``: indices and ranges); every cell without one."""
    if not spec:
        return list(grid.cells)
    chosen = set()
    for part in str(spec).split(","):
        try:
            lo, _, hi = part.strip().partition("-")
            chosen.update(range(int(lo), int(hi or lo) + 1))
        except ValueError:
            raise ConfigError(f"--cells {spec!r}: use cell indices and ranges like 0-3,7") from None
    bad = sorted(i for i in chosen if not 0 <= i < len(grid.cells))
    if bad:
        raise ConfigError(f"--cells {spec!r}: grid {grid.name} has cells 0-{len(grid.cells) - 1}, not {bad[0]}")
    return [c for c in grid.cells if c.index in chosen]


def override_eval(grid: Grid, tasks: str | None, tasks_dir: str | None, limit: float | None) -> None:
    """``--tasks``/``--tasks-dir``/``--limit`` in place of the grid's ``eval`` (``--tasks none``: none)."""
    if tasks is not None:
        grid.eval["tasks"] = [] if tasks.strip().lower() == "none" else [t for t in tasks.split(",") if t.strip()]
    if tasks_dir is not None:
        grid.eval["tasks_dir"] = str(Path(tasks_dir).resolve())
    if limit is not None:
        grid.eval["limit"] = limit


def trained_step(cell: Cell) -> int:
    latest = cell.dir / "latest"
    try:
        tag = latest.read_text().strip()
        state = json.loads((cell.dir / tag / "megahash_state.json").read_text())
        return int(state.get("step", 0))
    except (OSError, ValueError):
        return 0


def write_plan(grid: Grid) -> None:
    """grid.json, cells.txt (array index -> cell) and every cell's resolved config (atomic writes)."""
    from megahash.config import save_config

    grid.out.mkdir(parents=True, exist_ok=True)
    for cell in grid.cells:
        save_config(cell_config(grid, cell), cell.dir / CELL_CONFIG)
    _atomic(grid.out / "grid.json", json.dumps(grid.to_json(), indent=1) + "\n")
    _atomic(grid.out / "cells.txt", "".join(c.name + "\n" for c in grid.cells))


_atomic = write_text_atomic


def train_command(grid: Grid, cell: Cell) -> list[str]:
    cfg = str(cell.dir / CELL_CONFIG)
    if grid.ranks <= 1:
        return [sys.executable, str(ROOT / "megahash" / "pretrain.py"), "--config", cfg]
    return [
        sys.executable,
        "-m",
        "launch",
        "--launcher",
        "deepspeed",
        "--nproc-per-node",
        str(grid.ranks),
        "--config",
        cfg,
    ]


def eval_command(grid: Grid, cell: Cell) -> list[str]:
    ev = grid.eval
    cmd = [
        sys.executable,
        "-m",
        "megahash",
        "eval",
        "--checkpoint",
        str(cell.dir),
        "--tasks",
        ",".join(ev["tasks"]),
        "--batch-size",
        str(ev["batch_size"]),
    ]
    if ev.get("tasks_dir"):
        cmd += ["--tasks-dir", ev["tasks_dir"]]
    if ev.get("limit") is not None:
        cmd += ["--limit", str(ev["limit"])]
    if ev.get("trust_task_code"):
        cmd.append("--trust-task-code")
    return cmd


def _env() -> dict:
    """Environment of a cell's processes: this one's, without rank/rendezvous variables (an in-process
    evaluation sets them for its 1-rank group, whose port may still be bound)."""
    from megahash.launching.env import LAUNCHER_VARS

    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def evaluate_cell(grid: Grid, cell: Cell, out: Path) -> None:
    """``megahash eval`` of the cell's newest checkpoint on the grid's tasks, in this process (the
    same code as ``eval_command``; one model load, no extra interpreter start per cell)."""
    import warnings

    from megahash import accelerator
    from megahash.eval.run import _quiet_logs, evaluate_checkpoint

    warnings.filterwarnings("ignore")
    _quiet_logs()
    ev = grid.eval
    limit = ev.get("limit")
    limit = int(limit) if limit is not None and limit >= 1 else limit
    try:
        evaluate_checkpoint(
            cell.dir,
            ev["tasks"],
            ev.get("tasks_dir"),
            out,
            limit,
            ev["batch_size"],
            quiet=True,
            isolated=False,
            trust_task_code=bool(ev.get("trust_task_code")),
        )
    finally:
        accelerator.teardown(barrier=False)


def finish_cell(grid: Grid, cell: Cell, quiet: bool = False) -> dict:
    """Evaluate a trained cell on the grid's tasks and mark it done (``sweep_cell.json``)."""
    step = trained_step(cell)
    from megahash.config import load_config

    steps = load_config(str(cell.dir / CELL_CONFIG)).train.steps
    if step < steps:
        raise MegahashError(f"cell {cell.name} is not trained to train.steps={steps} (newest checkpoint: step {step})")
    record = {
        "cell": cell.name,
        "label": cell.label,
        "seed": cell.seed,
        "values": cell.values,
        "step": step,
        "eval": None,
    }
    if grid.eval["tasks"]:
        out = cell.dir / "eval" / f"step_{step:08d}.json"
        if not out.is_file():
            evaluate_cell(grid, cell, out)
        record["eval"] = str(out)
    record["finished"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    _atomic(cell.dir / DONE_FILE, json.dumps(record, indent=1) + "\n")
    if not quiet:
        print(f"sweep: cell {cell.name} done (step {step})", flush=True)
    return record


def _elapsed(seconds: float) -> str:
    m, sec = divmod(int(round(seconds)), 60)
    return f"{m}m{sec:02d}s" if m else f"{sec}s"


def run_local(grid: Grid, quiet: bool = False, cells: list | None = None) -> int:
    """Train and evaluate every unfinished cell in turn, one progress line as each starts and ends
    (elapsed, status). A failed cell is recorded (``FAILED_FILE``: exit status and its one-line
    error), the sweep goes on with the next cell, and the failures are listed at the end."""
    failed = []
    cells = grid.cells if cells is None else cells
    n = len(cells)
    for i, cell in enumerate(cells):
        tag = f"sweep: [{i + 1}/{n}] cell {cell.name}"
        if is_done(cell):
            print(f"sweep: cell {cell.index} {cell.name} already done, skipped", flush=True)
            continue
        print(f"{tag}: training ({' '.join(cell.overrides[len(grid.overrides) : -1])})", flush=True)
        t0 = time.time()
        for _attempt in range(3):
            start = (cell.dir / "sweep.log").stat().st_size if (cell.dir / "sweep.log").exists() else 0
            with open(cell.dir / "sweep.log", "a") as log:
                r = subprocess.run(
                    train_command(grid, cell), cwd=ROOT, env=_env(), stdout=log, stderr=subprocess.STDOUT
                )
            with open(cell.dir / "sweep.log", "rb") as log:
                log.seek(start)
                new = log.read().decode(errors="replace")
            # another job took the rendezvous port between its choice and its use: start again (resumes)
            if r.returncode == 0 or "address already in use" not in new.lower():
                break
            print(f"{tag}: rendezvous port taken by another process; retrying", flush=True)
        if r.returncode == 3:
            print(
                f"{tag}: stopped on a signal after checkpointing ({_elapsed(time.time() - t0)}); rerun the sweep "
                f"to resume",
                flush=True,
            )
            return 3
        if r.returncode != 0:
            error = error_line(new)
            record_failure(cell, r.returncode, error)
            print(
                f"{tag}: FAILED after {_elapsed(time.time() - t0)} (exit {r.returncode}): {error}; "
                f"log {cell.dir / 'sweep.log'}",
                file=sys.stderr,
                flush=True,
            )
            failed.append(cell)
            continue
        trained = time.time() - t0
        if grid.eval["tasks"]:
            print(f"{tag}: trained in {_elapsed(trained)}; evaluating", flush=True)
        try:
            record = finish_cell(grid, cell, quiet=True)
        except MegahashError as e:
            record_failure(cell, 1, f"error: {one_line(e)}")
            print(f"{tag}: FAILED after {_elapsed(time.time() - t0)}: {one_line(e)}", file=sys.stderr, flush=True)
            failed.append(cell)
            continue
        (cell.dir / FAILED_FILE).unlink(missing_ok=True)
        print(f"{tag}: done (step {record['step']}) in {_elapsed(time.time() - t0)}", flush=True)
    if failed:
        print(f"sweep: {len(failed)} of {n} cell(s) failed:", file=sys.stderr, flush=True)
        for cell in failed:
            print(f"  cell {cell.name}: {failure(cell)['error']}", file=sys.stderr, flush=True)
    return 1 if failed else 0


# ------------------------------------------------------------------------------------------ slurm

ARRAY_SCRIPT = "slurm/sweep_array.sh"
FINAL = (
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "BOOT_FAIL",
    "DEADLINE",
    "PREEMPTED",
)


def sbatch_command(grid: Grid, extra: Sequence[str] = (), cells: list | None = None) -> list[str]:
    n = len(grid.cells)
    (grid.out / "slurm").mkdir(parents=True, exist_ok=True)
    array = f"0-{n - 1}" if cells is None or len(cells) == n else ",".join(str(c.index) for c in cells)
    return [
        "sbatch",
        "--parsable",
        f"--array={array}",
        f"--job-name=megahash-sweep-{grid.name}",
        "-o",
        str(grid.out / "slurm" / "%A_%a.out"),
        *grid.sbatch,
        *extra,
        str(ROOT / ARRAY_SCRIPT),
    ]


def submit_array(grid: Grid, extra: Sequence[str] = (), cells: list | None = None) -> str:
    env = _env()
    env["SWEEP_DIR"] = str(grid.out)
    env.setdefault("PYTHON", sys.executable)
    env["MEGAHASH_ROOT"] = str(ROOT)
    r = subprocess.run(sbatch_command(grid, extra, cells), cwd=ROOT, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        raise MegahashError(f"sbatch refused the sweep array: {(r.stderr.strip().splitlines() or ['?'])[-1]}")
    job = r.stdout.strip().split(";")[0]
    print(
        f"sweep: submitted job array {job} ({len(cells if cells is not None else grid.cells)} cells); outputs "
        f"{grid.out / 'slurm'}",
        flush=True,
    )
    return job


def array_states(job: str) -> list[str]:
    r = subprocess.run(["scontrol", "-o", "show", "job", job], capture_output=True, text=True)
    if r.returncode != 0:
        return []  # purged: finished long ago
    return [line.split("JobState=", 1)[1].split()[0] for line in r.stdout.splitlines() if "JobState=" in line]


def wait_array(job: str, poll: float = 2.0, timeout: float | None = None) -> None:
    start = time.time()
    while True:
        states = array_states(job)
        if all(s in FINAL for s in states):
            return
        if timeout and time.time() - start > timeout:
            raise MegahashError(f"job array {job} not finished after {timeout:.0f}s ({', '.join(sorted(set(states)))})")
        time.sleep(poll)


# ------------------------------------------------------------------------------------------ cli


def dry_run(grid: Grid, launcher: str, extra_sbatch: Sequence[str], cells: list | None = None) -> None:
    cells = grid.cells if cells is None else cells
    print(
        f"grid {grid.name}: {len(grid.cells)} cells -> {grid.out}"
        + (f" ({len(cells)} selected)" if len(cells) != len(grid.cells) else "")
    )
    print(f"standard row: {grid.standard}; eval: {grid.eval['tasks'] or 'none (validation loss only)'}")
    for cell in cells:
        state = "done" if is_done(cell) else (f"trained to step {trained_step(cell)}" if trained_step(cell) else "todo")
        print(f"\n[{cell.index}] {cell.name}  ({state})\n  values: {json.dumps(cell.values)}")
        if launcher == "local":
            print("  train: " + shlex.join(train_command(grid, cell)))
            print("         (= " + shlex.join(["--config", grid.base or "(defaults)"] + cell.overrides) + ")")
            if grid.eval["tasks"]:
                print("  eval:  " + shlex.join(eval_command(grid, cell)))
    if launcher == "slurm":
        print(
            "\narray: SWEEP_DIR="
            + shlex.quote(str(grid.out))
            + " "
            + shlex.join(sbatch_command(grid, extra_sbatch, cells))
        )
        print(
            "  task i: slurm/sweep_array.sh trains cell i (CONFIG=cells/CELL/cell_config.yaml, requeue on "
            "SIGUSR1) then `python -m megahash sweep --finish-cell CELL --out " + str(grid.out) + "`"
        )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="megahash sweep", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--grid", default=None, help="grid YAML (configs/grids/...)")
    p.add_argument("--launcher", choices=["local", "slurm"], default="local")
    p.add_argument("--dry-run", action="store_true", help="print the cells and commands, run nothing")
    p.add_argument("--out", default=None, help="output directory (default: the grid's out, or runs/grids/NAME)")
    p.add_argument("--wait", action="store_true", help="slurm: wait for the array, then write the report")
    p.add_argument("--report-only", action="store_true", help="only (re)write the report of the finished cells")
    p.add_argument("--sbatch", action="append", default=[], help="extra sbatch option (repeatable)")
    p.add_argument("--cells", default=None, help="run only these cells: indices and ranges, e.g. 0-3,7")
    p.add_argument("--tasks", default=None, help="evaluation tasks instead of the grid's (comma-separated; none: none)")
    p.add_argument("--tasks-dir", default=None, help="offline task folder instead of the grid's eval.tasks_dir")
    p.add_argument("--limit", type=float, default=None, help="examples per task instead of the grid's eval.limit")
    p.add_argument("--finish-cell", default=None, help=argparse.SUPPRESS)  # used by slurm/sweep_array.sh
    p.add_argument("overrides", nargs="*", help="config overrides key=value for every cell (e.g. data paths)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    from megahash.command_errors import run_guarded

    args = build_parser().parse_args(argv)

    def go():
        if args.finish_cell:
            if not args.out:
                raise ConfigError("--finish-cell needs --out (the sweep directory)")
            grid = Grid.from_json(json.loads((Path(args.out) / "grid.json").read_text()))
            cell = next((c for c in grid.cells if c.name == args.finish_cell), None)
            if cell is None:
                raise ConfigError(f"no cell {args.finish_cell!r} in {args.out}/grid.json")
            finish_cell(grid, cell)
            return 0
        if not args.grid:
            raise ConfigError("--grid GRID.yaml is required (grids ship under configs/grids/)")
        grid = load_grid(args.grid, args.overrides, args.out)
        override_eval(grid, args.tasks, args.tasks_dir, args.limit)
        chosen = select_cells(grid, args.cells)
        if args.dry_run:
            dry_run(grid, args.launcher, args.sbatch, chosen)
            return 0
        write_plan(grid)
        status = 0
        if not args.report_only:
            if args.launcher == "local":
                status = run_local(grid, cells=chosen)
            else:
                todo = [c for c in chosen if not is_done(c)]
                if todo:
                    job = submit_array(grid, args.sbatch, todo if len(todo) != len(grid.cells) else None)
                    if not args.wait:
                        print(
                            f"sweep: when job {job} is done: megahash sweep --grid {args.grid} --report-only "
                            f"{shlex.join(args.overrides)}".rstrip(),
                            flush=True,
                        )
                        return 0
                    wait_array(job)
                else:
                    print("sweep: every cell is done; nothing submitted", flush=True)
                missing = [c for c in chosen if not is_done(c)]
                if missing:
                    print(
                        f"sweep: {len(missing)} of {len(grid.cells)} cell(s) did not finish (outputs "
                        f"{grid.out / 'slurm'}):",
                        file=sys.stderr,
                        flush=True,
                    )
                    for c in missing:
                        out = grid.out / "slurm" / f"{job}_{c.index}.out" if todo else None
                        if out is not None and out.is_file():
                            record_failure(c, 1, error_line(out.read_text(errors="replace")))
                        why = failure(c)
                        print(f"  cell {c.name}: {why['error'] if why else 'no output'}", file=sys.stderr, flush=True)
                    status = 1
        from megahash.experiments.grid_report import write_report

        done = [c for c in grid.cells if is_done(c)]
        if done:
            paths = write_report(grid)
            left = [c.name for c in grid.cells if not is_done(c)]
            print(
                f"sweep: report of {len(done)}/{len(grid.cells)} cells: {', '.join(str(p) for p in paths)}"
                + (f"; not done: {', '.join(left)}" if left else ""),
                flush=True,
            )
        return status

    return run_guarded(go)


if __name__ == "__main__":
    sys.exit(main())
