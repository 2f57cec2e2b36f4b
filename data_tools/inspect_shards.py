#!/usr/bin/env python
"""``python data_tools/inspect_shards.py ...`` (or ``python -m data_tools.inspect_shards``): statistics of a shard set; ``--verify``
checks it against its meta (docs/data.md).
Thin shell: the code is :mod:`megahash.data.preprocess.inspect_shards`."""

import sys
from pathlib import Path

if __package__ in (None, ""):  # run by path: make the checkout importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megahash.data.preprocess.inspect_shards import main

if __name__ == "__main__":
    sys.exit(main())
