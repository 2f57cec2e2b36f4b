"""Causal softmax with one score per key ([Xue25] eq. 4.7-4.8, 4.18).

* :func:`cumsoftmax_causal` (``chunk.py``, online softmax in two fixed levels of chunks): training,
  prefill and decoding (called with the carried state ``(m, num, den)`` on the new tokens);
  :func:`cumsoftmax_bidirectional`: encoders;
* :func:`cumsoftmax_recurrent` (``recurrent.py``) and :func:`naive_cumsoftmax` (``naive.py``): test
  oracles; :func:`cumsoftmax_map` (``naive.py``): the masked L x L map (the indicators' map)."""

from megahash.ops.cumsoftmax.chunk import cumsoftmax_bidirectional, cumsoftmax_causal
from megahash.ops.cumsoftmax.naive import cumsoftmax_map, naive_cumsoftmax
from megahash.ops.cumsoftmax.recurrent import cumsoftmax_recurrent

__all__ = [
    "cumsoftmax_bidirectional",
    "cumsoftmax_causal",
    "cumsoftmax_map",
    "cumsoftmax_recurrent",
    "naive_cumsoftmax",
]
