"""Attention kernels, one family per package, each written once (issue 26), in the layout of
flash-linear-attention (``fla.ops.<family>``): the chunked/parallel form used for training and
prefill, the recurrent form used for decoding and the naive form kept as the test oracle.

Families (the kinds that use them name them; a family is math, not a kind):

* :mod:`megahash.ops.linear`: causal linear attention with a feature map, chunked into batched GEMMs
  with the inter-chunk state carried by a cumulative sum (no Python loop over chunks);
* :mod:`megahash.ops.taylor`: Based's second-order Taylor kernel 1 + s + s^2/2 ([Xue25] eq. 4.6);
* :mod:`megahash.ops.orders`: Appendix I's separately normalised orders ([Xue25] eq. 4.14-4.17);
* :mod:`megahash.ops.cumsoftmax`: a causal softmax with one score per key (eq. 4.7-4.8, 4.18) as
  prefix sums relative to a running maximum (online softmax in two fixed levels: chunks, then
  chunks of chunks), no L x L map;
* :mod:`megahash.ops.shared_map`: one softmax map for a whole batch (the fixed-Q/K kinds), with a
  flash-style backward that keeps no L x L map.

Torch, math and typing only: ``megahash export-hf`` copies every module here into the Hugging Face
folder (:mod:`megahash.convert.remote_code`), so an exported model runs the same kernels.
flash-linear-attention is an optional GPU extra (:mod:`megahash.ops.taylor.fla`), never needed on CPU.
"""
