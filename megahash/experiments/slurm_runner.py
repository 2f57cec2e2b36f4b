"""``megahash sweep --launcher slurm``: the cells as one SLURM job array (``slurm/sweep_array.sh``, a task per
cell), submitted and waited for."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Sequence

from megahash.errors import MegahashError
from megahash.experiments.cell_run import ROOT, cell_env
from megahash.experiments.grid import Grid

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
    env = cell_env()
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
