#!/usr/bin/env python
"""``python -m launch.local_slurm up|down|status --dir DIR``: a real SLURM on localhost with
emulated nodes, for tests (docs/launching.md).
Thin shell: the code is :mod:`megahash.launching.local_slurm`."""

import sys
from pathlib import Path

if __package__ in (None, ""):  # run by path: make the checkout importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megahash.launching.local_slurm import main

if __name__ == "__main__":
    sys.exit(main())
