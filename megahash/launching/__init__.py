"""Everything about launching (docs/launching.md): the one entry picking a launcher (``run``),
hostfiles from SLURM node lists (``hostfile``), the supervisor of deepspeed/torchrun (``supervise``),
rank/world/rendezvous from every launcher's variables (``env``) and a real SLURM on localhost with
emulated nodes (``local_slurm``). The repository's ``launch/*.py`` are thin shells over these mains."""
