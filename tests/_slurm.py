"""The local SLURM of the launch tests (tests/launching/test_slurm.py, tests/experiments/test_sweep.py): its tools, a clean
environment, and the cluster behind conftest's session-scoped ``cluster`` fixture (one bring-up per run;
every test that uses it is in the ``slurm`` xdist group, so one worker owns it)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from conftest import ROOT, child_env

_note = {"install": ""}


def install_note() -> str:
    """The last line install_cluster_tools.sh printed when it had to install something."""
    return _note["install"]


def ensure_cluster_tools() -> None:
    from megahash.launching.local_slurm import missing_programs

    if missing_programs() or shutil.which("mpirun") is None:
        r = subprocess.run(
            ["bash", "launch/install_cluster_tools.sh"], cwd=ROOT, capture_output=True, text=True, timeout=900
        )
        _note["install"] = (r.stderr.strip().splitlines() or [""])[-1]
    missing = missing_programs()
    if missing:
        pytest.skip(
            f"SLURM is not installed and could not be installed ({', '.join(missing)} missing): "
            f"{install_note() or 'see launch/install_cluster_tools.sh'}"
        )


def clean_env(**extra) -> dict:
    """The test environment without the SLURM/Open MPI variables of any outer job."""
    env = child_env(PYTHON=sys.executable)
    for k in [k for k in env if k.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_", "OMPI_", "PMIX_"))]:
        env.pop(k)
    env.update({k: str(v) for k, v in extra.items()})
    return env


def local_cluster(workdir):
    """Bring up two emulated nodes (8 CPUs and 5 fake GPUs each, so that the jobs of
    tests/launching/test_slurm.py, started together, and a sweep's array run side by side), yield the
    cluster, stop it."""
    ensure_cluster_tools()
    if os.geteuid() != 0:
        pytest.skip("a local SLURM needs root (slurmd runs jobs as their user)")
    from megahash.launching.local_slurm import LocalSlurm, SlurmUnavailable

    c = LocalSlurm(workdir, nodes=2, cpus_per_node=8, gpus_per_node=5)
    try:
        c.start()
    except SlurmUnavailable as e:
        logs = c.logs()
        c.stop()
        pytest.fail(f"the local SLURM did not come up: {e}\n{logs}")
    try:
        yield c
    finally:
        c.stop()
