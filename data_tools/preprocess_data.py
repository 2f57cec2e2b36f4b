#!/usr/bin/env python
"""``python data_tools/preprocess_data.py ...`` (or ``python -m data_tools.preprocess_data``): a corpus into megatron-core token shards plus
one word-hash side shard per hash spec (docs/data.md).
Thin shell: the code is :mod:`megahash.data.preprocess.preprocess_data`."""

import sys
from pathlib import Path

if __package__ in (None, ""):  # run by path: make the checkout importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megahash.data.preprocess.preprocess_data import main

if __name__ == "__main__":
    sys.exit(main())
