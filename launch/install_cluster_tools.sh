#!/usr/bin/env bash
# Install the cluster tools the launch tests (tests/launching/test_slurm.py) and mpirun launches use, when missing:
#   Debian: slurmctld slurmd slurm-client (SLURM 22.05, run locally by megahash/launching/local_slurm.py),
#           openmpi-bin libopenmpi-dev (mpirun), bible-kjv (the offline `bible-kjv` corpus source);
#   PyPI:   mpi4py (the `mpi` extra), with the CPU constraints file.
# Needs root and apt-get for the Debian part. If anything cannot be installed this prints why and
# still exits 0: the tests that need it skip with that reason instead of failing the run.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
have() { command -v "$1" >/dev/null 2>&1 || [ -x "/usr/sbin/$1" ]; }

pkgs=()
have slurmctld || pkgs+=(slurmctld)
have slurmd || pkgs+=(slurmd)
have sbatch || pkgs+=(slurm-client)
have mpirun || pkgs+=(openmpi-bin)
have mpicc || pkgs+=(libopenmpi-dev)
have bible || pkgs+=(bible-kjv)
if [ ${#pkgs[@]} -gt 0 ]; then
  if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "install_cluster_tools: cannot install ${pkgs[*]}: needs root and apt-get (SLURM/MPI tests will skip)" >&2
  else
    export DEBIAN_FRONTEND=noninteractive
    if ! apt-get update -q >/tmp/megahash-apt.log 2>&1 \
       || ! apt-get install -y -q --no-install-recommends "${pkgs[@]}" >>/tmp/megahash-apt.log 2>&1; then
      echo "install_cluster_tools: apt-get install ${pkgs[*]} failed: $(tail -n 1 /tmp/megahash-apt.log) (SLURM/MPI tests will skip)" >&2
    fi
  fi
fi
if have mpicc && ! $PY -c "import mpi4py" >/dev/null 2>&1; then
  $PY -m pip install -q -c constraints/cpu.txt mpi4py \
    || echo "install_cluster_tools: pip install mpi4py failed (mpirun launches still work without it)" >&2
fi
exit 0
