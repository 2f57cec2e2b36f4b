#!/usr/bin/env python
"""``python data_tools/train_tokenizer.py ...`` (or ``python -m data_tools.train_tokenizer``): a sentencepiece tokenizer whose special ids
match the HashFormers words (docs/data.md).
Thin shell: the code is :mod:`megahash.data.preprocess.train_tokenizer`."""

import sys
from pathlib import Path

if __package__ in (None, ""):  # run by path: make the checkout importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megahash.data.preprocess.train_tokenizer import main

if __name__ == "__main__":
    sys.exit(main())
