"""``megahash sweep --launcher local``: the unfinished cells trained and evaluated one after another on this
machine, a failed cell recorded and the sweep going on."""

from __future__ import annotations

import subprocess
import sys
import time

from megahash.errors import MegahashError, one_line
from megahash.experiments.cell_failures import FAILED_FILE, error_line, failure, record_failure
from megahash.experiments.cell_run import ROOT, cell_env, finish_cell, train_command
from megahash.experiments.grid import Grid, is_done


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
                    train_command(grid, cell), cwd=ROOT, env=cell_env(), stdout=log, stderr=subprocess.STDOUT
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
