"""Causal linear attention with a feature map: :func:`chunk_linear` (the chunked form the Taylor and
orders families build on: training, prefill and, with a carried state, decoding),
:func:`recurrent_linear` (token by token: the test oracle) and :func:`naive_linear` (the masked
L x L kernel matrix: the test oracle)."""

from megahash.ops.linear.chunk import chunk_linear
from megahash.ops.linear.naive import naive_linear
from megahash.ops.linear.recurrent import recurrent_linear

__all__ = ["chunk_linear", "naive_linear", "recurrent_linear"]
