"""One cell of a sweep, whichever runner runs it: its training and evaluation commands and their environment,
and finishing a trained cell (evaluated on the grid's tasks in this process, then marked done)."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from megahash.atomic_write import write_text_atomic
from megahash.errors import MegahashError
from megahash.experiments.grid import CELL_CONFIG, DONE_FILE, Cell, Grid, trained_step

ROOT = Path(__file__).resolve().parent.parent.parent


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


def cell_env() -> dict:
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

    from megahash.accelerator import process_groups
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
        process_groups.teardown(barrier=False)


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
    write_text_atomic(cell.dir / DONE_FILE, json.dumps(record, indent=1) + "\n")
    if not quiet:
        print(f"sweep: cell {cell.name} done (step {step})", flush=True)
    return record
