"""Helpers the kernel families share (fla keeps its in ``fla.ops.utils``): ``fp32.py`` (fp32
accumulation with autocast disabled, output in the input's dtype) and ``documents.py`` (packed
documents: the sums restart at each document start, without a loop over documents)."""

from megahash.ops.utils.documents import document_positions, document_rows, pair_mask
from megahash.ops.utils.fp32 import autocast_off, fp32_kernel, no_autocast

__all__ = ["autocast_off", "document_positions", "document_rows", "fp32_kernel", "no_autocast", "pair_mask"]
