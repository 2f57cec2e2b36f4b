#!/usr/bin/env python
"""``python data_tools/make_eval_tasks.py ...`` (or ``python -m data_tools.make_eval_tasks``): an offline lm-eval task suite from
held-out documents (docs/data.md).
Thin shell: the code is :mod:`megahash.data.preprocess.make_eval_tasks`."""

import sys
from pathlib import Path

if __package__ in (None, ""):  # run by path: make the checkout importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megahash.data.preprocess.make_eval_tasks import main

if __name__ == "__main__":
    sys.exit(main())
