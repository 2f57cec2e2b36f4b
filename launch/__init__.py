"""Launcher helpers: rank/world resolution from torchrun, DeepSpeed, SLURM and Open MPI."""
