"""Launcher helpers (docs/launching.md).

env.py          rank / world / local rank / master address+port from torchrun, DeepSpeed, Open MPI, SLURM
hostfile.py     DeepSpeed/Open MPI hostfile from a SLURM node list (``python -m launch.hostfile``)
run.py          one entry picking srun / torchrun / deepspeed / mpirun / python (``python -m launch``)
local_slurm.py  a real SLURM on localhost with emulated nodes, for tests (``python -m launch.local_slurm``)
"""
