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
import json
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

from megahash.errors import ConfigError
from megahash.experiments.cell_failures import error_line, failure, record_failure
from megahash.experiments.cell_run import eval_command, finish_cell, train_command
from megahash.experiments.grid import Grid, is_done, load_grid, override_eval, select_cells, trained_step, write_plan
from megahash.experiments.local_runner import run_local
from megahash.experiments.slurm_runner import sbatch_command, submit_array, wait_array


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


def check_eval(grid: Grid) -> None:
    """The grid's tasks exist (names, ``tasks_dir``, task code without ``trust_task_code``) before any cell
    trains: one line, exit 2 (they were found only when each trained cell was evaluated, every cell then
    failing with the same error after its whole training). Instant when every name is a YAML of tasks_dir,
    else lm-eval's task index is read (seconds)."""
    if not grid.eval["tasks"]:
        return
    from megahash.eval.run import check_tasks

    try:
        check_tasks(grid.eval["tasks"], grid.eval.get("tasks_dir"), bool(grid.eval.get("trust_task_code")))
    except ConfigError as e:
        raise ConfigError(
            f"grid {grid.name}, eval: {e} (fix the grid's eval section, or pass --tasks/--tasks-dir; nothing was run)"
        ) from None


def build_parser() -> argparse.ArgumentParser:
    from megahash.arguments import ArgumentParser

    p = ArgumentParser(prog="megahash sweep", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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
        from megahash.atomic_write import check_output

        # a file there, a file above it, a read-only place: one line before anything (was a traceback at mkdir)
        check_output(grid.out, "--out" if args.out else f"out of {args.grid}", folder=True)
        override_eval(grid, args.tasks, args.tasks_dir, args.limit)
        chosen = select_cells(grid, args.cells)
        if args.dry_run:
            dry_run(grid, args.launcher, args.sbatch, chosen)
            return 0
        if not args.report_only:
            check_eval(grid)
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
            unreadable: dict = {}
            paths = write_report(grid, unreadable)
            left = [c.name for c in grid.cells if not is_done(c) or c.name in unreadable]
            print(
                f"sweep: report of {len(done) - len(unreadable)}/{len(grid.cells)} cells: "
                f"{', '.join(str(p) for p in paths)}" + (f"; not done: {', '.join(left)}" if left else ""),
                flush=True,
            )
            for name, why in unreadable.items():  # finished cells without a row: said, and exit status 1
                print(f"sweep: cell {name}: {why}", file=sys.stderr, flush=True)
                status = 1
        else:  # --report-only before any cell finished said nothing at all
            print(
                f"sweep: no report: none of the {len(grid.cells)} cells of {grid.name} in {grid.out} is finished yet",
                flush=True,
            )
        return status

    return run_guarded(go)


if __name__ == "__main__":
    sys.exit(main())
