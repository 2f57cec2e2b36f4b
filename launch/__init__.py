"""Launcher entry scripts (docs/launching.md), each a thin shell over :mod:`megahash.launching`:

run.py          one entry picking srun / torchrun / deepspeed / mpirun / python (``python -m launch``)
hostfile.py     DeepSpeed/Open MPI hostfile from a SLURM node list (``python -m launch.hostfile``)
supervise.py    the launcher under megahash's supervisor (stop signals -> every rank, exit 3)
local_slurm.py  a real SLURM on localhost with emulated nodes, for tests (``python -m launch.local_slurm``)

Rank / world / rendezvous from every launcher's variables: :mod:`megahash.launching.env`.
"""
