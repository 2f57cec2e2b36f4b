"""Helpers the kernel families share (fla keeps its in ``fla.ops.utils``): ``fp32.py`` (fp32
accumulation with autocast disabled, output in the input's dtype), ``documents.py`` (packed
documents: the sums restart at each document start, without a loop over documents) and ``window.py``
(the keys a sliding window of softmax attention sees)."""

from megahash.ops.utils.documents import document_positions, document_rows, pair_mask
from megahash.ops.utils.fp32 import autocast_off, fp32_kernel, no_autocast
from megahash.ops.utils.window import band_mask, in_window

__all__ = [
    "autocast_off",
    "band_mask",
    "document_positions",
    "document_rows",
    "fp32_kernel",
    "in_window",
    "no_autocast",
    "pair_mask",
]
