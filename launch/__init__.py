"""Launcher entry scripts (docs/launching.md); their library code is :mod:`megahash.launching`.

run.py          one entry picking srun / torchrun / deepspeed / mpirun / python (``python -m launch``)
hostfile.py     DeepSpeed/Open MPI hostfile from a SLURM node list (``python -m launch.hostfile``)
megahash/launching/env.py          rank / world / local rank / master address+port from torchrun,
                                   DeepSpeed, Open MPI, SLURM (also ``launch.env``)
megahash/launching/local_slurm.py  a real SLURM on localhost with emulated nodes, for tests
                                   (``python -m launch.local_slurm``)
"""
from megahash.module_aliases import alias_submodules

alias_submodules(__name__, "megahash.launching", ("env", "local_slurm"))
