"""Launcher library: rank/world/rendezvous from every launcher's variables (``env``) and a real SLURM
on localhost with emulated nodes (``local_slurm``). The entry scripts are the repository's
``launch/`` folder (``python -m launch``, docs/launching.md)."""
