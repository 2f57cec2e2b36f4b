"""Attention kernels, one family per package, each written once (issue 26), named as in
flash-linear-attention (``fla.ops.<family>``): ``chunk.py`` the chunked form, ``parallel.py`` the
parallel (whole-map) form, ``recurrent.py`` the token-by-token form, ``naive.py`` the quadratic
reference; helpers shared by the families in :mod:`megahash.ops.utils` (fla: ``fla.ops.utils``).

Which form serves what (the callers are the attention kind files; the megatron-core modules and
the exported Hugging Face model run the same calls):

* training, prefill and decoding: the chunked form (``*_causal``) or, for the batch-shared map, the
  parallel form (:func:`megahash.ops.shared_map.shared_softmax`). Decoding is the chunked form
  called on the new token(s) with the carried state (``state=``, ``need_state=True``): one chunk
  plus the state, the recurrent update written once; encoders use ``*_bidirectional``;
* the recurrent forms (``*_recurrent``, a Python loop over tokens) are test oracles only: no library
  code calls them;
* the naive forms are test oracles; besides, ``orders_maps``/``cumsoftmax_map``/``taylor_kernel``
  give the indicators' attention maps and ``naive_shared_softmax`` is the training path with
  attention dropout.

Families (the kinds that use them name them; a family is math, not a kind):

* :mod:`megahash.ops.linear`: causal linear attention with a feature map, chunked into batched GEMMs
  with the inter-chunk state carried by a cumulative sum (no Python loop over chunks);
* :mod:`megahash.ops.taylor`: Based's second-order Taylor kernel 1 + s + s^2/2 ([Xue25] eq. 4.6);
* :mod:`megahash.ops.orders`: Appendix I's separately normalised orders ([Xue25] eq. 4.14-4.17);
* :mod:`megahash.ops.cumsoftmax`: a causal softmax with one score per key (eq. 4.7-4.8, 4.18) as
  prefix sums relative to a running maximum (online softmax in two fixed levels: chunks, then
  chunks of chunks), no L x L map;
* :mod:`megahash.ops.shared_map`: one softmax map for a whole batch (the fixed-Q/K kinds), with a
  flash-style backward that keeps no L x L map;
* :mod:`megahash.ops.gated_delta`: the gated delta rule ([Yang25b]) in its chunked WY/UT form (one
  triangular solve and batched GEMMs for all chunks; the matrix state carried over chunks by a loop of a
  few calls per chunk, the one family whose operator count grows with L/C) and its short causal
  convolution; fla's kernel on CUDA when installed.

Torch, math and typing only: ``megahash export-hf`` copies every module here (not the package
``__init__`` files: library code imports the form's own module) into the Hugging Face folder
(:mod:`megahash.convert.remote_code`), so an exported model runs the same kernels.
flash-linear-attention is an optional GPU extra (:mod:`megahash.ops.taylor.fla_based`,
:mod:`megahash.ops.gated_delta.fla_gated`), never needed on CPU.
"""

from megahash.ops.cumsoftmax import (
    cumsoftmax_bidirectional,
    cumsoftmax_causal,
    cumsoftmax_map,
    cumsoftmax_recurrent,
    naive_cumsoftmax,
)
from megahash.ops.gated_delta import causal_conv, gated_delta_causal, gated_delta_recurrent
from megahash.ops.linear import chunk_linear, naive_linear, recurrent_linear
from megahash.ops.orders import naive_orders, orders_bidirectional, orders_causal, orders_maps, orders_recurrent
from megahash.ops.shared_map import naive_shared_softmax, shared_softmax
from megahash.ops.taylor import (
    naive_taylor,
    taylor_bidirectional,
    taylor_causal,
    taylor_features,
    taylor_kernel,
    taylor_recurrent,
)

__all__ = [
    "causal_conv",
    "chunk_linear",
    "cumsoftmax_bidirectional",
    "cumsoftmax_causal",
    "cumsoftmax_map",
    "cumsoftmax_recurrent",
    "gated_delta_causal",
    "gated_delta_recurrent",
    "naive_cumsoftmax",
    "naive_linear",
    "naive_orders",
    "naive_shared_softmax",
    "naive_taylor",
    "orders_bidirectional",
    "orders_causal",
    "orders_maps",
    "orders_recurrent",
    "recurrent_linear",
    "shared_softmax",
    "taylor_bidirectional",
    "taylor_causal",
    "taylor_features",
    "taylor_kernel",
    "taylor_recurrent",
]
