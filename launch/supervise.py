#!/usr/bin/env python
"""Entry script: ``python -m launch.supervise deepspeed|torchrun ...`` (or by path): the launcher
under megahash's supervisor (stop signals -> every rank, exit status 3 after their checkpoint).
The code is :mod:`megahash.launching.supervise`."""

import sys

from megahash.launching.supervise import main

if __name__ == "__main__":
    sys.exit(main())
