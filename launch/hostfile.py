#!/usr/bin/env python
"""``python -m launch.hostfile ...`` (or ``python launch/hostfile.py ...``): a DeepSpeed / Open MPI
hostfile from a SLURM node list (docs/launching.md).
Thin shell: the code is :mod:`megahash.launching.hostfile`."""

import sys
from pathlib import Path

if __package__ in (None, ""):  # run by path: make the checkout importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megahash.launching.hostfile import main

if __name__ == "__main__":
    sys.exit(main())
