"""``python -m launch``: the same as ``python launch/run.py``; the code is :mod:`megahash.launching.run`."""

import sys

from megahash.launching.run import main

sys.exit(main())
