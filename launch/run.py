#!/usr/bin/env python
"""``python launch/run.py ...``, the same as ``python -m launch ...``: one entry picking srun /
torchrun / deepspeed / mpirun / python (docs/launching.md).
Thin shell: the code is :mod:`megahash.launching.run`."""

import sys
from pathlib import Path

if __package__ in (None, ""):  # run by path: make the checkout importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megahash.launching.run import main

if __name__ == "__main__":
    sys.exit(main())
